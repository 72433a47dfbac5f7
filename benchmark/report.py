"""`results.md`: one table per benchmark run, medians with min-max over repeats."""

from __future__ import annotations

import datetime
import math
import statistics
from typing import Any, Sequence

from benchmark.metrics import spread


def _cell(values: Sequence[float | None], fmt: str) -> str:
    stats = spread(values)
    if stats is None:
        return "-"
    if stats["min"] == stats["max"]:
        return format(stats["median"], fmt)
    return f"{format(stats['median'], fmt)} ({format(stats['min'], fmt)}-{format(stats['max'], fmt)})"


def _ratio(entry: dict[str, Any], reference: dict[str, Any] | None) -> str:
    mine, ref = spread(entry["tokens_per_s"]), spread(reference["tokens_per_s"]) if reference else None
    if mine is None or ref is None or not ref["median"]:
        return "-"
    return f"{mine['median'] / ref['median']:.2f}x"


COLUMNS = ("system", "runs", "makespan s", "tokens/s", "vs ar", "output tokens", "tail share", "accept len",
           "accept rate", "identical to ar", "peak RSS MB", "load s", "load avg", "others' CPU", "memory GB/s")


def system_row(name: str, entry: dict[str, Any], reference: dict[str, Any] | None) -> list[str]:
    return [
        f"`{name}`", str(entry["repeats"]), _cell(entry["makespan_s"], ".1f"), _cell(entry["tokens_per_s"], ".1f"),
        _ratio(entry, reference), _cell(entry["output_tokens"], ".0f"), _cell(entry["tail_share"], ".2f"),
        _cell(entry["mean_accept_len"], ".2f"), _cell(entry["acceptance_rate"], ".3f"),
        _cell(entry["identical_to_ar"], ".3f"), _cell(entry["peak_rss_mb"], ".0f"), _cell(entry["load_s"], ".1f"),
        _cell(entry["loadavg_1m_start"], ".2f"), _cell(entry.get("others_cpu_share", []), ".0%"),
        _cell(entry.get("mem_read_gbps", []), ".0f"),
    ]


def render_markdown(results: dict[str, Any]) -> str:
    trace, settings, machine = results["trace"], results["settings"], results["machine"]
    systems = results["systems"]
    reference = systems.get("ar")
    sampling = "greedy" if trace["temperature"] == 0 else f"temperature {trace['temperature']}, top-p {trace['top_p']}"
    batch = settings["max_batch_size"] or f"all {settings['num_sequences']}"
    when = datetime.datetime.fromtimestamp(results["started"]).strftime("%Y-%m-%d %H:%M")
    lines = [
        f"# Trace {trace['name']}: {trace['description']}",
        "",
        f"- {settings['num_sequences']} sequences ({trace['samples_per_prompt']} per prompt), at most "
        f"{trace['max_new_tokens']} new tokens, {sampling}, seed {trace['seed']}",
        f"- target `{settings['target']}`, drafter `{settings['drafter'] or 'ngram'}`, {settings['dtype']}, "
        f"k={settings['num_draft_tokens']}, batch {batch}, {settings['threads']} threads"
        + (f" shared by {settings['replicas']} rollout replicas (batch {batch} each)"
           if settings.get("replicas", 1) > 1 else "")
        + (f", oracle passes {settings.get('oracle_passes', 1)}" if any(s.startswith("oracle") for s in systems) else ""),
        f"- {machine['cpu_model']}, {machine['logical_cpus']} logical CPUs; torch {machine['versions'].get('torch')}, "
        f"transformers {machine['versions'].get('transformers')}; commit {str(machine['git']['commit'])[:10]}"
        f"{' (dirty)' if machine['git']['dirty'] else ''}; {when}",
        f"- command: `{results['command']}`" if results.get("command") else "",
        "",
        "Median (min-max) over repeats; model load and warm-up excluded from the makespan. Tail share: time after "
        "75% of the sequences finished, over the makespan. Accept len: tokens per row per target forward. "
        "Load avg: the 1-minute load average when each run started; others' CPU: the share of the machine's CPU time "
        "other processes used during the timed run (0% = quiet; 50% = one of the two cores was taken); memory GB/s: "
        "the machine's memory read bandwidth at the start and end of each timed run (a few-row decode step follows it; "
        "on shared machines it moves by tens of percent over tens of seconds).",
        *_paired_note(settings, systems),
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    lines += ["| " + " | ".join(system_row(name, entry, reference)) + " |" for name, entry in systems.items()]
    lines += _per_repeat(systems)
    lines += _time_split(results)
    lines += _batch_phases(results)
    lines += _drafter_use(results)
    lines += _notes(systems, greedy=trace["temperature"] == 0)
    lines += [f"- `{name}` not run: {why}" for name, why in (results.get("skipped") or {}).items()]
    return "\n".join(lines) + "\n"


def _paired_note(settings: dict[str, Any], systems: dict[str, Any]) -> list[str]:
    """What a paired run's figures mean (benchmark/paired.py), and what each system's own turns held."""
    if not settings.get("paired"):
        return []
    lines = ["", "**Paired run**: in each repeat the systems ran in one process and took turns round by round, so "
             "each met the same memory states; a makespan is the sum of the system's own turns, finish times are "
             "read on that clock, and the load, CPU and memory figures are the repeat's, shared by its systems."]
    rows = []
    for name, entry in systems.items():
        for repeat, held in enumerate(entry.get("paired") or []):
            if held:
                faults = held.get("page_faults") or {}
                order = held.get("systems") or []
                place = order.index(name) + 1 if name in order else "-"
                rows.append(f"| `{name}` | {repeat} | {place} | {held.get('turns', '-')} | {held.get('gc_s', 0.0):.3f} | "
                            f"{faults.get('major', '-')} / {faults.get('minor', '-')} | "
                            f"{held.get('external_cpu_s', 0.0):.1f} |")
    lines += _place_balance(systems)
    if rows:
        lines += ["", "Own turns per repeat: the system's place in the turn order (1: loaded first, first to run), "
                  "garbage-collection seconds, the process's page faults (major: read back from disk) and the CPU of "
                  "the system's drafter workers meanwhile.", "",
                  "| system | repeat | place | turns | gc s | page faults major / minor | workers' CPU s |",
                  "|---|---|---|---|---|---|---|", *rows]
    return lines


def first_places(systems: dict[str, Any]) -> dict[str, int]:
    """How many repeats of a paired run each system spent in the first place of the turn order."""
    counts = dict.fromkeys(systems, 0)
    # every system of a repeat records the same turn order; the longest record covers every repeat
    records = max((entry.get("paired") or [] for entry in systems.values()), key=len, default=[])
    for held in records:
        order = (held or {}).get("systems") or [None]
        if order[0] in counts:
            counts[order[0]] += 1
    return counts


def _place_balance(systems: dict[str, Any]) -> list[str]:
    """Each system's geometric mean of `ar`'s makespan over its own, per repeat, and whether every system took the
    first place equally often: on traces B and C the first-placed system ran up to ~5% slower (bench/session54), so
    a ratio over an unbalanced rotation carries that place's cost."""
    reference = systems.get("ar")
    if not reference or len(systems) < 2:
        return []
    counts = first_places(systems)
    ratios = []
    for name, entry in systems.items():
        pairs = [(r, t) for r, t in zip(reference.get("makespan_s") or [], entry.get("makespan_s") or []) if r and t]
        if name != "ar" and pairs:
            mean = math.exp(statistics.fmean(math.log(r / t) for r, t in pairs))
            ratios.append(f"`{name}` {mean:.3f}")
    if not ratios:
        return []
    balanced = len(set(counts.values())) == 1
    places = ", ".join(f"`{name}` {count}" for name, count in counts.items())
    return ["", f"`ar`'s makespan over each system's, geometric mean over the repeats: {', '.join(ratios)}. "
            + (f"First places: {places}: balanced." if balanced else
               f"First places: {places}: **not balanced**, so these ratios and the medians carry the first place's "
               "cost (up to ~5% on traces B and C, docs/benchmarking.md); run a multiple of "
               f"{len(systems)} repeats.")]


def _per_repeat(systems: dict[str, Any]) -> list[str]:
    """Each repeat's makespan with the memory bandwidth it met, and its ratio to `ar`'s in the same repeat: `ar`'s
    plain steps stream the weights and follow the machine's memory state, verify rounds past the ridge hardly
    do, so a median ratio depends on which states `ar`'s repeats met (bench/session39: 55.7 s at 48 GB/s, 80 s
    at 34-36)."""
    reference = systems.get("ar")
    if not reference or len(systems) < 2 or max(len(e["makespan_s"]) for e in systems.values()) < 2:
        return []
    rows = []
    for name, entry in systems.items():
        bandwidth = entry.get("mem_read_gbps") or []
        runs = [f"{t:.1f}" + (f" ({bandwidth[i]:.0f})" if i < len(bandwidth) and bandwidth[i] else "")
                for i, t in enumerate(entry["makespan_s"])]
        ratios = [f"{r / t:.2f}" for r, t in zip(reference["makespan_s"], entry["makespan_s"]) if t]
        rows.append(f"| `{name}` | {', '.join(runs)} | {', '.join(ratios) if name != 'ar' else '-'} |")
    return ["", "Per repeat: makespan s (memory GB/s, the mean of the run's start and end) and `ar`'s makespan in "
            "the same repeat over the system's.", "", "| system | makespan per repeat | vs ar per repeat |",
            "|---|---|---|", *rows]


def _time_split(results: dict[str, Any]) -> list[str]:
    """Where an engine system's time went (first repeat): its own counters, no profiler needed."""
    rows = []
    for name, entry in results["systems"].items():
        split = (entry.get("time_split") or [None])[0]
        if not split:
            continue
        total = split["total_s"] or 1.0
        share = lambda key: f"{split[key]:.1f} ({100 * split[key] / total:.0f}%)"  # noqa: E731
        worker = split.get("worker_busy_s")
        rows.append(f"| `{name}` | {total:.1f} | {share('prefill_s')} | {share('draft_s')} | {share('verify_s')} | "
                    f"{share('host_s')} | {split['rounds']} | {split['mean_k']:.2f} | "
                    + (f"{worker:.1f} ({100 * worker / total:.0f}%)" if worker is not None else "-") + " |")
    if not rows:
        return []
    return ["", "Where the time went (first repeat, seconds and share of the engine's wall time): prefill; drafting "
            "on the critical path (decoupled: taking streamed drafts); verify forwards; host work (acceptance, "
            "sampling, stop rules, bookkeeping); verify rounds; mean drafts per row per round; drafter worker busy "
            "time (decoupled, concurrent with the verifier: the verifier never waits for it).", "",
            "| system | engine s | prefill | drafting | verify forward | host | rounds | mean k | worker busy |",
            "|---|---|---|---|---|---|---|---|---|", *rows]


def _batch_phases(results: dict[str, Any]) -> list[str]:
    """Each engine system's seconds and rounds by the rows in its batch (run.batch_phases), medians over repeats,
    beside `ar`'s: where a system gains or loses as its batch drains."""
    columns: list[str] = []
    table: dict[str, dict[str, tuple[float, float]]] = {}
    for name, entry in results["systems"].items():
        runs = [phases for phases in entry.get("batch_phases") or [] if phases]
        if not runs:
            continue
        for phase in runs[0]:
            if phase["rows"] not in columns:
                columns.append(phase["rows"])
        table[name] = {}
        for label in columns:
            found = [p for phases in runs for p in phases if p["rows"] == label]
            if found:
                table[name][label] = (statistics.median(p["seconds"] for p in found),
                                      statistics.median(p["rounds"] for p in found))
    if not table:
        return []
    rows = [f"| `{name}` | " + " | ".join(f"{cells[c][0]:.1f} ({cells[c][1]:.0f})" if c in cells else "-"
                                           for c in columns) + " |" for name, cells in table.items()]
    return ["", "By batch size (medians over repeats): seconds (rounds) the engine spent with that many rows in its "
            "batch; the first column includes the first prefill.", "",
            "| system | " + " | ".join(f"{c} rows" for c in columns) + " |", "|---|" + "---|" * len(columns), *rows]


def _drafter_use(results: dict[str, Any]) -> list[str]:
    """Each draft method's part (first repeat): verified drafts, shadow drafts and drafting time."""
    rows = []
    for name, entry in results["systems"].items():
        use = (entry.get("drafter_use") or [None])[0]
        for method, figures in sorted((use or {}).items()):
            verified, shadows = figures["verified_tokens"], figures["shadow_drafts"]
            accepted = f"{figures['accepted_tokens']:.0f} ({figures['accepted_tokens'] / verified:.2f})" if verified \
                else "-"
            scored = f"{figures['shadow_accepted'] / shadows:.2f}" if shadows else "-"
            rows.append(f"| `{name}` | {method} | {verified:.0f} | {accepted} | {shadows:.0f} | {scored} | "
                        f"{figures['draft_s']:.2f} |")
    if not rows:
        return []
    return ["", "Drafter use (first repeat): tokens each method drafted that a verify round checked, and those "
            "accepted (rate); shadow drafts (drafted for rows that verified fewer, scored against what the rows "
            "committed: specactor_engine/policies/shadow.py) and their mean accepted tokens per draft; in-process drafting "
            "seconds (shadows included).", "",
            "| system | method | verified tokens | accepted (rate) | shadow drafts | accepted per shadow | drafting s |",
            "|---|---|---|---|---|---|---|", *rows]


def _notes(systems: dict[str, Any], greedy: bool) -> list[str]:
    notes = []
    if not greedy and "hf" in systems:
        notes.append("- `hf` samples with torch's generator, not the engine's position-keyed noise: its texts are "
                     "not expected to match `ar` at temperature > 0.")
    for name, entry in systems.items():
        if entry.get("error"):
            notes.append(f"- `{name}` failed: {entry['error']}")
        mismatches = entry.get("mismatches") or []
        if mismatches and (greedy or name != "hf"):
            listed = ", ".join(f"{m['id']}#{m['sample']}@{m['first_diff']}" for m in mismatches[:10])
            notes.append(f"- `{name}` differs from `ar` in {len(mismatches)} sequence(s) (id#sample@first differing "
                         f"position): {listed}{' ...' if len(mismatches) > 10 else ''}")
    return ["", *notes] if notes else []
