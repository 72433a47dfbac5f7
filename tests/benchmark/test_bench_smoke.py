"""The benchmark harness end to end on tiny random models (no timing assertions).

One `bench` run (systems hf, ar, coupled with a draft model, oracle, decoupled, specactor, coupled-suffix;
1 repeat; 2 prompts x 2 samples, 6 new tokens, fp32) in worker subprocesses, shared by the tests below.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from benchmark.cli import app
from benchmark.metrics import compare_to_reference, first_difference, tail_time
from benchmark.systems import FinishClock, OracleDrafter, RunSpec, build_system
from benchmark.traces import TRACES, build_requests, sampling_config, trace_items
from specactor_engine.drafters import DraftRequest
from specactor_engine.sampling import SamplingParams, sequence_key
from specactor_engine.state import SequenceState
from tests.fixtures.tiny_models import save_tiny_model

SYSTEM_KEYS = {"makespan_s", "tokens_per_s", "output_tokens", "tail_share", "mean_accept_len", "acceptance_rate",
               "identical_to_ar", "peak_rss_mb", "load_s", "repeats", "mem_read_gbps"}
NUM_SEQUENCES = 4


@pytest.fixture(scope="module")
def bench_results(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("bench")
    target = save_tiny_model(root / "target", "llama", seed=0)
    drafter = save_tiny_model(root / "drafter", "llama", seed=0, num_layers=1)
    out = root / "out"
    args = ["--trace", "quick", "--model", f"{target}:{drafter}", "--systems",
            "hf,ar,coupled,oracle,decoupled,specactor,coupled-suffix,vllm",
            "--repeats", "1", "--prompts", "2", "--samples", "2", "--max-new-tokens", "6", "--out", str(out)]
    with pytest.MonkeyPatch.context() as patch:
        # vLLM lives in its own venv (make vllm-env); here it must be reported absent, not fail the run
        patch.setenv("SPECACTOR_VLLM_PYTHON", str(root / "no-vllm" / "python"))
        result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    return out, json.loads((out / "results.json").read_text())


def test_results_have_every_figure(bench_results):
    out, results = bench_results
    assert {"machine", "trace", "settings", "systems", "command"} <= results.keys()
    assert {"cpu_model", "logical_cpus", "threads", "versions", "git"} <= results["machine"].keys()
    assert set(results["systems"]) == {"hf", "ar", "coupled", "oracle", "decoupled", "specactor", "coupled-suffix"}
    for name, entry in results["systems"].items():
        assert SYSTEM_KEYS <= entry.keys(), name
        assert entry["repeats"] == 1 and "error" not in entry, name
        assert len(entry["makespan_s"]) == len(entry["tokens_per_s"]) == 1
        assert 0 < entry["output_tokens"][0] <= NUM_SEQUENCES * 6
        assert 0.0 <= entry["tail_share"][0] <= 1.0
        assert 0.1 < entry["mem_read_gbps"][0] < 10_000, name  # the machine's read bandwidth around the run, GB/s
    table, _, split = (out / "results.md").read_text().partition("Where the time went")
    split, _, use = split.partition("Drafter use")
    split, _, phases = split.partition("By batch size")
    assert table.count("| `") == 7
    assert split.count("| `") == 6  # the engine systems: ar, coupled, oracle, decoupled, specactor, coupled-suffix
    assert phases.count("| `") == 6  # the same systems, by the rows in their batch
    for name in ("ar", "specactor"):  # the phases split the run: every round and every round's tokens once
        entry = results["systems"][name]
        (run_phases,) = entry["batch_phases"]
        assert sum(p["rounds"] for p in run_phases) == entry["time_split"][0]["rounds"], name
        # each sequence's first token comes from its prefill, not from a round
        assert sum(p["tokens"] for p in run_phases) == entry["output_tokens"][0] - NUM_SEQUENCES, name
    # drafter use: one row per (system, method) that drafted, e.g. coupled's draft model, specactor's methods
    assert "| `coupled` |" in use and "| `specactor` | suffix |" in use and "| `ar` |" not in use
    assert (out / "trace.json").is_file()
    # each run records the garbage collections of its timed rollout, by generation
    run = json.loads((out / "runs" / "specactor-0.json").read_text())
    assert 0.0 <= run["gc_s"] < run["makespan_s"] and {int(g) for g in run["gc_collections"]} <= {0, 1, 2}
    # and its page faults (a rollout touches fresh memory: at least its KV cache's pages)
    assert run["minor_faults"] > 0 and run["major_faults"] >= 0
    # both reach results.json (the per-run files are not committed with a benchmark's results)
    entry = results["systems"]["specactor"]
    assert entry["minor_faults"] == [run["minor_faults"]] and entry["gc_s"] == [run["gc_s"]]


def test_report_only_rebuilds_the_results_from_the_runs(bench_results, tmp_path):
    import shutil

    out, results = bench_results
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    (copy / "results.md").unlink()
    (copy / "makespan.png").unlink()
    rebuilt = CliRunner().invoke(app, ["--report-only", "--out", str(copy)])
    assert rebuilt.exit_code == 0, rebuilt.output
    assert (copy / "results.md").read_text() == (out / "results.md").read_text()
    assert (copy / "makespan.png").is_file()
    assert json.loads((copy / "results.json").read_text())["systems"] == results["systems"]
    (copy / "runs" / "ar-0.json").unlink()
    missing = CliRunner().invoke(app, ["--report-only", "--out", str(copy)])
    assert missing.exit_code == 2 and "ar-0.json" in missing.output
    nothing = CliRunner().invoke(app, ["--report-only", "--out", str(tmp_path / "none")])
    assert nothing.exit_code == 2 and "results.json" in nothing.output


def test_absent_vllm_is_reported_and_the_rest_runs(bench_results):
    out, results = bench_results
    assert "no vLLM environment" in results["skipped"]["vllm"]
    assert "`vllm` not run: no vLLM environment" in (out / "results.md").read_text()


def test_plots_are_written(bench_results):
    out, _ = bench_results
    for name in ("makespan.png", "throughput.png", "acceptance.png", "drafter_mix.png"):
        data = (out / name).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 5000, name


def test_engine_runs_record_a_round_timeline(bench_results):
    out, _ = bench_results
    run = json.loads((out / "runs" / "coupled-0.json").read_text())
    timeline = run["engine_stats"]["timeline"]
    assert timeline and all(e["rows"] >= 1 and 0 <= e["accepted"] <= e["drafted"] for e in timeline)
    assert [e["t"] for e in timeline] == sorted(e["t"] for e in timeline)
    # every emitted token after the first (sampled at prefill) was emitted by a verify round
    assert sum(e["emitted"] for e in timeline) == run["output_tokens"] - NUM_SEQUENCES
    assert sum(sum(e["by_drafter"].values()) for e in timeline) > 0


def test_ar_is_its_own_reference_and_oracle_accepts_everything(bench_results):
    _, results = bench_results
    systems = results["systems"]
    assert systems["ar"]["identical_to_ar"] == [1.0]
    assert systems["ar"]["mean_accept_len"] == [1.0]
    assert systems["oracle"]["acceptance_rate"] == [1.0]
    assert systems["oracle"]["identical_to_ar"] == [1.0]
    # fp32 tiny models: speculation is lossless, whatever the drafter and the mode
    for name in ("coupled", "decoupled", "specactor", "coupled-suffix"):
        assert systems[name]["identical_to_ar"] == [1.0], name


def test_hf_greedy_matches_ar_on_a_tiny_model(tmp_path):
    """Greedy fp32, in process: transformers generate and the engine emit the same tokens and finish reasons."""
    target = save_tiny_model(tmp_path / "target", "qwen2", seed=3)
    trace = TRACES["quick"].with_overrides(num_prompts=3, samples_per_prompt=1, max_new_tokens=12, temperature=0.0)
    requests, sampling = build_requests(trace), sampling_config(trace)
    outputs = {}
    for system in ("hf", "ar"):
        spec = RunSpec(system=system, trace=trace, target=str(target), drafter=None, dtype="float32")
        clock = FinishClock()
        clock.start()
        generation = build_system(spec).generate(requests, sampling, clock)
        assert len(clock.times) == len(requests)
        outputs[system] = [(s.request_id, s.token_ids, s.finish_reason) for s in generation.sequences]
    assert outputs["hf"] == outputs["ar"]


def test_oracle_drafter_proposes_the_reference_at_the_current_position():
    key = sequence_key(0, "r", 1)
    drafter = OracleDrafter({key: [10, 11, 12, 13, 14]})
    state = SequenceState.allocate(2, 16)
    state.lengths[:] = torch.tensor([5, 4])
    state.prompt_lengths[:] = torch.tensor([3, 4])  # slot 0 emitted 2 tokens, slot 1 none
    state.seq_keys[:] = torch.tensor([key, sequence_key(0, "other", 0)])
    request = DraftRequest(torch.tensor([0, 1]), torch.tensor([4, 4]), SamplingParams(1.0, 0, 1.0))
    proposal = drafter.propose(state, request)
    assert proposal.num_tokens.tolist() == [3, 0]
    assert proposal.token_ids[0, :3].tolist() == [12, 13, 14]


def test_oracle_dynamic_runs_after_ar_and_accepts_every_draft(tmp_path):
    """In process, fp32: the dynamic-length oracle (fed `ar`'s outputs) emits them and accepts every draft."""
    from benchmark.run import BenchPlan
    from benchmark.systems import write_references
    from specactor_engine.policies.cost_profile import CostProfile

    target = save_tiny_model(tmp_path / "target", "llama", seed=2)
    trace = TRACES["quick"].with_overrides(num_prompts=2, samples_per_prompt=2, max_new_tokens=10)
    plan = BenchPlan(trace, ("oracle-dynamic",), 1, tmp_path, str(target), None, "float32")
    assert plan.run_order() == ("ar", "oracle-dynamic")
    requests, sampling = build_requests(trace), sampling_config(trace)
    ar = build_system(RunSpec(system="ar", trace=trace, target=str(target), drafter=None, dtype="float32"))
    reference = [{"id": s.request_id, "sample": s.sample_index, "token_ids": s.token_ids}
                 for s in ar.generate(requests, sampling, FinishClock()).sequences]
    write_references(tmp_path / "ref.json", trace.seed, reference)
    spec = RunSpec(system="oracle-dynamic", trace=trace, target=str(target), drafter=None, dtype="float32",
                   reference_path=str(tmp_path / "ref.json"))
    oracle = build_system(spec)
    # a profile in which wide rounds are nearly free, so the policy verifies drafts
    oracle.engine.cost_table = CostProfile.from_dict({"batch_sizes": [1, 4], "widths": [1, 2, 3, 4, 5],
                                                      "seconds": [[1.0] * 5, [1.0] * 5], "context": 0})
    oracle.prepare(requests, sampling)
    generation = oracle.generate(requests, sampling, FinishClock())
    assert [s.token_ids for s in generation.sequences] == [r["token_ids"] for r in reference]
    stats = generation.engine_stats
    assert stats["drafted_tokens"] > 0 and stats["accepted_tokens"] == stats["drafted_tokens"]


def test_the_timed_run_starts_from_the_prior_acceptance_not_the_warm_up_s(tmp_path):
    """The benchmark's warm-up (8 tokens of one row) feeds the verify-length policy, which persists across calls;
    `prepare` makes it forget that acceptance (trace D: the feature drafter's statistics after the warm-up were 1.0 at
    every position; a trace A repeat began with 12 rounds of 3-4 drafts a row at 32 rows), keeping the costs."""
    from benchmark.systems import write_references
    from specactor_engine.policies.cost_profile import CostProfile

    target = save_tiny_model(tmp_path / "target", "llama", seed=2)
    trace = TRACES["quick"].with_overrides(num_prompts=2, samples_per_prompt=2, max_new_tokens=10)
    requests, sampling = build_requests(trace), sampling_config(trace)
    ar = build_system(RunSpec(system="ar", trace=trace, target=str(target), drafter=None, dtype="float32"))
    reference = [{"id": s.request_id, "sample": s.sample_index, "token_ids": s.token_ids}
                 for s in ar.generate(requests, sampling, FinishClock()).sequences]
    write_references(tmp_path / "ref.json", trace.seed, reference)
    oracle = build_system(RunSpec(system="oracle-dynamic", trace=trace, target=str(target), drafter=None,
                                  dtype="float32", reference_path=str(tmp_path / "ref.json")))
    oracle.engine.cost_table = CostProfile.from_dict({"batch_sizes": [1, 4], "widths": [1, 2, 3, 4, 5],
                                                      "seconds": [[1.0] * 5, [1.0] * 5], "context": 0})
    oracle.generate(requests[:1], sampling.model_copy(update={"n": 1, "max_new_tokens": 8}), FinishClock())
    policy = oracle.engine.length_policy
    assert policy is not None and policy.stats.observed[0] > 0 and policy.stats.rates()[0] == 1.0
    scale = dict(policy.scale)
    oracle.prepare(requests, sampling)
    assert oracle.engine.length_policy is policy and policy.stats.observed == [0] * policy.max_k
    assert policy.stats.rates()[0] == 0.5 and policy.scale == scale


def test_repeats_rotate_the_run_order(tmp_path):
    """Each repeat runs the systems rotated by one more place (the second run of a pair was ~0.6% slower on trace B),
    so every system runs first as often; `ar` stays first where an oracle needs its outputs."""
    from benchmark.run import BenchPlan

    trace = TRACES["quick"]
    plan = BenchPlan(trace, ("ar", "specactor", "coupled"), 3, tmp_path, "t", "d", "float32")
    orders = [plan.repeat_order(r) for r in range(4)]
    assert orders == [("ar", "specactor", "coupled"), ("specactor", "coupled", "ar"),
                      ("coupled", "ar", "specactor"), ("ar", "specactor", "coupled")]
    oracle = BenchPlan(trace, ("oracle", "specactor", "coupled"), 2, tmp_path, "t", "d", "float32")
    assert oracle.repeat_order(0) == ("ar", "oracle", "specactor", "coupled")
    assert oracle.repeat_order(1) == ("ar", "specactor", "coupled", "oracle")


def test_a_system_at_another_draft_length(tmp_path):
    """NAME@K: the base system's spec at draft length K; a bad K or an unknown base fails before any run."""
    from benchmark.run import BenchPlan

    trace = TRACES["quick"]
    plan = BenchPlan(trace, ("ar", "coupled@2", "coupled"), 1, tmp_path, "t", "d", "float32", num_draft_tokens=4)
    assert plan.run_order() == ("ar", "coupled@2", "coupled")
    spec = plan.spec("coupled@2", None)
    assert (spec.system, spec.num_draft_tokens) == ("coupled", 2)
    assert plan.spec("coupled", None).num_draft_tokens == 4
    for bad in ("coupled@0", "coupled@x", "nothing@2"):
        with pytest.raises(ValueError, match=bad):
            BenchPlan(trace, (bad,), 1, tmp_path, "t", "d", "float32").run_order()


def test_tail_time_and_identity():
    assert tail_time([1.0, 2.0, 3.0, 10.0], 10.0, 4) == pytest.approx(7.0)
    assert tail_time([1.0], 5.0, 4) == 0.0  # unfinished sequences count as finishing at the makespan
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2], [1, 2, 3]) == 2
    assert first_difference([1, 5, 3], [1, 2, 3]) == 1
    ref = [{"id": "a", "sample": 0, "token_ids": [1, 2]}, {"id": "a", "sample": 1, "token_ids": [3]}]
    mine = [{"id": "a", "sample": 0, "token_ids": [1, 2]}, {"id": "a", "sample": 1, "token_ids": [4]}]
    fraction, mismatches = compare_to_reference(mine, ref)
    assert fraction == 0.5 and mismatches[0]["first_diff"] == 0


def test_traces_match_the_protocol():
    assert TRACES["A"].num_sequences == 32 and TRACES["A"].max_new_tokens == 256
    assert TRACES["B"].num_sequences == 128 and TRACES["G"].temperature == 0.0
    assert TRACES["quick"].num_sequences == 16
    subset = TRACES["A"].with_overrides(num_prompts=4)
    assert [item["task"] for item in trace_items(subset)] == ["chain_sum", "basic_arithmetic"] * 2
    requests = build_requests(subset)
    assert len({r.request_id for r in requests}) == 4
    assert "\\boxed{}" in requests[0].messages[0]["content"]


def test_summary_table_covers_every_system(bench_results):
    from benchmark.summary import render

    out, _ = bench_results
    table = render([out])
    for name in ("hf", "ar", "coupled", "oracle", "decoupled", "specactor"):
        assert f"| `{name}` |" in table
    assert "| `vllm` | 0 |" in table and "not run" in table


@pytest.mark.parametrize("width", [1, 3])
def test_profile_step_prints_the_operator_split(tmp_path, width):
    from benchmark.profile_step import app as profile_app

    target = save_tiny_model(tmp_path / "target", "llama", seed=0)
    result = CliRunner().invoke(profile_app, ["--model", str(target), "--dtype", "float32", "--batch", "3",
                                              "--context", "8", "--steps", "2", "--threads", "1",
                                              "--width", str(width)])
    assert result.exit_code == 0, result.output
    assert f"batch 3, width {width}, context 8" in result.output
    assert "| matmul (linear layers, lm_head) |" in result.output
    shares = [float(line.split("|")[2].strip().rstrip("%")) for line in result.output.splitlines()
              if line.startswith("| ") and line.rstrip().endswith("% |") and line.count("|") == 3]
    assert 98 <= sum(shares) <= 102  # the groups cover all operator time
    wall = re.search(r"unprofiled\) median ([0-9.]+) ms of 2", result.output)
    assert wall is not None and float(wall.group(1)) > 0, result.output


def test_a_trace_with_history_feeds_the_earlier_rollout_to_the_suffix_drafter(tmp_path):
    """Greedy, so the earlier rollout (another seed) has exactly the outputs the timed run will produce:
    with that history the suffix drafter's drafts are accepted far more often than without it."""
    target = save_tiny_model(tmp_path / "target", "llama", seed=0)

    def bench(out: Path, *extra: str) -> dict:
        args = ["--trace", "quick", "--model", str(target), "--systems", "ar,coupled-suffix", "--repeats", "1",
                "--prompts", "2", "--samples", "2", "--max-new-tokens", "16", "--temperature", "0",
                "--out", str(out), *extra]
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output
        return json.loads((out / "results.json").read_text())

    with_history = bench(tmp_path / "history", "--history-seed", "5")
    history = json.loads((tmp_path / "history" / "runs" / "history.json").read_text())
    assert sorted(history) == sorted({item["id"] for item in json.loads(
        (tmp_path / "history" / "trace.json").read_text())["items"]})
    without = bench(tmp_path / "plain")
    assert not (tmp_path / "plain" / "runs" / "history.json").exists()
    for results in (with_history, without):
        assert results["systems"]["coupled-suffix"]["identical_to_ar"] == [1.0]
    rate = {name: r["systems"]["coupled-suffix"]["acceptance_rate"][0] or 0.0  # None: nothing was drafted
            for name, r in (("history", with_history), ("plain", without))}
    assert rate["history"] > 0.9 and rate["history"] > rate["plain"] + 0.2, rate


def test_history_seed_must_differ_from_the_trace_seed(tmp_path):
    result = CliRunner().invoke(app, ["--trace", "quick", "--history-seed", "0", "--out", str(tmp_path)])
    assert result.exit_code == 2 and "equals the trace's seed" in result.output


def test_trace_d_is_the_per_worker_regime_and_keeps_its_row_limit_unless_overridden():
    """D: A's first 4 prompts x 4 samples, at most 4 rows at a time; --max-batch still overrides it."""
    d = TRACES["D"]
    assert (d.total_prompts, d.samples_per_prompt, d.max_new_tokens, d.max_batch_size) == (4, 4, 256, 4)
    assert d.model == TRACES["A"].model and d.dtype == TRACES["A"].dtype and d.temperature == 1.0
    assert [item["id"] for item in trace_items(d)] == [item["id"] for item in trace_items(TRACES["A"])][:4]
    assert d.with_overrides(max_batch_size=None).max_batch_size == 4  # None keeps the trace's limit
    assert d.with_overrides(max_batch_size=1).max_batch_size == 1
    assert TRACES["quick"].model.drafter == TRACES["quick"].model.target  # quick runs the worker systems too


def test_replicas_give_the_same_sequences_and_a_per_replica_split(bench_results, tmp_path):
    """--replicas 2: `ar` and `specactor` as two 1-thread rollout replicas (Ray actors) emit exactly the sequences of
    the one-engine run, and each run records every replica's share of the work."""
    out, _ = bench_results
    root = out.parent
    replicated = tmp_path / "replicated"
    args = ["--trace", "quick", "--model", f"{root / 'target'}:{root / 'drafter'}", "--systems", "ar,specactor",
            "--repeats", "1", "--prompts", "2", "--samples", "2", "--max-new-tokens", "6", "--replicas", "2",
            "--out", str(replicated)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert json.loads((replicated / "results.json").read_text())["settings"]["replicas"] == 2
    for system in ("ar", "specactor"):
        one = json.loads((out / "runs" / f"{system}-0.json").read_text())
        two = json.loads((replicated / "runs" / f"{system}-0.json").read_text())
        assert [s["token_ids"] for s in two["sequences"]] == [s["token_ids"] for s in one["sequences"]], system
        split = two["engine_stats"]["replicas"]
        assert [r["replica"] for r in split] == [0, 1]
        assert sum(r["sequences"] for r in split) == NUM_SEQUENCES and all(r["chunks"] >= 1 for r in split), split


def test_per_repeat_ratios_pair_each_repeat_with_ars_own():
    """A median ratio can pair `ar`'s slow-memory repeats with another system's fast ones; the per-repeat table
    divides within a repeat."""
    from benchmark.report import _per_repeat

    systems = {"ar": {"makespan_s": [80.0, 56.0], "mem_read_gbps": [35.0, 48.0]},
               "specactor": {"makespan_s": [40.0, 42.0], "mem_read_gbps": [47.0, None]}}
    lines = _per_repeat(systems)
    assert "| `ar` | 80.0 (35), 56.0 (48) | - |" in lines
    assert "| `specactor` | 40.0 (47), 42.0 | 2.00, 1.33 |" in lines
    assert _per_repeat({"ar": {"makespan_s": [80.0]}, "specactor": {"makespan_s": [40.0]}}) == []  # one repeat
    assert _per_repeat({"specactor": {"makespan_s": [40.0, 41.0]}}) == []  # no `ar` to divide by


def test_results_call_a_tree_dirty_for_changed_tracked_files_not_untracked_ones(tmp_path):
    """A results file records the commit and whether tracked files had uncommitted changes; a benchmark's own output
    directory (untracked until committed) does not count, so results no longer all say "(dirty)"."""
    import subprocess

    from benchmark.machine import git_info

    def git(*args: str) -> None:
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "code.py").write_text("x = 1\n")
    git("add", "code.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "results.json").write_text("{}")
    info = git_info(tmp_path)
    assert info["dirty"] is False and len(info["commit"]) == 40
    (tmp_path / "code.py").write_text("x = 2\n")
    assert git_info(tmp_path)["dirty"] is True
