"""Paired runs (benchmark/paired.py): systems taking turns round by round in one process (no timing assertions:
the turns' accounting runs on a fake clock, the end-to-end run checks outputs and bookkeeping)."""

from __future__ import annotations

import json
import math
import threading

import pytest
from typer.testing import CliRunner

from benchmark.cli import app
from benchmark.paired import GcTimer, TurnClock, Turns, check_pairable, turn_order
from benchmark.report import _place_balance, first_places
from benchmark.run import parse_system
from tests.fixtures.tiny_models import save_tiny_model


class FakeTime:
    """A clock that moves only when a participant works (hand-overs take no time on it)."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _take_turns(costs: dict[str, list[float]]) -> tuple[Turns, list[str], FakeTime]:
    """Each participant works its rounds (one cost each) in a thread of its own, passing the turn after each."""
    fake = FakeTime()
    turns = Turns(list(costs), now=fake, counters=lambda: {"major": int(fake.t), "minor": int(fake.t) * 2})
    log: list[str] = []
    inside: list[str] = []  # who is working now: never two at once
    overlaps: list[tuple[str, str]] = []

    def participant(name: str) -> None:
        turns.acquire(name)
        for i, cost in enumerate(costs[name]):
            if inside:
                overlaps.append((inside[0], name))
            inside.append(name)
            log.append(name)
            fake.t += cost
            inside.remove(name)
            if i < len(costs[name]) - 1:
                turns.pass_turn(name)
        turns.leave(name)

    threads = [threading.Thread(target=participant, args=(name,)) for name in reversed(list(costs))]
    for thread in threads:  # started in reverse: the order comes from the turns, not from who starts first
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert not any(thread.is_alive() for thread in threads), "a participant never got its turn back"
    assert not overlaps
    return turns, log, fake


def test_turns_go_round_robin_and_each_participant_is_charged_its_own_work():
    turns, log, fake = _take_turns({"a": [1.0, 2.0, 4.0], "b": [10.0, 20.0], "c": [100.0, 200.0, 400.0, 800.0]})
    assert log == ["a", "b", "c", "a", "b", "c", "a", "c", "c"]  # b left after two rounds, a after three
    assert turns.busy_s == {"a": 7.0, "b": 30.0, "c": 1500.0}
    assert turns.turns == {"a": 3, "b": 2, "c": 4}
    # the process's page faults are charged like its seconds, to whoever held the turn
    assert turns.faults == {"a": {"major": 7, "minor": 14}, "b": {"major": 30, "minor": 60},
                            "c": {"major": 1500, "minor": 3000}}
    assert fake.t == 1537.0 and turns.holder is None


def test_a_participants_outside_processes_run_only_while_it_holds_the_turn():
    """`external(name, running)`: called as a participant takes the turn and as it passes it, not as it leaves, so a
    system's drafter workers compute beside its own rounds only (session 46's trace D: `specactor`'s ran 5.4-6.7 s
    a run during the other systems' turns)."""
    events: list[tuple[str, bool]] = []
    turns = Turns(["a", "b"], external=lambda name, running: events.append((name, running)))
    done = threading.Event()

    def b() -> None:
        turns.acquire("b")
        turns.pass_turn("b")
        turns.leave("b")
        done.set()

    thread = threading.Thread(target=b)
    thread.start()
    turns.acquire("a")
    turns.pass_turn("a")
    turns.leave("a")
    thread.join(timeout=10)
    assert done.is_set()
    assert events == [("a", True), ("a", False), ("b", True), ("b", False), ("a", True), ("b", True)]


def test_suspended_processes_take_no_cpu_until_continued():
    import subprocess
    import sys
    import time

    import psutil

    from benchmark.paired import suspend_processes

    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        process = psutil.Process(spin.pid)
        time.sleep(0.3)
        suspend_processes([spin.pid], True)
        stopped_at = sum(process.cpu_times()[:2])
        time.sleep(0.5)
        assert process.status() == psutil.STATUS_STOPPED
        assert sum(process.cpu_times()[:2]) - stopped_at < 0.05
        suspend_processes([spin.pid], False)
        assert process.status() != psutil.STATUS_STOPPED
        suspend_processes([2 ** 22 + 12345], True)  # a process gone is skipped
    finally:
        spin.kill()
        spin.wait()


def test_passing_a_turn_one_does_not_hold_is_refused():
    turns = Turns(["a", "b"])
    with pytest.raises(RuntimeError, match="does not hold"):
        turns.pass_turn("b")
    with pytest.raises(ValueError, match="distinct"):
        Turns(["a", "a"])


def test_a_turn_clock_marks_finishes_on_its_own_seconds_and_passes_the_turn_each_round():
    fake = FakeTime()
    turns = Turns(["solo"], now=fake)
    clock = TurnClock(turns, "solo")
    turns.acquire("solo")
    assert clock.start() == 0.0
    fake.t = 3.0
    clock.progress(0, 2)
    fake.t = 5.0
    clock.progress(2, 2)  # both finished in the second round
    assert clock.times == [5.0, 5.0] and clock.round_ends == [3.0, 5.0] and turns.turns["solo"] == 2


def test_collections_are_charged_to_the_thread_that_ran_them():
    import gc

    timer = GcTimer()
    gc.callbacks.append(timer)
    try:
        worker = threading.Thread(target=gc.collect, name="paired-x")
        worker.start()
        worker.join()
    finally:
        gc.callbacks.remove(timer)
    assert set(timer.by_thread) == {"paired-x"} and timer.by_thread["paired-x"] > 0.0
    # a full collection, counted under generation 2; the unpaired worker reports the sum over threads
    assert timer.collections.get(2, 0) >= 1 and timer.seconds == pytest.approx(timer.by_thread["paired-x"])


def test_turn_order_rotates_with_the_repeat():
    assert [turn_order(["a", "b", "c"], r) for r in range(4)] == [
        ["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    assert turn_order([], 1) == []  # every system failed in an earlier repeat: the later ones are skipped


@pytest.mark.parametrize("systems, replicas, why", [
    (["ar"], 1, "at least two"),
    (["ar", "vllm"], 1, "engine systems only"),
    (["ar", "oracle"], 1, "outside the engine"),
    (["ar", "decoupled"], 1, "outside the engine"),
    (["ar", "specactor"], 2, "--replicas 1"),
])
def test_systems_that_cannot_take_turns_are_refused_with_the_reason(systems, replicas, why):
    assert why in check_pairable(systems, [parse_system(s)[0] for s in systems], replicas)


def test_engine_systems_copies_and_draft_lengths_can_take_turns():
    systems = ["ar", "ar#2", "specactor", "coupled@2"]
    assert [parse_system(s) for s in systems] == [("ar", None), ("ar", None), ("specactor", None), ("coupled", 2)]
    assert check_pairable(systems, [parse_system(s)[0] for s in systems], 1) is None
    with pytest.raises(ValueError, match="NAME#N"):
        parse_system("ar#x")


def test_the_report_gives_place_balanced_ratios_and_says_when_the_rotation_is_not_balanced():
    """The geometric mean of `ar`'s makespan over each system's per repeat, and the first places counted from each
    repeat's turn order: balanced with 2 repeats of 2 systems, not with 3."""
    def systems(ar: list[float], spec: list[float]) -> dict:
        orders = [["ar", "specactor"], ["specactor", "ar"]] * 2
        paired = [{"systems": orders[r], "turns": 1} for r in range(len(ar))]
        return {"ar": {"makespan_s": ar, "paired": paired}, "specactor": {"makespan_s": spec, "paired": paired}}

    balanced = systems([103.0, 97.0], [100.0, 100.0])  # ar first: 1.03; specactor first: 0.97
    assert first_places(balanced) == {"ar": 1, "specactor": 1}
    line = _place_balance(balanced)[-1]
    assert f"`specactor` {math.sqrt(1.03 * 0.97):.3f}" in line and "balanced." in line and "not balanced" not in line
    unbalanced = systems([103.0, 97.0, 103.0], [100.0, 100.0, 100.0])
    assert first_places(unbalanced) == {"ar": 2, "specactor": 1}
    assert "**not balanced**" in _place_balance(unbalanced)[-1]


def test_cli_refuses_a_paired_plan_it_cannot_run(tmp_path):
    result = CliRunner().invoke(app, ["--trace", "quick", "--systems", "ar,vllm", "--paired", "--out", str(tmp_path)])
    assert result.exit_code == 2 and "engine systems only" in result.output


def test_a_paired_run_gives_each_system_its_own_turns_and_the_same_tokens(tmp_path):
    target = save_tiny_model(tmp_path / "target", "llama", seed=0)
    drafter = save_tiny_model(tmp_path / "drafter", "llama", seed=0, num_layers=1)
    out = tmp_path / "out"
    systems = ["ar", "specactor", "coupled", "ar#2"]
    result = CliRunner().invoke(app, [
        "--trace", "quick", "--model", f"{target}:{drafter}", "--systems", ",".join(systems), "--paired",
        "--repeats", "2", "--prompts", "2", "--samples", "2", "--max-new-tokens", "8", "--out", str(out)])
    assert result.exit_code == 0, result.output
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["paired"] is True
    report = (out / "results.md").read_text()
    assert "Paired run" in report and "page faults major / minor" in report
    assert set(results["systems"]) == set(systems)
    for name in systems:
        entry = results["systems"][name]
        assert "error" not in entry and entry["repeats"] == 2, name
        assert entry["identical_to_ar"] == [1.0, 1.0], name
        assert [held["turns"] > 0 for held in entry["paired"]] == [True, True], name  # kept in results.json
    for repeat, order in enumerate([systems, systems[1:] + systems[:1]]):
        spec = json.loads((out / "runs" / f"paired-{repeat}.spec.json").read_text())
        assert [label for label, _ in spec] == order  # one process per repeat, the turn order rotated
        for name in systems:
            run = json.loads((out / "runs" / f"{name}-{repeat}.json").read_text())
            assert run["paired"]["systems"] == order
            assert run["paired"]["external_cpu_s"] >= 0.0  # `specactor`'s drafter worker, during its own turns
            assert 0.0 <= run["paired"]["gc_s"] < run["makespan_s"]  # collections its own turns triggered
            assert run["paired"]["page_faults"]["minor"] > 0  # its rollout maps fresh pages (its KV cache at least)
            stats = run["engine_stats"]
            timeline = [entry["t"] for entry in stats["timeline"]]
            # the run's own seconds: the round ends rise to at most its makespan, well inside the repeat's wall time
            assert timeline == sorted(timeline) and timeline[-1] <= run["makespan_s"] == stats["total_s"]
            assert run["makespan_s"] < run["paired"]["wall_s"]
            assert run["paired"]["turns"] >= len(timeline)
            assert max(run["finish_times_s"]) <= run["makespan_s"]
