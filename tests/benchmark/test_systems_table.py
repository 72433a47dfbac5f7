"""The table of benchmarked systems: every name resolves, and each engine row configures the engine as
the classes it replaced did (no model is loaded: the configs are built and compared)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmark.engine_systems import ALL_AT_ONCE, ENGINE_VARIANTS, EngineSystem, engine_config
from benchmark.interface import RunSpec
from benchmark.systems import SYSTEMS, system_unavailable
from benchmark.traces import TRACES
from specactor_engine.config import RolloutConfig

# name -> (mode, in-process drafter kinds with / without a draft model, verify length, workers with a
# draft model, cpu kernels); the oracles' drafter is handed in, so their config keeps the defaults
EXPECTED = {
    "ar": ("ar", [], [], "fixed", False, True),
    "ar-torch": ("ar", [], [], "fixed", False, False),
    "coupled": ("coupled", ["model"], ["ngram"], "fixed", False, True),
    "coupled-dynamic": ("coupled", ["model"], ["ngram"], "dynamic", False, True),
    "coupled-suffix": ("coupled", ["suffix"], ["suffix"], "dynamic", False, True),
    "coupled-ngram": ("coupled", ["ngram"], ["ngram"], "dynamic", False, True),
    "coupled-cheap": ("coupled", ["model"], None, "dynamic", False, True),
    "coupled-cheap-untrimmed": ("coupled", ["model"], None, "dynamic", False, True),  # without draft trimming
    "coupled-feature": ("coupled", None, None, "dynamic", False, True),  # needs --feature-drafter (own test)
    "coupled-feature-float": ("coupled", None, None, "dynamic", False, True),  # the same, drafting in float
    "coupled-feature-untrimmed": ("coupled", None, None, "dynamic", False, True),  # the same, without trimming
    "decoupled": ("decoupled", [], None, "dynamic", True, True),
    "specactor": ("specactor", ["model", "suffix", "ngram"], ["suffix", "ngram"], "dynamic", True, True),
    "specactor-untrimmed": ("specactor", ["model", "suffix", "ngram"], ["suffix", "ngram"], "dynamic", True, True),
    "specactor-arbitrated": ("specactor", ["model", "suffix", "ngram"], ["suffix", "ngram"], "dynamic", True, True),
    "oracle": ("coupled", ["suffix", "ngram"], ["suffix", "ngram"], "fixed", False, True),
    "oracle-dynamic": ("coupled", ["suffix", "ngram"], ["suffix", "ngram"], "dynamic", False, True),
}


def _model_dir(path: Path) -> Path:
    path.mkdir()
    (path / "config.json").write_text("{}")
    return path


@pytest.fixture
def specs(tmp_path: Path) -> dict[bool, RunSpec]:
    """Run specs with (True) and without (False) a draft model, at draft length 3, batch unlimited."""
    target, drafter = _model_dir(tmp_path / "target"), _model_dir(tmp_path / "drafter")
    return {with_drafter: RunSpec(system="", trace=TRACES["quick"], target=str(target),
                                  drafter=str(drafter) if with_drafter else None, dtype="float32",
                                  num_draft_tokens=3, threads=2)
            for with_drafter in (True, False)}


def test_every_system_name_is_registered_in_order():
    assert list(SYSTEMS) == ["hf", "ar", "ar-torch", "coupled", "coupled-dynamic", "coupled-suffix", "coupled-ngram",
                             "coupled-cheap", "coupled-cheap-untrimmed", "coupled-feature", "coupled-feature-float",
                             "coupled-feature-untrimmed", "decoupled", "specactor", "specactor-untrimmed",
                             "specactor-arbitrated", "oracle", "oracle-dynamic", "vllm", "vllm-spec", "vllm-ngram"]
    assert [name for name, entry in SYSTEMS.items() if entry.needs_reference] == ["oracle", "oracle-dynamic"]
    assert system_unavailable("ar") is None and system_unavailable("nothing") is None


@pytest.mark.parametrize("variant", ENGINE_VARIANTS, ids=lambda v: v.name)
def test_each_engine_row_configures_the_engine_like_before(variant, specs):
    mode, with_model, without_model, verify_length, workers, cpu_kernels = EXPECTED[variant.name]
    for with_drafter, kinds in ((True, with_model), (False, without_model)):
        if kinds is None:
            continue
        config = engine_config(variant, specs[with_drafter])
        rollout = config.rollout
        assert (rollout.mode, [d.kind for d in rollout.drafters], rollout.verify_length) == \
            (mode, kinds, verify_length), (variant.name, with_drafter)
        assert (rollout.decoupled.drafter is not None) == (workers and with_drafter), variant.name
        assert config.model.cpu_kernels == cpu_kernels and config.threads == 2
        assert rollout.num_draft_tokens == 3 and rollout.max_batch_size == ALL_AT_ONCE
        # every setting a row does not name is the config's own default
        defaults = RolloutConfig()
        assert (rollout.combine_below, rollout.shadow_rows, rollout.acceptance, rollout.selection,
                rollout.packed_verify) == \
            (defaults.combine_below, defaults.shadow_rows, defaults.acceptance, defaults.selection,
             defaults.packed_verify)
        assert rollout.draft_trimming == (not variant.name.endswith("-untrimmed"))
        assert rollout.draft_arbitration == variant.name.endswith("-arbitrated")


@pytest.mark.parametrize("name", ["decoupled", "coupled-cheap"])
def test_rows_that_only_draft_with_the_draft_model_need_one(specs, name):
    variant = next(v for v in ENGINE_VARIANTS if v.name == name)
    with pytest.raises(RuntimeError, match=f"{name} needs a draft model"):
        EngineSystem(variant, specs[False])


def test_specactor_drafts_with_the_cheap_model_and_coupled_with_the_trace_s_model_as_is(specs):
    """`specactor` (and `coupled-cheap`) draft on int8 weights over a compact head where torch quantizes;
    `coupled` is the classic baseline: the draft model at the trace's dtype, full vocabulary."""
    from specactor_engine.model.quantize import int8_supported

    by_name = {v.name: v for v in ENGINE_VARIANTS}
    cheap = [d for name in ("specactor", "coupled-cheap")
             for d in engine_config(by_name[name], specs[True]).rollout.drafters if d.kind == "model"]
    assert len(cheap) == 2 and all(d.draft_vocab == 32768 for d in cheap)
    assert all(d.quantize == ("int8" if int8_supported() else "none") for d in cheap)
    classic = engine_config(by_name["coupled"], specs[True]).rollout.drafters[0]
    assert (classic.quantize, classic.draft_vocab, classic.dtype) == ("none", None, "float32")


def test_a_feature_drafter_joins_specactor_and_is_coupled_feature_s_only_method(specs, tmp_path):
    """--feature-drafter DIR: `coupled-feature` drafts with it alone and `specactor` adds it to its methods; without
    one, `coupled-feature` refuses to start and names the option."""
    import dataclasses

    by_name = {v.name: v for v in ENGINE_VARIANTS}
    spec = dataclasses.replace(specs[True], feature_drafter=str(tmp_path / "fd"))
    alone = engine_config(by_name["coupled-feature"], spec).rollout.drafters
    assert [(d.kind, d.path) for d in alone] == [("feature", str(tmp_path / "fd"))]
    kinds = [d.kind for d in engine_config(by_name["specactor"], spec).rollout.drafters]
    assert kinds == ["model", "feature", "suffix", "ngram"]
    with pytest.raises(RuntimeError, match="--feature-drafter DIR"):
        EngineSystem(by_name["coupled-feature"], specs[True])
    untrimmed = engine_config(by_name["coupled-feature-untrimmed"], spec).rollout
    assert [(d.kind, d.path) for d in untrimmed.drafters] == [("feature", str(tmp_path / "fd"))]
    assert not untrimmed.draft_trimming and engine_config(by_name["coupled-feature"], spec).rollout.draft_trimming


def test_the_feature_drafter_drafts_in_int8_where_the_engine_s_kernel_runs(specs, tmp_path):
    """`coupled-feature` and `specactor` draft with the feature drafter on int8 weights where the engine's own int8
    kernel runs (torch's dynamic int8 linear lost acceptance, session 34), `coupled-feature-float` in the target's
    dtype everywhere."""
    import dataclasses

    from specactor_engine.kernels import int8_linear as int8_kernel

    by_name = {v.name: v for v in ENGINE_VARIANTS}
    spec = dataclasses.replace(specs[True], feature_drafter=str(tmp_path / "fd"))
    want = "int8" if int8_kernel.available() else "none"
    for name in ("coupled-feature", "specactor"):
        feature = [d for d in engine_config(by_name[name], spec).rollout.drafters if d.kind == "feature"]
        assert [d.quantize for d in feature] == [want], name
    floating = engine_config(by_name["coupled-feature-float"], spec).rollout.drafters
    assert [(d.kind, d.quantize) for d in floating] == [("feature", "none")]


def test_vllm_speculation_follows_the_row(specs):
    from benchmark.vllm_system import VLLM_VARIANTS, speculative_config

    configs = {(v.name, d): speculative_config(v.speculation, specs[d]) for v in VLLM_VARIANTS for d in (True, False)}
    assert configs[("vllm", True)] is None and configs[("vllm", False)] is None
    assert configs[("vllm-spec", True)] == {"model": specs[True].drafter, "num_speculative_tokens": 3}
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    assert configs[("vllm-spec", False)] == configs[("vllm-ngram", True)] == configs[("vllm-ngram", False)] == ngram
