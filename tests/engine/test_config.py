"""Config loader: defaults, shipped files, dotted overrides and user-facing error messages."""

from __future__ import annotations

from pathlib import Path

import pydantic
import pytest

from specactor_engine.config import (
    ConfigError,
    ModelDrafterConfig,
    NgramDrafterConfig, SuffixDrafterConfig,
    SamplingConfig,
    SpecActorConfig,
    config_to_yaml,
    default_config_text,
    load_config,
    parse_override,
)

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


def write_yaml(tmp_path: Path, text: str, name: str = "config.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_packaged_default_is_configs_default() -> None:
    assert default_config_text() == (CONFIG_DIR / "default.yaml").read_text()


def test_default_config_values() -> None:
    cfg = load_config(None)
    assert cfg.model.target == "smollm2-135m-instruct"
    assert cfg.model.dtype == "float32"
    assert (cfg.rollout.mode, cfg.rollout.num_draft_tokens, cfg.rollout.acceptance) == (
        "specactor", 4, "position_keyed")
    assert cfg.rollout.drafters == [SuffixDrafterConfig(max_depth=24, min_match=2, max_history=16, name="suffix"),
                                    NgramDrafterConfig(kind="ngram", min_n=1, max_n=4, name="ngram")]
    sampling = cfg.sampling
    assert (sampling.temperature, sampling.max_new_tokens, sampling.n, sampling.seed) == (1.0, 128, 4, 0)
    assert cfg.threads is None


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_load(path: Path) -> None:
    assert isinstance(load_config(path), SpecActorConfig)


def test_qwen_pair_config() -> None:
    cfg = load_config(CONFIG_DIR / "qwen_pair.yaml")
    assert (cfg.model.target, cfg.model.dtype) == ("qwen2.5-coder-1.5b-instruct", "bfloat16")
    (drafter,) = cfg.rollout.drafters
    assert isinstance(drafter, ModelDrafterConfig)
    assert (drafter.model, drafter.dtype) == ("qwen2.5-coder-0.5b-instruct", None)
    assert drafter.name == "model:qwen2.5-coder-0.5b-instruct"
    assert cfg.sampling.max_new_tokens == 256


def test_schema_defaults_fill_a_minimal_file(tmp_path: Path) -> None:
    cfg = load_config(write_yaml(tmp_path, "model: {target: /models/tiny}\n"))
    assert cfg.model.max_model_len == 2048 and cfg.model.chat_template and cfg.model.device == "cpu"
    assert cfg.rollout.max_batch_size == 256 and cfg.rollout.drafters[1].kind == "ngram"
    assert cfg.sampling == SamplingConfig()
    assert (cfg.sampling.n, cfg.sampling.max_new_tokens, cfg.sampling.top_k) == (1, 256, 0)


def test_overrides_are_parsed_as_yaml() -> None:
    cfg = load_config(
        None,
        [
            "rollout.num_draft_tokens=7",
            "model.chat_template=false",
            'sampling.stop=["</s>", "\\n\\n"]',
            "sampling.stop_token_ids=[1,2]",
            "sampling.temperature=0",
            "threads=2",
            "model.cache_dir=/tmp/models",
        ],
    )
    assert cfg.rollout.num_draft_tokens == 7 and cfg.model.chat_template is False
    assert cfg.sampling.stop == ["</s>", "\n\n"] and cfg.sampling.stop_token_ids == [1, 2]
    assert cfg.sampling.greedy and cfg.threads == 2 and cfg.model.cache_dir == "/tmp/models"


def test_overrides_index_and_extend_lists() -> None:
    cfg = load_config(
        None,
        ["rollout.drafters.1.max_n=3", "rollout.drafters.2.kind=model", "rollout.drafters.2.model=/models/draft-lm/"],
    )
    _, ngram, model = cfg.rollout.drafters
    assert isinstance(ngram, NgramDrafterConfig) and ngram.max_n == 3
    assert isinstance(model, ModelDrafterConfig) and model.name == "model:draft-lm"


def test_override_replaces_a_whole_list() -> None:
    cfg = load_config(None, ["rollout.drafters=[{kind: model, model: tiny, dtype: float64}]"])
    assert cfg.rollout.drafters == [ModelDrafterConfig(kind="model", model="tiny", dtype="float64")]


def test_exponent_floats_without_a_dot_are_numbers(tmp_path: Path) -> None:
    # YAML 1.1 (PyYAML's default) reads 1e-5 as a string, which a user typing --set train.optim.lr=1e-5 got as
    # "must be a number"; the loader reads floats as YAML 1.2 does, in files and in overrides
    assert parse_override("a=1e-5") == ("a", 1e-5) and parse_override("a=-2.5E+3") == ("a", -2500.0)
    assert parse_override("a=1e") == ("a", "1e") and parse_override("a=x1e5") == ("a", "x1e5")
    cfg = load_config(write_yaml(tmp_path, "model: {target: /models/tiny}\nsampling: {temperature: 7e-1}\n"),
                      ["sampling.top_p=9E-1"])
    assert (cfg.sampling.temperature, cfg.sampling.top_p) == (0.7, 0.9)


def test_parse_override() -> None:
    assert parse_override("a.b.0.c=[1, 2]") == ("a.b.0.c", [1, 2])
    assert parse_override("a=x=y") == ("a", "x=y")
    assert parse_override("a=") == ("a", None)


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["rollout.num_draft_tokens=0"], "rollout.num_draft_tokens: must be >= 1 (got 0)"),
        (["rollout.num_draft_tokens=17"], "rollout.num_draft_tokens: must be <= 16 (got 17)"),
        (["rollout.num_draft_tokens=2.5"], "rollout.num_draft_tokens: must be an integer (got 2.5)"),
        (["rollout.num_draft_tokenz=3"], "unknown key 'rollout.num_draft_tokenz' (did you mean 'rollout.num_draft_tokens'?)"),
        (["modle.target=x"], "unknown key 'modle' (did you mean 'model'?)"),
        (["rollout.drafters.1.min_nn=2"], "unknown key 'rollout.drafters.1.min_nn' (did you mean 'rollout.drafters.1.min_n'?)"),
        (["rollout.mode=fast"], "rollout.mode: must be one of 'ar', 'coupled', 'decoupled' or 'specactor' (got 'fast')"),
        (["model.dtype=int8"], "model.dtype: must be one of 'float32', 'bfloat16', 'float16' or 'float64' (got 'int8')"),
        (["rollout.acceptance=typical"], "rollout.acceptance: must be one of"),
        (["rollout.drafters.0.kind=eagle"], "rollout.drafters.0: 'kind' must be one of 'model', 'feature', 'ngram', 'suffix' (got 'eagle')"),
        (["rollout.drafters.1.max_n=0"], "rollout.drafters.1.max_n: must be >= 1 (got 0)"),
        (["rollout.drafters.1.min_n=3", "rollout.drafters.1.max_n=2"], "max_n must be >= min_n"),
        (["rollout.drafters.0.kind=model"], "rollout.drafters.0.model: required key is missing"),
        (["rollout.drafters=[]"], "rollout: mode 'specactor' needs rollout.drafters or rollout.decoupled.drafter"),
        (["rollout.mode=coupled", "rollout.drafters=[]"], "rollout: mode 'coupled' needs at least one drafter"),
        (["rollout.drafters=[{kind: ngram}, {kind: ngram}]"], "rollout.drafters: drafter names must be unique (repeated: ngram)"),
        (["sampling.top_p=0"], "sampling.top_p: must be > 0"),
        (["sampling.top_p=1.5"], "sampling.top_p: must be <= 1"),
        (["sampling.temperature=-0.5"], "sampling.temperature: must be >= 0"),
        (["sampling.temperature=true"], "sampling.temperature: must be a number (got True)"),
        (["sampling.stop=abc"], "sampling.stop: must be a list (got 'abc')"),
        (["sampling.stop_token_ids=[1, -2]"], "sampling.stop_token_ids.1: must be >= 0 (got -2)"),
        (["sampling.max_new_tokens=0"], "sampling.max_new_tokens: must be >= 1"),
        (["model.max_model_len=8"], "model.max_model_len: must be >= 16 (got 8)"),
        (["model.target="], "model.target: must be a string (got None)"),
        (["model=3"], "model: must be a mapping (got 3)"),
        (["threads=0"], "threads: must be >= 1 (got 0)"),
    ],
)
def test_bad_values_name_the_key(overrides: list[str], expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    message = str(info.value)
    assert message.startswith("<default config>: ")
    assert expected in message
    assert "pydantic" not in message and "Input should" not in message


def test_error_names_the_file_and_the_override(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "model: {target: t}\nrollout: {num_draft_tokens: 0}\n")
    with pytest.raises(ConfigError, match=r"config\.yaml: rollout\.num_draft_tokens: must be >= 1 \(got 0\)$"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"\[from --set rollout\.num_draft_tokens=-1\]"):
        load_config(path, ["rollout.num_draft_tokens=-1"])


def test_every_problem_is_reported(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "model: {target: t, dtype: int4}\nsampling: {top_k: -1, colour: red}\n")
    lines = str(pytest.raises(ConfigError, load_config, path).value).splitlines()
    assert len(lines) == 3 and all(line.startswith(f"{path}: ") for line in lines)


def test_unknown_key_without_close_match_lists_known_keys(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown key 'sampling\.xyzzy' \(known keys: temperature, top_p"):
        load_config(None, ["sampling.xyzzy=1"])


def test_missing_target(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"model\.target: required key is missing"):
        load_config(write_yaml(tmp_path, "model: {dtype: float32}\n"))
    with pytest.raises(ConfigError, match=r"config\.yaml: model: required key is missing"):
        load_config(write_yaml(tmp_path, ""))


@pytest.mark.parametrize(
    "override, expected",
    [
        ("rollout.num_draft_tokens", "bad override 'rollout.num_draft_tokens': expected KEY=VALUE"),
        ("=4", "bad override '=4'"),
        ("a..b=1", "bad override 'a..b=1'"),
        ("rollout.drafters.5.kind=ngram", "'5' is not an index 0..2 of a list"),
        ("model.target.x=1", "cannot set 'x' inside a str"),
        ("sampling.stop=[unclosed", "value is not valid YAML"),
    ],
)
def test_bad_override_syntax(override: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=r"^<default config>: ") as info:
        load_config(None, [override])
    assert expected in str(info.value)


def test_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="nope.yaml: config file not found"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="bad.yaml: invalid YAML"):
        load_config(write_yaml(tmp_path, "model: [\n", "bad.yaml"))
    with pytest.raises(ConfigError, match="list.yaml: expected a mapping at the top level, got list"):
        load_config(write_yaml(tmp_path, "- 1\n", "list.yaml"))


def test_config_is_frozen() -> None:
    cfg = load_config(None)
    with pytest.raises(pydantic.ValidationError):
        cfg.sampling.n = 8  # type: ignore[misc]


def test_yaml_round_trip(tmp_path: Path) -> None:
    cfg = load_config(None, ["rollout.drafters.2={kind: model, model: m, name: draft}", "sampling.stop=[x]"])
    assert load_config(write_yaml(tmp_path, config_to_yaml(cfg))) == cfg


def test_drafter_names() -> None:
    assert NgramDrafterConfig().name == "ngram"
    assert ModelDrafterConfig(model="/a/b/tiny-llama").name == "model:tiny-llama"
    assert ModelDrafterConfig(model="m", name="mine").name == "mine"
    cfg = load_config(None, ["rollout.drafters=[{kind: ngram, name: short, max_n: 2}, {kind: ngram, name: long}]"])
    assert [d.name for d in cfg.rollout.drafters] == ["short", "long"]


def test_ar_mode_needs_no_drafter() -> None:
    assert load_config(None, ["rollout.mode=ar", "rollout.drafters=[]"]).rollout.drafters == []


def test_sampling_config_standalone() -> None:
    sampling = SamplingConfig(temperature=0, n=2, stop=["\n"])
    assert sampling.greedy and sampling.top_p == 1.0 and sampling.max_new_tokens == 256
    with pytest.raises(pydantic.ValidationError):
        SamplingConfig(top_p=0.0)
    with pytest.raises(pydantic.ValidationError):
        SamplingConfig(temperatur=1.0)  # type: ignore[call-arg]


@pytest.mark.parametrize(("overrides", "expected"), [
    (["rollout.mode=decoupled"], "needs rollout.decoupled.drafter"),
    (["rollout.mode=decoupled", "rollout.decoupled.drafter=x", "rollout.acceptance=rejection"],
     "set rollout.acceptance to 'position_keyed'"),
    (["rollout.decoupled.workers=0"], "rollout.decoupled.workers"),
])
def test_decoupled_settings_are_checked(overrides: list[str], expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert expected in str(info.value)
