"""`specactor` CLI as a unit: user errors exit 2 with one clean message; rollout runs a fake engine."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from specactor_engine.model import registry as models
from specactor.cli import app
from specactor_engine.config import SamplingConfig, SpecActorConfig
from specactor_engine.types import EngineStats, Request, RolloutResult, SequenceOutput

OUTPUT_KEYS = {"id", "sample", "prompt_token_ids", "token_ids", "text", "logprobs", "finish_reason", "policy_version"}
PROMPT_LINES = ['{"id": "q1", "prompt": "2+2?"}', '{"id": 7, "prompt_token_ids": [1, 2, 3]}']

runner = CliRunner()


class FakeEngine:
    """Stands in for `specactor_engine.engine.Engine`: echoes each request `n` times."""

    built: list[FakeEngine] = []
    interrupt_after: int | None = None  # raise KeyboardInterrupt (Ctrl-C) after this many samples

    def __init__(self, cfg: SpecActorConfig) -> None:
        self.cfg = cfg
        self.calls: list[tuple[list[Request], SamplingConfig]] = []
        self.skipped: list[set[tuple[str, int]]] = []

    @classmethod
    def from_config(cls, cfg: SpecActorConfig) -> FakeEngine:
        engine = cls(cfg)
        cls.built.append(engine)
        return engine

    def generate(self, requests: list[Request], sampling: SamplingConfig, progress=None, *, skip=(),
                 on_output=None) -> RolloutResult:
        self.calls.append((requests, sampling))
        self.skipped.append(set(skip))
        outputs = [
            SequenceOutput(r.request_id, j, [1], [4, 5, j], "four", [-0.1, -0.2, -0.3], "stop" if j else "length", 0)
            for r in requests
            for j in range(sampling.n)
            if (r.request_id, j) not in skip
        ]
        for done, output in enumerate(outputs):
            if done == self.interrupt_after:
                raise KeyboardInterrupt
            if on_output is not None:
                on_output(output)
        if progress is not None:
            progress(len(outputs), len(outputs))
        stats = EngineStats(
            mode=self.cfg.rollout.mode, num_sequences=len(outputs), output_tokens=3 * len(outputs),
            verify_rounds=2, row_rounds=4, drafted_tokens=8, accepted_tokens=6, total_s=0.5,
        )
        return RolloutResult(outputs, stats)


class ExplodingEngine:
    @classmethod
    def from_config(cls, cfg: SpecActorConfig) -> Any:
        raise AssertionError("the engine must not be built when the input is bad")


def install_engine(monkeypatch: pytest.MonkeyPatch, engine: type) -> None:
    """Replace the engine module, so the CLI test needs no model (and no engine code)."""
    module = types.ModuleType("specactor_engine.engine")
    module.Engine = engine  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "specactor_engine.engine", module)


@pytest.fixture
def fake_engine(monkeypatch: pytest.MonkeyPatch) -> type[FakeEngine]:
    FakeEngine.built, FakeEngine.interrupt_after = [], None
    install_engine(monkeypatch, FakeEngine)
    return FakeEngine


@pytest.fixture
def prompts_file(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(PROMPT_LINES) + "\n")
    return path


def run(*args: str | Path) -> Any:
    return runner.invoke(app, [str(a) for a in args])


def assert_user_error(result: Any, *expected: str) -> None:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    for text in expected:
        assert text in result.output


def test_help_lists_the_commands() -> None:
    result = run("--help")
    assert result.exit_code == 0
    for command in ("rollout", "models", "prompts", "--log-level"):
        assert command in result.output
    assert "list" in run("models", "--help").output and "pull" in run("models", "--help").output


def test_rollout_writes_outputs_and_stats(fake_engine: type[FakeEngine], prompts_file: Path, tmp_path: Path) -> None:
    out, stats = tmp_path / "out" / "rollout.jsonl", tmp_path / "stats.json"
    result = run(
        "rollout", "--prompts", prompts_file, "--out", out, "--stats", stats,
        "--set", "sampling.n=2", "--set", "rollout.num_draft_tokens=3",
    )
    assert result.exit_code == 0, result.output
    (engine,) = fake_engine.built
    assert engine.cfg.rollout.num_draft_tokens == 3
    ((requests, sampling),) = engine.calls
    assert [r.request_id for r in requests] == ["q1", "7"] and sampling == engine.cfg.sampling
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [set(r) for r in records] == [OUTPUT_KEYS] * 4
    assert [(r["id"], r["sample"]) for r in records] == [("q1", 0), ("q1", 1), ("7", 0), ("7", 1)]
    figures = json.loads(stats.read_text())
    assert figures["accepted_tokens"] == 6 and figures["mean_acceptance_length"] == 2.5
    assert figures["acceptance_rate"] == 0.75 and figures["tokens_per_s"] == 24.0
    for text in ("sequences", "tokens/s", "mean acceptance length", "2.50", "75.0%", "length: 2, stop: 2"):
        assert text in result.output
    assert "rollout: 4/4 sequences finished" in result.output  # not a terminal: progress as lines, not a bar


def test_an_interrupted_rollout_resumes_from_its_journal(fake_engine: type[FakeEngine], prompts_file: Path,
                                                         tmp_path: Path) -> None:
    out, stats = tmp_path / "rollout.jsonl", tmp_path / "stats.json"
    journal = tmp_path / "rollout.jsonl.journal"
    args = ("rollout", "--prompts", prompts_file, "--out", out, "--stats", stats, "--set", "sampling.n=3")
    fake_engine.interrupt_after = 4  # Ctrl-C with 4 of 6 samples finished
    result = run(*args)
    assert result.exit_code == 130, result.output
    assert "interrupted: 4 of 6 samples are in" in result.output and "Traceback" not in result.output
    assert not out.exists() and len(journal.read_text().splitlines()) == 1 + 4

    fake_engine.interrupt_after = None
    result = run(*args)
    assert result.exit_code == 0, result.output
    assert fake_engine.built[-1].skipped == [{("q1", 0), ("q1", 1), ("q1", 2), ("7", 0)}]  # only the two left
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["id"], r["sample"], r["token_ids"][-1]) for r in records] == [
        ("q1", 0, 0), ("q1", 1, 1), ("q1", 2, 2), ("7", 0, 0), ("7", 1, 1), ("7", 2, 2)]
    assert json.loads(stats.read_text())["resumed_samples"] == 4
    assert "of them from the journal" in result.output
    assert "rollout: 4/6 sequences finished" in result.output and "rollout: 6/6 sequences finished" in result.output
    assert not journal.exists()  # the output is written: nothing left to resume

    result = run(*args)  # a finished rollout run again starts over (no journal)
    assert result.exit_code == 0 and fake_engine.built[-1].skipped == [set()]


def test_a_journal_of_another_rollout_is_refused_and_restart_discards_it(fake_engine: type[FakeEngine],
                                                                         prompts_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "rollout.jsonl"
    fake_engine.interrupt_after = 1
    assert run("rollout", "--prompts", prompts_file, "--out", out).exit_code == 130
    fake_engine.interrupt_after = None
    built = len(fake_engine.built)
    other = run("rollout", "--prompts", prompts_file, "--out", out, "--set", "sampling.seed=99")
    assert_user_error(other, "rollout.jsonl.journal", "different config or prompt file", "--restart")
    assert len(fake_engine.built) == built  # refused before the engine was built
    result = run("rollout", "--prompts", prompts_file, "--out", out, "--set", "sampling.seed=99", "--restart")
    assert result.exit_code == 0, result.output
    engine = fake_engine.built[-1]
    assert engine.skipped == [set()] and len(out.read_text().splitlines()) == 2 * engine.cfg.sampling.n


def test_a_rollout_that_fails_before_any_sample_leaves_no_journal(monkeypatch: pytest.MonkeyPatch,
                                                                   prompts_file: Path, tmp_path: Path) -> None:
    from specactor_engine.model.registry import UnknownModelError

    class Unknown:
        @classmethod
        def from_config(cls, cfg: SpecActorConfig) -> Any:
            raise UnknownModelError("unknown model 'nope'")

    install_engine(monkeypatch, Unknown)
    out = tmp_path / "rollout.jsonl"
    assert_user_error(run("rollout", "--prompts", prompts_file, "--out", out), "unknown model 'nope'")
    assert not (tmp_path / "rollout.jsonl.journal").exists()


def test_rollout_progress_in_a_log_is_a_line_at_every_tenth() -> None:
    from io import StringIO

    from rich.console import Console

    from specactor.cli import _LineProgress

    buffer = StringIO()
    progress = _LineProgress(Console(file=buffer, width=200))
    for done in range(0, 31):
        progress(done, 30)
    lines = buffer.getvalue().splitlines()
    assert [line.split(" sequences")[0] for line in lines] == [f"rollout: {n}/30" for n in range(3, 31, 3)]


def test_a_resumed_run_s_progress_is_a_line_at_every_tenth_of_what_is_left() -> None:
    """A training run resumed at step 789 of 1,089 printed its next line 108 steps (~5 minutes) on: tenths of the
    total, not of what was left."""
    from io import StringIO

    from rich.console import Console

    from specactor.cli import _LineProgress

    buffer = StringIO()
    progress = _LineProgress(Console(file=buffer, width=200), "training", "")
    for done in range(80, 101):
        progress(done, 100)
    lines = buffer.getvalue().splitlines()
    assert [line.split(",")[0] for line in lines] == [f"training: {n}/100" for n in range(80, 101, 2)]


def test_rollout_with_a_config_file(fake_engine: type[FakeEngine], prompts_file: Path, tmp_path: Path) -> None:
    config = Path(__file__).resolve().parents[2] / "configs" / "ar.yaml"
    result = run("rollout", "--config", config, "--prompts", prompts_file, "--out", tmp_path / "o.jsonl")
    assert result.exit_code == 0, result.output
    assert fake_engine.built[0].cfg.rollout.mode == "ar"


@pytest.mark.parametrize(
    "override, expected",
    [
        ("rollout.num_draft_tokenz=3", "unknown key 'rollout.num_draft_tokenz' (did you mean 'rollout.num_draft_tokens'?)"),
        ("rollout.num_draft_tokens=0", "rollout.num_draft_tokens: must be >= 1 (got 0)"),
        ("model.dtype=int8", "model.dtype: must be one of"),
        ("sampling.n", "bad override 'sampling.n'"),
    ],
)
def test_rollout_bad_config_exits_2_before_the_engine(
    monkeypatch: pytest.MonkeyPatch, prompts_file: Path, tmp_path: Path, override: str, expected: str
) -> None:
    install_engine(monkeypatch, ExplodingEngine)
    result = run("rollout", "--set", override, "--prompts", prompts_file, "--out", tmp_path / "o.jsonl")
    assert_user_error(result, expected)
    assert not (tmp_path / "o.jsonl").exists()


def test_rollout_bad_config_file(monkeypatch: pytest.MonkeyPatch, prompts_file: Path, tmp_path: Path) -> None:
    install_engine(monkeypatch, ExplodingEngine)
    config = tmp_path / "config.yaml"
    config.write_text("model: {target: t}\nsampling: {top_p: 2}\n")
    result = run("rollout", "--config", config, "--prompts", prompts_file, "--out", tmp_path / "o.jsonl")
    assert_user_error(result, f"{config}: sampling.top_p: must be <= 1")
    assert_user_error(run("rollout", "--config", tmp_path / "none.yaml"), "none.yaml: config file not found")


def test_rollout_malformed_jsonl_reports_file_and_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    install_engine(monkeypatch, ExplodingEngine)
    prompts = tmp_path / "bad.jsonl"
    prompts.write_text(PROMPT_LINES[0] + "\n\n{\"id\": 2, \"prompt\": \n")
    result = run("rollout", "--prompts", prompts, "--out", tmp_path / "o.jsonl")
    assert_user_error(result, f"{prompts}:3: invalid JSON")


def test_rollout_missing_inputs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    install_engine(monkeypatch, ExplodingEngine)
    missing = tmp_path / "missing.jsonl"
    assert_user_error(run("rollout", "--prompts", missing, "--out", tmp_path / "o.jsonl"), f"file not found: {missing}")
    assert_user_error(run("rollout", "--out", tmp_path / "o.jsonl"), "--prompts and --out are required")
    assert_user_error(run("rollout", "--prompts", missing, "--out", tmp_path), "output path is a directory")


def test_rollout_unknown_model_exits_2(monkeypatch: pytest.MonkeyPatch, prompts_file: Path, tmp_path: Path) -> None:
    class UnknownTargetEngine:
        @classmethod
        def from_config(cls, cfg: SpecActorConfig) -> Any:
            raise models.UnknownModelError(f"unknown model '{cfg.model.target}': known models are a, b")

    install_engine(monkeypatch, UnknownTargetEngine)
    result = run("rollout", "--set", "model.target=nope", "--prompts", prompts_file, "--out", tmp_path / "o.jsonl")
    assert_user_error(result, "unknown model 'nope': known models are a, b")


def test_show_config_prints_the_resolved_yaml(monkeypatch: pytest.MonkeyPatch) -> None:
    install_engine(monkeypatch, ExplodingEngine)
    result = run("rollout", "--show-config", "--set", "sampling.temperature=0")
    assert result.exit_code == 0, result.output
    assert "target: smollm2-135m-instruct" in result.output and "temperature: 0.0" in result.output


def test_models_list_table(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen: list[Path | None] = []

    def list_models(cache_dir: Path | None = None) -> list[dict[str, Any]]:
        seen.append(cache_dir)
        return [
            {"name": "tiny-a", "license": "MIT", "provenance": "unit test", "pulled": {"float32": "/x"}},
            {"name": "tiny-b", "license": "Apache-2.0", "provenance": "unit test", "pulled": {}},
        ]

    monkeypatch.setattr(models, "list_models", list_models)
    result = run("models", "list", "--cache-dir", tmp_path)
    assert result.exit_code == 0, result.output
    assert seen == [tmp_path]
    for text in ("tiny-a", "tiny-b", "MIT", "Apache-2.0", "float32"):
        assert text in result.output


def test_models_pull_passes_options(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls: list[tuple[str, dict[str, Any]]] = []

    def pull_model(name: str, **kwargs: Any) -> Path:
        calls.append((name, kwargs))
        return tmp_path / name

    monkeypatch.setattr(models, "pull_model", pull_model)
    result = run("models", "pull", "tiny-a", "--dtype", "float32", "--cache-dir", tmp_path, "--keep-gguf")
    assert result.exit_code == 0, result.output
    assert calls == [("tiny-a", {"dtype": "float32", "cache_dir": tmp_path, "keep_gguf": True})]
    assert "tiny-a" in result.output


def test_models_pull_unknown_name_lists_known_names() -> None:
    result = run("models", "pull", "no-such-model")
    assert_user_error(result, "no-such-model", "smollm2-135m-instruct")


def test_models_pull_rejects_bad_dtype() -> None:
    assert run("models", "pull", "smollm2-135m-instruct", "--dtype", "int8").exit_code == 2


def test_prompts_command_calls_the_task_writer(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls: list[tuple[Any, ...]] = []
    module = types.ModuleType("tasks.prompts")
    module.write_reasoning_gym_prompts = lambda *args: calls.append(args)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tasks.prompts", module)
    out = tmp_path / "p.jsonl"
    result = run("prompts", "--task", "chain_sum", "--count", "3", "--seed", "5", "--out", out)
    assert result.exit_code == 0, result.output
    assert calls == [("chain_sum", 3, 5, out, None)]


def test_prompts_command_passes_the_task_config_and_refuses_bad_json(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls: list[tuple[Any, ...]] = []
    module = types.ModuleType("tasks.prompts")
    module.write_reasoning_gym_prompts = lambda *args: calls.append(args)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tasks.prompts", module)
    out = tmp_path / "p.jsonl"
    result = run("prompts", "--count", "2", "--out", out, "--task-config", '{"min_terms": 2, "max_terms": 2}')
    assert result.exit_code == 0, result.output
    assert calls == [("chain_sum", 2, 0, out, {"min_terms": 2, "max_terms": 2})]
    for bad, said in (("{min_terms: 2}", "not JSON"), ("[2]", "expected a JSON object")):
        result = run("prompts", "--out", out, "--task-config", bad)
        assert result.exit_code == 2 and said in result.output and "--task-config" in result.output
    assert len(calls) == 1


def test_log_level_option(fake_engine: type[FakeEngine], prompts_file: Path, tmp_path: Path) -> None:
    result = run("--log-level", "debug", "rollout", "--prompts", prompts_file, "--out", tmp_path / "o.jsonl")
    assert result.exit_code == 0, result.output
    assert run("--log-level", "loud", "rollout").exit_code == 2


def test_train_refuses_bad_settings_before_any_work(tmp_path):
    """Unknown reward and fp16 on CPU are refused with one line, exit code 2, before the flow starts."""
    from typer.testing import CliRunner

    from specactor.cli import app

    runner = CliRunner()
    bad_reward = runner.invoke(app, ["train", "--set", "train.rewards={nope: 1.0}"])
    assert bad_reward.exit_code == 2 and "unknown reward" in bad_reward.output
    fp16 = runner.invoke(app, ["train", "--set", "train.optim.dtype=float16"])
    assert fp16.exit_code == 2 and "float16" in fp16.output


def test_deploy_passes_overrides_to_every_run_and_checks_them_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """`specactor deploy --set ...` serves the flow with the overrides as a parameter of every run; a bad override
    is refused before anything is served."""
    from flows.post_training import post_training

    served: list[dict] = []
    monkeypatch.setattr(type(post_training), "serve", lambda self, name, parameters: served.append(parameters))
    config = Path(__file__).resolve().parents[2] / "configs" / "train_smollm2.yaml"
    result = run("deploy", "--config", config, "--set", "rollout.num_draft_tokens=2", "--set", "train.steps=3")
    assert result.exit_code == 0, result.output
    assert served == [{"config_path": str(config), "overrides": ["rollout.num_draft_tokens=2", "train.steps=3"]}]
    bad = run("deploy", "--config", config, "--set", "train.rewards={nope: 1.0}")
    assert bad.exit_code == 2 and "unknown reward" in bad.output and len(served) == 1
