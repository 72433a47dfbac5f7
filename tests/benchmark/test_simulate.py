"""The what-if simulator (benchmark/simulate) on a tiny benchmark run: facts, replay, cost models, CLI.

One `python -m benchmark` run on tiny random fp32 models (ar, coupled with a draft model at fixed k,
oracle-dynamic, specactor; 2 prompts x 2 samples, 12 new tokens) is shared by the tests; its facts are
gathered once. No timing assertions: the replays are checked against the run's own outputs and
round-by-round statistics, and the clock against hand-computed charges.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

from benchmark.cli import app as bench_app
from benchmark.simulate.costs import GPUS, CostModel, DraftCost, Disturbance, roofline_profile
from benchmark.simulate.shapes import ModelShape
from benchmark.simulate.facts import Facts, SequenceFacts, _shape, gather, load_run_outputs, oracle_facts
from benchmark.simulate.replay import SimClock, replay
from specactor_engine import clock
from specactor_engine.policies.verify_length import CostProfile, CostTable
from tests.fixtures.tiny_models import save_tiny_model

SYSTEMS = ["ar", "coupled", "oracle-dynamic", "specactor"]


@pytest.fixture(scope="module")
def bench_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("simulate")
    target = save_tiny_model(root / "target", "llama", seed=0)
    drafter = save_tiny_model(root / "drafter", "llama", seed=0, num_layers=1)
    out = root / "out"
    args = ["--trace", "quick", "--model", f"{target}:{drafter}", "--systems", ",".join(SYSTEMS), "--repeats", "1",
            "--prompts", "2", "--samples", "2", "--max-new-tokens", "12", "--out", str(out)]
    result = CliRunner().invoke(bench_app, args)
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def facts(bench_dir) -> Facts:
    gathered = gather(bench_dir, ["trace", "model", "suffix", "ngram", "oracle"], progress=lambda _: None)
    gathered.save(bench_dir / "facts.json")
    return Facts.load(bench_dir / "facts.json")


def _run(bench_dir: Path, system: str) -> dict:
    return json.loads((bench_dir / "runs" / f"{system}-0.json").read_text())


def flat_costs(facts: Facts, verify_s: float = 0.01, draft_step_s: float = 0.002, prefill_token_s: float = 0.001
               ) -> CostModel:
    """Every forward costs the same: the clock's charges can be counted by hand."""
    widths = tuple(range(1, facts.max_k + 2))
    table = CostTable((1, 64), widths, ((verify_s,) * len(widths), (verify_s,) * len(widths)), 4096)
    drafting = {source: DraftCost((1,), (draft_step_s,)) for source in facts.drafters}
    return CostModel("flat", CostProfile((table,)), prefill_token_s, drafting)


def test_facts_hold_every_sequence_and_source(bench_dir, facts):
    ar = _run(bench_dir, "ar")
    assert [s.output_ids for s in facts.sequences] == [s["token_ids"] for s in ar["sequences"]]
    assert {"trace", "model", "suffix", "ngram", "oracle"} <= set(facts.drafters)
    for source, d in facts.drafters.items():
        assert [len(a) for a in d.accepted] == [len(s.output_ids) for s in facts.sequences], source
        for accepted, supplied in zip(d.accepted, d.supplied):
            assert all(0 <= a <= s <= facts.max_k for a, s in zip(accepted, supplied)), source
    model = facts.drafters["trace"]
    assert model.shape is not None and model.calls and facts.drafters["suffix"].shape is None
    assert facts.cpu_profile is not None and facts.target_prefill_s_per_token > 0


def test_facts_read_a_paired_runs_spec(bench_dir, tmp_path):
    """`python -m benchmark --paired` writes one spec file per repeat, [[system, spec], ...], not one per system:
    the simulator reads the `ar` run's spec from it (session 51: `--from` a paired D run stopped at "no `ar` run")."""
    spec, outputs = load_run_outputs(bench_dir)
    paired = tmp_path / "paired"
    shutil.copytree(bench_dir / "runs", paired / "runs")
    for path in (paired / "runs").glob("*.spec.json"):
        path.unlink()
    (paired / "runs" / "paired-0.spec.json").write_text(json.dumps([["coupled", spec.to_dict()],
                                                                    ["ar", spec.to_dict()]]))
    assert load_run_outputs(paired) == (spec, outputs)
    (paired / "runs" / "paired-0.spec.json").write_text(json.dumps([["coupled", spec.to_dict()]]))
    with pytest.raises(FileNotFoundError, match="no `ar` run"):
        load_run_outputs(paired)


def test_a_packed_input_projection_counts_in_a_feature_drafters_shape():
    """The CPU kernels pack the feature-level drafter's input projection (`PackedLinear`, not an nn.Module): its
    weights still count in the drafter's roofline shape (session 51: gathering a trace D run's facts with the
    feature drafter failed on `PackedLinear.parameters`)."""
    from transformers import LlamaConfig

    from specactor_engine.model.packed_linear import PackedLinear

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    fc = torch.nn.Linear(32, 16, bias=False)

    def drafter(projection):
        return SimpleNamespace(model_free=False, runner=SimpleNamespace(model=SimpleNamespace(config=config)),
                               vocab=None, fc=projection)

    base = ModelShape.from_config(config.to_dict())
    plain, packed = _shape(drafter(fc)), _shape(drafter(PackedLinear([fc])))
    assert plain == packed
    assert plain["params"] == base.params + 32 * 16


def test_oracle_facts_accept_everything_left():
    oracle = oracle_facts([SequenceFacts("a", 0, 1, [1], [4, 5, 6, 7, 8, 9])], max_k=3)
    assert oracle.accepted == [[0, 3, 3, 2, 1, 0]]


@pytest.mark.parametrize("system", SYSTEMS)
def test_a_replay_emits_the_runs_outputs(facts, system):
    assert replay(system, facts, flat_costs(facts)).identical


def test_a_fixed_k_replay_repeats_the_engine_round_for_round(bench_dir, facts):
    """Coupled at fixed k decides nothing from timings: its replay must verify the same rounds and accept
    the same drafts at every position as the real run (the facts are exact on fp32)."""
    real = _run(bench_dir, "coupled")["engine_stats"]
    replayed = replay("coupled", facts, flat_costs(facts)).stats
    for key in ("verify_rounds", "row_rounds", "drafted_tokens", "accepted_tokens", "drafted_per_position",
                "accepted_per_position"):
        assert replayed[key] == real[key], key


def test_ar_replay_charges_exactly_the_modelled_seconds(bench_dir, facts):
    """With a free host, an `ar` replay's makespan is its rounds x the verify cost plus the prefills."""
    costs = flat_costs(facts, verify_s=0.01, prefill_token_s=0.001)
    result = replay("ar", facts, costs, max_batch_size=4, host_scale=0.0)
    prompts = {tuple(s.prompt_ids) for s in facts.sequences}
    expected = result.rounds * 0.01 + 0.001 * sum(len(p) for p in prompts)
    assert result.makespan_s == pytest.approx(expected, rel=1e-9)
    assert result.rounds == _run(bench_dir, "ar")["engine_stats"]["verify_rounds"]


def test_drafting_is_charged_per_call_and_step(facts):
    cheap = replay("coupled", facts, flat_costs(facts, draft_step_s=0.0), host_scale=0.0)
    dear = replay("coupled", facts, flat_costs(facts, draft_step_s=0.5), host_scale=0.0)
    drafted_steps = sum(round(d["k"]) for d in dear.stats["timeline"])  # one call per round, k steps
    assert dear.rounds == cheap.rounds
    assert dear.makespan_s - cheap.makespan_s == pytest.approx(0.5 * drafted_steps, rel=1e-6)


def test_a_dear_verify_makes_the_dynamic_policy_speculate_and_a_dear_draft_stops_it(facts):
    """The replayed engine's own verify-length policy reads the cost model: drafts that cost more than
    the forwards they save are dropped (k = 0 rounds), cheap ones are used."""
    cheap = replay("oracle-dynamic", facts, flat_costs(facts, verify_s=0.05, draft_step_s=0.0), host_scale=0.0)
    assert cheap.mean_accept_len > 1.5
    dear = replay("coupled-dynamic", facts, flat_costs(facts, verify_s=0.001, draft_step_s=1.0), host_scale=0.0)
    plain = sum(1 for d in dear.stats["timeline"] if d["k"] == 0)
    assert plain > dear.rounds // 2


def test_the_sampling_calibration_picks_the_reading_closer_to_the_measured_forwards(facts):
    """P = the profile's charges over an `ar` replay, S = its sampling time: measured forwards at P mean the
    profile is the forward alone (the replay samples on the clock), at P - S that it holds the sampling."""
    from benchmark.simulate.replay import calibrate_sampling

    costs = flat_costs(facts, verify_s=0.05)
    probe = replay("ar", facts, costs, host_scale=0.0)
    charged, sampled = probe.stats["verify_s"], probe.sampling_s
    assert sampled > 0 and charged == pytest.approx(probe.rounds * 0.05)
    assert calibrate_sampling(facts, costs, charged)[0] is False
    assert calibrate_sampling(facts, costs, charged - 3 * sampled)[0] is True


def test_sim_clock_counts_host_time_only_outside_paused_blocks():
    sim = SimClock(host_scale=0.0)
    sim.advance(2.5)
    with sim.paused():
        sim.advance(1.0)
    assert sim.now() == pytest.approx(3.5)
    with clock.replaced(lambda: 42.0):
        assert clock.now() == 42.0
    assert clock.now() != 42.0


def test_roofline_is_memory_bound_at_few_rows_and_compute_bound_at_many():
    shape = ModelShape.from_config({"hidden_size": 1536, "num_hidden_layers": 28, "num_attention_heads": 12,
                                    "num_key_value_heads": 2, "intermediate_size": 8960, "vocab_size": 151936})
    assert 1.4e9 < shape.params < 1.8e9  # Qwen2.5-1.5B's matmul weights, head included
    profile = roofline_profile(shape, GPUS["h100"], max_k=4)
    one, four = profile.cost(1, 1, 128), profile.cost(4, 5, 128)
    assert four == pytest.approx(one, rel=0.05)  # 20 tokens stream the same weights
    overhead = GPUS["h100"].overhead_s
    # 1280 tokens are past the ridge (~300): the forward grows with them; 80 are not
    assert profile.cost(256, 5, 128) - overhead > 4 * (profile.cost(16, 5, 128) - overhead)


def test_a_disturbance_charges_the_clock_its_factors_and_a_seeded_stream_per_replay(facts):
    """`--width-factors/--jitter/--spells`: the clock is charged the profile's seconds times the disturbance; the
    same replay number draws the same stream, another number another one."""
    base = replay("ar", facts, flat_costs(facts, verify_s=0.01), max_batch_size=4, host_scale=0.0)
    prefill = base.makespan_s - base.rounds * 0.01
    slow = flat_costs(facts, verify_s=0.01)
    slow.disturbance = Disturbance(width_factors=(2.0, 1.0))  # `ar` verifies width 1 only
    assert replay("ar", facts, slow, max_batch_size=4, host_scale=0.0).makespan_s == \
        pytest.approx(prefill + base.rounds * 0.02, rel=1e-9)
    spelled = flat_costs(facts, verify_s=0.01)
    spelled.disturbance = Disturbance(spell_every=4, spell_rounds=1, spell_scale=3.0)  # verifies 4, 8, ... at 3x
    assert replay("ar", facts, spelled, max_batch_size=4, host_scale=0.0).makespan_s == \
        pytest.approx(prefill + 0.01 * (base.rounds + 2 * (base.rounds // 4)), rel=1e-9)
    noisy = flat_costs(facts, verify_s=0.01)
    noisy.disturbance = Disturbance(jitter=0.2, seed=7)
    first, again, other = (replay("ar", facts, noisy, max_batch_size=4, host_scale=0.0, number=n).makespan_s
                           for n in (0, 0, 1))
    assert first == again and first != other and first != base.makespan_s
    with pytest.raises(ValueError):
        Disturbance(width_factors=(1.0, 0.0))


def test_cli_rejects_a_malformed_spell():
    result = CliRunner().invoke(_app(), ["simulate", "--from", ".", "--validate", "--spells", "150,10"])
    assert result.exit_code == 2 and "--spells" in result.output and "EVERY,ROUNDS,SCALE" in result.output


def test_draft_cost_interpolates_between_measured_rows():
    cost = DraftCost((1, 4), (0.01, 0.04))
    assert cost.seconds(2, 3) == pytest.approx(3 * 0.02)
    assert cost.seconds(8, 1) == pytest.approx(0.04)
    assert cost.seconds(1, 0) == 0.0


def test_cli_validate_prints_a_line_per_system_and_the_max_error(bench_dir, facts):
    result = CliRunner().invoke(_app(), ["simulate", "--from", str(bench_dir), "--validate", "--replays", "2"])
    assert result.exit_code == 0, result.output
    lines = [line for line in result.output.splitlines() if " predicted " in line]
    assert {line.split()[0] for line in lines} == set(SYSTEMS)
    assert result.output.strip().splitlines()[-1].startswith("max error: ")
    saved = json.loads((bench_dir / "simulate-validate.json").read_text())
    assert {r["system"] for r in saved["validation"]} == set(SYSTEMS)
    for row in saved["validation"]:
        assert len(row["replays_s"]) == 2 and min(row["replays_s"]) <= row["predicted_s"] <= max(row["replays_s"])
        assert sorted(row["replays_by_number_s"]) == row["replays_s"]  # the same replays, in replay order


def test_cli_projects_on_a_roofline_gpu(bench_dir, facts, tmp_path):
    result = CliRunner().invoke(_app(), ["simulate", "--from", str(bench_dir), "--cost", "roofline:h100",
                                         "--overhead-ms", "0.5", "--batch", "1,4", "--systems", "ar,oracle-dynamic",
                                         "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    text = (tmp_path / "projection-roofline-h100-overhead0.5ms-host1.md").read_text()
    assert "Projection (not a measurement)" in text and "| 4 |" in text and "0.5 ms per forward" in text
    rows = json.loads((tmp_path / "projection-roofline-h100-overhead0.5ms-host1.json").read_text())["projection"]
    assert {(r["batch"], r["system"]) for r in rows} == {(b, s) for b in (1, 4) for s in ("ar", "oracle-dynamic")}
    assert all(r["speedup"] > 0 for r in rows)


def test_cli_names_the_folder_it_cannot_read(tmp_path):
    result = CliRunner().invoke(_app(), ["simulate", "--from", str(tmp_path), "--validate"])
    assert result.exit_code != 0
    assert "no runs/ folder" in result.output


def _app():
    """The `specactor` app with its benchmark commands registered (as `main` does), once."""
    from specactor.cli import _add_bench_command, app as specactor_app

    if not any(c.name == "simulate" for c in specactor_app.registered_commands):
        _add_bench_command()
    return specactor_app


def test_torch_threads_untouched_by_a_replay(facts):
    before = torch.get_num_threads()
    replay("ar", facts, flat_costs(facts))
    assert torch.get_num_threads() == before
