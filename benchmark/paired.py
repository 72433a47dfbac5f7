"""Paired runs: engine systems that take turns round by round in one process, so that every system meets the
same machine state (`python -m benchmark --paired ...`, docs/benchmarking.md "Paired runs").

Why: on the shared 2-core machines the memory read bandwidth moves between two states (~43-48 and ~63-70 GB/s)
that last from seconds to minutes (bench/session43). A decode step at a few rows streams every weight, so a whole
run meets one state or the other, and on trace D a system's makespan moves by ~30% with the state it met
(`specactor` 22.3 s in the fast state, 28.9-30.0 s in the slow one). Interleaved repeats of separate processes
then compare the states the systems met as much as the systems: `specactor` and `coupled-feature` ran level in
each state and 0.89x apart at the medians of six.

How: every system of the plan is loaded, warmed up and prepared in one process, then their timed rollouts run in
one thread each and take turns (`Turns`): a system runs one engine round (the admission before it included),
hands the turn to the next system and waits for its own. One system computes at a time; a system's makespan is
the sum of its own turns (`Turns.busy_s`), its finish times are read on that clock (`TurnClock`). Turns are one
round long (~0.06-0.13 s on D and B), far shorter than a memory state lasts, so every system meets each state for
about the same share of its run. The price: the systems share the process (one peak RSS, one CPU account), the
caches are cold at each turn for every system alike, and each turn hand-over wakes a thread. Pairing `ar` with
itself measures what is left of the harness's own bias (bench/session44).

Runs are written as the standard harness writes them (runs/<system>-<r>.json, results.json, results.md), so the
report, the identity check against `ar` and the plots are the same. Each repeat is a fresh process; the systems'
turn order rotates with the repeat. Engine systems only: vLLM runs in a process of its own, `hf` and the oracle
rows are not engine rounds, and drafter workers or replicas compute outside the turns. `specactor`'s drafter worker
(traces with a draft model) is allowed: its process is stopped (SIGSTOP) whenever its system does not hold the turn
and continued when it does (`Turns`' `external` hook, `suspend_processes`), so it computes beside its own verifier
only, as in a run of its own. Until session 47 it ran on during the others' turns: in session 46's trace D run it
computed 5.4-6.7 s a run, taken from the systems that held the turn, while dynamic decoupling explored its arm.
Each run records the CPU its workers used (`paired.external_cpu_s`).
Each run also records the page faults of its turns (`paired.page_faults`): on traces B and C the system in the first
place took ~6x the others' minor faults and ran up to 3% slower (bench/session45; cause not found): the rotation
spreads that place over the systems.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from benchmark.interface import FinishClock
from benchmark.machine import GcTimer

logger = logging.getLogger(__name__)


class Turns:
    """Round-robin turns among named participants: exactly one holds the turn at a time.

    A participant `acquire`s before its first round, `pass_turn`s after each round (the next participant in the
    order that is still running gets the turn; it waits for its own again) and `leave`s when it has finished. The
    time between a participant's acquiring and passing is its own (`busy_s`); hand-overs are nobody's. So are the
    process's page faults in that time (`faults`, from `counters`): one participant computes at a time.
    """

    def __init__(self, order: Sequence[str], now: Callable[[], float] = time.perf_counter,
                 counters: Callable[[], dict[str, int]] | None = None,
                 external: Callable[[str, bool], None] | None = None) -> None:
        if not order or len(set(order)) != len(order):
            raise ValueError(f"turns need distinct participants, got {list(order)}")
        self._cond = threading.Condition()
        self._running = list(order)
        self._holder: str | None = order[0]
        self._now = now
        self._since = 0.0
        self._counters = counters or page_faults
        # external(name, True) as `name` takes the turn, (name, False) as it passes it (not as it leaves): its
        # processes outside this one (drafter workers) run only while it holds the turn
        self._external = external
        self._counted_since: dict[str, int] = {}
        self.busy_s = {name: 0.0 for name in order}
        self.turns = {name: 0 for name in order}
        self.faults: dict[str, dict[str, int]] = {name: {} for name in order}

    @property
    def holder(self) -> str | None:
        return self._holder

    def acquire(self, name: str) -> None:
        """Block until `name` holds the turn; its clock runs from then."""
        with self._cond:
            self._cond.wait_for(lambda: self._holder == name)
            if self._external is not None:
                self._external(name, True)
            self._since = self._now()
            self._counted_since = self._counters()

    def pass_turn(self, name: str) -> None:
        """End `name`'s turn and wait for its next one."""
        self._release(name, leaving=False)
        self.acquire(name)

    def leave(self, name: str) -> None:
        """End `name`'s last turn: the others take turns without it."""
        self._release(name, leaving=True)

    def elapsed(self, name: str) -> float:
        """`name`'s own seconds so far (its current turn included)."""
        with self._cond:
            return self.busy_s[name] + (self._now() - self._since if self._holder == name else 0.0)

    def _release(self, name: str, leaving: bool) -> None:
        with self._cond:
            if self._holder != name:
                raise RuntimeError(f"{name} passed a turn it does not hold (holder: {self._holder})")
            self.busy_s[name] += self._now() - self._since
            self.turns[name] += 1
            own = self.faults[name]
            for key, count in self._counters().items():
                own[key] = own.get(key, 0) + count - self._counted_since.get(key, count)
            if self._external is not None and not leaving:
                self._external(name, False)
            position = self._running.index(name)
            if leaving:
                self._running.remove(name)
                self._holder = self._running[position % len(self._running)] if self._running else None
            else:
                self._holder = self._running[(position + 1) % len(self._running)]
            self._cond.notify_all()


def suspend_processes(pids: Sequence[int], suspended: bool) -> None:
    """Stop (SIGSTOP) or continue (SIGCONT) these processes; ones that have exited are skipped."""
    import psutil

    for pid in pids:
        try:
            process = psutil.Process(pid)
            process.suspend() if suspended else process.resume()
        except psutil.NoSuchProcess:
            continue


def page_faults() -> dict[str, int]:
    """This process's page faults so far: major ones read a page back from disk (a file-backed page, the memory-
    mapped weights among them, that the kernel dropped under memory pressure), minor ones map a page in memory."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {"major": usage.ru_majflt, "minor": usage.ru_minflt}


class TurnClock(FinishClock):
    """A system's `FinishClock` on its own turns' clock; each engine round's progress call passes the turn."""

    def __init__(self, turns: Turns, name: str) -> None:
        super().__init__()
        self.turns, self.name = turns, name
        self.round_ends: list[float] = []  # own seconds at the end of each round

    def start(self) -> float:
        self.times = []
        return 0.0

    def mark(self, count: int = 1) -> None:
        self.times.extend([self.turns.elapsed(self.name)] * count)

    def progress(self, finished: int, total: int) -> None:
        super().progress(finished, total)
        self.round_ends.append(self.turns.elapsed(self.name))
        self.turns.pass_turn(self.name)


def check_pairable(systems: Sequence[str], bases: Sequence[str], replicas: int) -> str | None:
    """Why these systems (as named, and their registry names: `coupled@2` -> `coupled`) cannot run paired (None:
    they can)."""
    from benchmark.engine_systems import ENGINE_VARIANTS

    engine = {variant.name: variant for variant in ENGINE_VARIANTS}
    if len(systems) < 2:
        return "--paired needs at least two systems"
    if replicas > 1:
        return "--paired runs engines in one process: use --replicas 1"
    for name, base in zip(systems, bases):
        variant = engine.get(base)
        if variant is None:
            return f"--paired runs engine systems only; {name!r} is not one (vLLM and hf run in their own ways)"
        if variant.needs_reference or variant.mode == "decoupled":
            return (f"--paired cannot run {name!r}: its drafts come from outside the engine's rounds "
                    "(the oracle's references, drafter workers)")
    return None


def run_paired_once(labelled: Sequence[tuple[str, Any]]) -> dict[str, dict[str, Any]]:
    """Load, warm up and prepare every (label, RunSpec), then time their rollouts taking turns (module docstring):
    each label's figures, as `benchmark.worker.run_once` gives them for a run of its own."""
    import torch

    from benchmark.machine import busy_cpu_s, read_bandwidth_gbps
    from benchmark.systems import build_system
    from benchmark.traces import build_requests, sampling_config
    from benchmark.worker import WARMUP_NEW_TOKENS, _cpu_shares, _figures, _timed, peak_rss_mb

    threads = labelled[0][1].threads
    torch.set_num_threads(threads)
    loadavg_start = os.getloadavg()[0]
    systems, setup = {}, {}
    for label, spec in labelled:
        requests, sampling = build_requests(spec.trace), sampling_config(spec.trace)
        system, load_s = _timed(build_system, spec)
        warmup = sampling.model_copy(update={"n": 1, "max_new_tokens": WARMUP_NEW_TOKENS})
        _, warmup_s = _timed(system.generate, requests[:1], warmup, FinishClock())
        history = json.loads(Path(spec.history_path).read_text(encoding="utf-8")) if spec.history_path else None
        system.set_history(requests, history)
        _, prepare_s = _timed(system.prepare, requests, sampling)
        systems[label] = (system, requests, sampling)
        setup[label] = {"load_s": load_s, "warmup_s": warmup_s, "prepare_s": prepare_s}
        print(f"{label}: loaded in {load_s:.1f} s, warm-up {warmup_s:.1f} s, prepare {prepare_s:.1f} s",
              file=sys.stderr, flush=True)
    gc.collect()
    # every system's objects live in this process: a garbage collection walks them all and is charged to whichever
    # system's turn triggered it; frozen, the collections of the timed run walk only what the rollouts allocate
    gc.freeze()
    gc_seconds = GcTimer()

    def external(label: str, running: bool) -> None:
        suspend_processes(systems[label][0].external_pids(), not running)

    for label, _ in labelled:  # every system's workers stopped until it first takes the turn
        external(label, False)
    turns = Turns([label for label, _ in labelled], external=external)
    clocks = {label: TurnClock(turns, label) for label, _ in labelled}
    outcome: dict[str, Any] = {}
    grad = torch.is_grad_enabled()

    def rollout(label: str) -> None:
        system, requests, sampling = systems[label]
        torch.set_num_threads(threads)
        turns.acquire(label)
        try:
            with torch.set_grad_enabled(grad):
                outcome[label] = system.generate(requests, sampling, clocks[label])
        except BaseException as exc:  # reported per system; the others finish their rollouts
            outcome[label] = exc
        finally:
            turns.leave(label)

    gc.callbacks.append(gc_seconds)
    bandwidth_start = read_bandwidth_gbps()
    # drafter workers are processes of their own, stopped outside their system's turns: what they compute competes
    # with their own verifier only (paused by dynamic decoupling, they take none)
    external_before = {label: systems[label][0].external_cpu_s() for label, _ in labelled}
    busy_before, own_before = busy_cpu_s(), time.process_time()
    started = time.perf_counter()
    workers = [threading.Thread(target=rollout, args=(label,), name=f"paired-{label}") for label, _ in labelled]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    wall_s = time.perf_counter() - started
    for label, _ in labelled:  # a system that failed may have left its workers stopped; close() needs them running
        external(label, True)
    gc.callbacks.remove(gc_seconds)
    gc.unfreeze()
    external_s = {label: systems[label][0].external_cpu_s() - external_before[label] for label, _ in labelled}
    contention = _cpu_shares(busy_before, own_before, wall_s, threads, sum(external_s.values()))
    bandwidth_end = read_bandwidth_gbps()
    peak = peak_rss_mb()
    results = {}
    for label, spec in labelled:
        system = systems[label][0]
        system.close()
        generation = outcome.get(label)
        if isinstance(generation, BaseException) or generation is None:
            results[label] = {"error": f"{type(generation).__name__}: {generation}"}
            continue
        makespan_s = turns.busy_s[label]
        _virtual_timeline(generation.engine_stats, clocks[label].round_ends, makespan_s)
        results[label] = _figures(spec, generation, clocks[label], makespan_s) | setup[label] | {
            "peak_rss_mb": peak, "loadavg_1m_start": loadavg_start, "loadavg_1m_end": os.getloadavg()[0],
            "threads": threads, "cpu_s": None, "cpu_share": None,  # one process: not separable per system
            "others_cpu_share": contention["others_cpu_share"],
            "mem_read_gbps": (bandwidth_start + bandwidth_end) / 2,
            "mem_read_gbps_start_end": [bandwidth_start, bandwidth_end],
            "paired": {"turns": turns.turns[label], "wall_s": wall_s, "systems": [lab for lab, _ in labelled],
                       "external_cpu_s": external_s[label],
                       "gc_s": gc_seconds.by_thread.get(f"paired-{label}", 0.0),
                       "page_faults": turns.faults[label]},
        }
    return results


def _virtual_timeline(stats: dict[str, Any] | None, round_ends: list[float], makespan_s: float) -> None:
    """An engine's stats read on its own turns' clock: its wall-clock total and round times include the other
    systems' turns. total_s becomes the own seconds (so the time split's host share is right) and each
    timeline entry's `t` the own seconds at the end of its round (one progress call per round)."""
    if not stats:
        return
    stats["wall_total_s"] = stats.get("total_s")
    stats["total_s"] = makespan_s
    timeline = stats.get("timeline") or []
    if len(timeline) == len(round_ends):
        for entry, end in zip(timeline, round_ends):
            entry["t"] = round(end, 4)


def turn_order(systems: Sequence[str], repeat: int) -> list[str]:
    """The systems' turn order in repeat `repeat`: rotated by `repeat` places, so none always goes first (none left,
    after the others failed: an empty order)."""
    shift = repeat % len(systems) if systems else 0
    return [*systems[shift:], *systems[:shift]]


def run_paired_worker(specs: Sequence[tuple[str, Any]], out_json: Path) -> dict[str, dict[str, Any]]:
    """One paired repeat in a fresh interpreter (as `run.run_worker` runs a single system); its stderr goes to a
    .log beside the JSON."""
    from benchmark.machine import REPO_ROOT

    spec_path = out_json.with_suffix(".spec.json")
    spec_path.write_text(json.dumps([[label, spec.to_dict()] for label, spec in specs], indent=1), encoding="utf-8")
    threads = specs[0][1].threads
    env = os.environ | {
        "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
    }
    log_path = out_json.with_suffix(".log")
    with log_path.open("w", encoding="utf-8") as log:
        proc = subprocess.run([sys.executable, "-m", "benchmark.paired", str(spec_path), str(out_json)],
                              env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
    if proc.returncode != 0:
        tail = log_path.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-5:]
        raise RuntimeError(f"paired run of {', '.join(label for label, _ in specs)} failed "
                           f"(exit {proc.returncode}): " + " | ".join(tail))
    return json.loads(out_json.read_text(encoding="utf-8"))


def main(argv: list[str] | None = None) -> None:
    from benchmark.machine import log_engine_progress
    from benchmark.systems import RunSpec

    args = sys.argv[1:] if argv is None else argv
    log_engine_progress()
    if len(args) != 2:
        raise SystemExit("usage: python -m benchmark.paired SPECS.json OUT.json")
    specs = [(label, RunSpec.from_dict(spec)) for label, spec in json.loads(Path(args[0]).read_text(encoding="utf-8"))]
    Path(args[1]).write_text(json.dumps(run_paired_once(specs)), encoding="utf-8")


if __name__ == "__main__":
    main()
