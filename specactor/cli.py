"""The `specactor` command: manage offline models, write prompt files, run a speculative rollout.

User errors (bad config, bad prompt file, unknown model, missing input) print one clean message
and exit with code 2; heavy modules (engine, models, tasks) are imported inside the commands so
that `--help` and config errors are instant.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, NoReturn

import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.table import Table

from specactor_engine.config import ConfigError, Dtype, SpecActorConfig, config_to_yaml, load_config
from specactor_engine.io import PromptFileError, read_requests, write_output_lines, write_stats
from specactor_engine.training.report import PhaseProgress
from specactor_engine.types import EngineStats, Request, RolloutResult

if TYPE_CHECKING:
    from specactor_engine.engine import Engine
    from specactor_engine.journal import RolloutJournal
    from specactor_engine.replicas.pool import ReplicaPool

USER_ERROR_EXIT_CODE = 2
LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR"]
CacheDirOption = Annotated[Path | None, typer.Option("--cache-dir", help="Model cache directory.")]

app = typer.Typer(
    name="specactor",
    help="SpecActor: lossless speculative-decoding rollouts for RL post-training.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
models_app = typer.Typer(help="List and pull the registered offline models.", no_args_is_help=True)
app.add_typer(models_app, name="models")

console = Console()
logger = logging.getLogger("specactor")


@app.callback()
def configure(
    log_level: Annotated[LogLevel, typer.Option("--log-level", case_sensitive=False, help="Logging level.")] = "INFO",
) -> None:
    """Set up logging through rich on stderr."""
    handler = RichHandler(console=Console(stderr=True), show_path=False, rich_tracebacks=False)
    logging.basicConfig(level=log_level.upper(), format="%(message)s", handlers=[handler], force=True)
    for noisy in ("httpx", "httpcore", "urllib3", "filelock"):  # one line per HTTP call to the local Prefect API
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))


@contextlib.contextmanager
def user_errors(*extra: type[BaseException]) -> Iterator[None]:
    """Turn expected user errors into one message on stderr and exit code 2."""
    try:
        yield
    except FileNotFoundError as exc:
        _fail(f"file not found: {exc.filename}" if exc.filename else str(exc))
    except (ConfigError, PromptFileError, *extra) as exc:
        _fail(str(exc))


def _fail(message: str) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code=USER_ERROR_EXIT_CODE)


@models_app.command("list")
def models_list(cache_dir: CacheDirOption = None) -> None:
    """Show the registered models, their licenses, provenance and whether they are pulled."""
    from specactor_engine.model.registry import list_models

    table = Table(title="SpecActor models")
    for column in ("name", "params", "license", "provenance", "pulled"):
        table.add_column(column, no_wrap=column != "provenance", overflow="fold")
    for entry in list_models(cache_dir):
        row = [entry.get(column, "") for column in ("name", "params", "license", "provenance")]
        table.add_row(*map(str, row), _pulled_text(entry.get("pulled")))
    console.print(table)


def _pulled_text(pulled: object) -> str:
    """`pulled` is a bool or a mapping of pulled dtypes to paths."""
    if isinstance(pulled, dict):
        return ", ".join(pulled) or "no"
    return "yes" if pulled else "no"


@models_app.command("pull")
def models_pull(
    name: Annotated[str, typer.Argument(help="A registered model name (see `specactor models list`).")],
    dtype: Annotated[Dtype, typer.Option("--dtype", help="dtype of the saved weights.")] = "bfloat16",
    cache_dir: CacheDirOption = None,
    keep_gguf: Annotated[bool, typer.Option("--keep-gguf", help="Keep the downloaded GGUF file.")] = False,
) -> None:
    """Download, verify and convert a registered model to Hugging Face safetensors (idempotent)."""
    from specactor_engine.model.registry import ChecksumError, PullError, UnknownModelError, pull_model

    with user_errors(UnknownModelError, ChecksumError, PullError):
        path = pull_model(name, dtype=dtype, cache_dir=cache_dir, keep_gguf=keep_gguf)
    console.print(f"{name} ({dtype}) is ready at {path}", highlight=False, soft_wrap=True)


@app.command()
def prompts(
    out: Annotated[Path, typer.Option("--out", help="Output JSONL prompt file.")],
    task: Annotated[str, typer.Option("--task", help="A reasoning-gym task name.")] = "chain_sum",
    count: Annotated[int, typer.Option("--count", min=1, help="Number of prompts.")] = 4,
    seed: Annotated[int, typer.Option("--seed", help="Dataset seed.")] = 0,
    task_config: Annotated[str | None, typer.Option(
        "--task-config", help="The task's reasoning-gym settings as a JSON object, as train.data.task_config "
        "holds them, e.g. '{\"min_terms\": 2, \"max_terms\": 2}'.")] = None,
) -> None:
    """Write reasoning-gym prompts as a JSONL prompt file for `specactor rollout`."""
    from tasks.prompts import write_reasoning_gym_prompts

    settings = _json_object(task_config, "--task-config") if task_config else None
    with user_errors(ValueError):
        write_reasoning_gym_prompts(task, count, seed, out, settings)
    console.print(f"wrote {count} '{task}' prompts to {out}", highlight=False, soft_wrap=True)


def _json_object(text: str, option: str) -> dict[str, Any]:
    """`text` parsed as a JSON object; a usage error naming `option` otherwise."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise typer.BadParameter(f"not JSON ({error})", param_hint=option) from None
    if not isinstance(value, dict):
        raise typer.BadParameter(f"expected a JSON object, got {type(value).__name__}", param_hint=option)
    return value


@app.command()
def rollout(
    config: Annotated[Path | None, typer.Option("--config", "-c", help="YAML config (default: embedded).")] = None,
    overrides: Annotated[list[str] | None, typer.Option("--set", help="Override a key: --set sampling.n=8")] = None,
    prompts: Annotated[Path | None, typer.Option("--prompts", help="Input JSONL prompt file.")] = None,
    out: Annotated[Path | None, typer.Option("--out", help="Output JSONL file, one line per sample.")] = None,
    stats: Annotated[Path | None, typer.Option("--stats", help="Write the rollout stats as JSON here.")] = None,
    show_config: Annotated[bool, typer.Option("--show-config", help="Print the resolved config YAML.")] = False,
    show: Annotated[int, typer.Option("--show", min=0, help="Print the first N generated texts.")] = 0,
    restart: Annotated[bool, typer.Option("--restart", help="Discard the journal an interrupted run of this --out "
                                          "left (OUT.journal) and roll out every sample again.")] = False,
) -> None:
    """Generate `sampling.n` samples per prompt with the configured engine and write them as JSONL.

    Finished samples go to OUT.journal as they finish; if the run is interrupted, the same command resumes it,
    rolling out only the samples the journal lacks (exactly the ones an uninterrupted run writes: a sample does
    not depend on what shares the engine). The journal is removed once OUT is written.
    """
    from specactor_engine.journal import JournalError, RolloutJournal, journal_path, rollout_fingerprint

    with user_errors():
        cfg = load_config(config, overrides or ())
    if show_config:
        console.print(config_to_yaml(cfg), markup=False, highlight=False, soft_wrap=True, end="")
        if prompts is None and out is None:
            return
    if prompts is None or out is None:
        _fail("--prompts and --out are required (or pass only --show-config)")
    if out.is_dir() or (stats is not None and stats.is_dir()):
        _fail(f"output path is a directory: {out if out.is_dir() else stats}")
    with user_errors():
        requests = read_requests(prompts)
        fingerprint = rollout_fingerprint(config_to_yaml(cfg), prompts.read_bytes())
    total = len(requests) * cfg.sampling.n
    with user_errors(JournalError, OSError):
        journal = RolloutJournal.open(journal_path(out), fingerprint, restart=restart)
    if journal.done:
        logger.info("resuming from %s: %d of %d samples finished", journal.path, len(journal.done), total)
    else:
        logger.info("%d requests x %d samples from %s", len(requests), cfg.sampling.n, prompts)
    result, resumed = RolloutResult([], EngineStats(mode=cfg.rollout.mode)), len(journal.done)
    try:
        if resumed < total:
            result = _generate(cfg, requests, journal)
        lines = _journal_lines(journal.done, requests, cfg.sampling.n)
        write_output_lines(out, lines)
        if stats is not None:
            write_stats(stats, {**result.stats.to_dict(), "resumed_samples": resumed})
    except BaseException as exc:
        if not journal.done:  # nothing to resume: no journal left behind
            journal.remove()
            raise
        journal.close()
        if isinstance(exc, KeyboardInterrupt):
            typer.echo(f"interrupted: {len(journal.done)} of {total} samples are in {journal.path}; the same "
                       "command resumes from them", err=True)
            raise typer.Exit(code=130) from None
        raise
    journal.remove()
    _print_samples(lines, show)
    _print_summary(lines, result.stats, resumed, out)


def _journal_lines(done: dict[tuple[str, int], dict[str, Any]], requests: list[Request], n: int) -> list[dict]:
    """Every sample's output line in (request, sample) order; each must be in the journal by now."""
    missing = [(r.request_id, j) for r in requests for j in range(n) if (r.request_id, j) not in done]
    if missing:
        raise RuntimeError(f"the rollout ended without {len(missing)} samples, e.g. {missing[0]}")
    return [done[(r.request_id, j)] for r in requests for j in range(n)]


def _print_samples(lines: list[dict[str, Any]], count: int) -> None:
    """Show the first `count` outputs as panels (id, sample, finish reason, text)."""
    from rich.panel import Panel

    for line in lines[:count]:
        title = f"{line['id']} #{line['sample']} ({line['finish_reason']}, {len(line['token_ids'])} tokens)"
        console.print(Panel(line["text"] or line.get("error") or "", title=title, title_align="left"))


def _generate(cfg: SpecActorConfig, requests: list[Request], journal: RolloutJournal) -> RolloutResult:
    """Build the engine from `cfg` (rollout.replicas > 1: a pool of replicas, replicas/) and roll out what the
    journal lacks, recording each sample in it as it finishes."""
    from specactor_engine.engine import Engine
    from specactor_engine.model.registry import ModelNotPulledError, UnknownModelError

    n = cfg.sampling.n
    total = len(requests) * n
    if cfg.rollout.replicas > 1:
        from specactor_engine.replicas.pool import ReplicaPool

        with user_errors(UnknownModelError, ModelNotPulledError, ValueError):
            pool = ReplicaPool.from_config(cfg)
        # a pool rolls out whole groups: a group with any sample missing goes again (the journal keeps one copy)
        todo = [r for r in requests if any((r.request_id, j) not in journal.done for j in range(n))]
        with pool:  # the replicas' actors end with the rollout
            return _generate_with(pool, cfg, todo, total - len(todo) * n, total, on_output=journal.append)
    with user_errors(UnknownModelError, ModelNotPulledError, ValueError):
        engine = Engine.from_config(cfg)
    return _generate_with(engine, cfg, requests, len(journal.done), total, skip=set(journal.done),
                          on_output=journal.append)


def _generate_with(engine: Engine | ReplicaPool, cfg: SpecActorConfig, requests: list[Request], ahead: int,
                   total: int, **kwargs: Any) -> RolloutResult:
    """One rollout with a progress bar on a terminal, else a line at every tenth of the sequences; `ahead` of the
    rollout's `total` samples were finished before it (a resumed run), and count in the progress shown."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    err = Console(stderr=True)
    if not err.is_terminal:  # a log file or a pipe (make, CI): a line at every tenth of the sequences
        show = _LineProgress(err)
        show(ahead, total)  # a resumed run says where it starts
        return engine.generate(requests, cfg.sampling, lambda done, _: show(done + ahead, total), **kwargs)
    columns = (TextColumn("rollout"), BarColumn(), MofNCompleteColumn(), TextColumn("sequences"), TimeElapsedColumn())
    with Progress(*columns, console=err, transient=True) as bar:
        task = bar.add_task("rollout", total=total, completed=ahead)
        return engine.generate(requests, cfg.sampling, lambda done, _: bar.update(task, completed=done + ahead),
                               **kwargs)


class _LineProgress:
    """Long work's progress as plain lines, one at every tenth of it, where a progress bar would print nothing until
    the end (a log file or a pipe: make, CI, nohup)."""

    def __init__(self, console: Console, label: str = "rollout", unit: str = " sequences finished") -> None:
        self.console, self.label, self.unit = console, label, unit
        self.started = time.perf_counter()
        self.shown = 0  # done at the last line
        self.first: int | None = None  # done at the first call: a resumed run's tenths are of what is left

    def __call__(self, done: int, total: int, loss: float | None = None) -> None:
        if self.first is None:
            self.first = self.shown = done
            if done:  # resumed: say where it starts
                self.console.print(f"{self.label}: {done}/{total}{self.unit}, 0 s", highlight=False)
                return
        if done > self.shown and (done == total or done - self.shown >= max(1, (total - self.first) // 10)):
            self.shown = done
            tail = "" if loss is None else f", loss {loss:.3f}"
            self.console.print(f"{self.label}: {done}/{total}{self.unit}, {time.perf_counter() - self.started:.0f} s"
                               f"{tail}", highlight=False)


def _print_summary(lines: list[dict[str, Any]], stats: EngineStats, resumed: int, out: Path) -> None:
    """The rollout's figures (this run's decoding; `resumed` samples came from the journal) and its errors."""
    reasons = Counter(line["finish_reason"] for line in lines)
    table = Table(title=f"rollout ({stats.mode}) -> {out}", show_header=False)
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_row("sequences", str(len(lines)))
    if resumed:
        table.add_row("of them from the journal", str(resumed))
    table.add_row("output tokens", str(sum(len(line["token_ids"]) for line in lines)))
    table.add_row("tokens/s", f"{stats.tokens_per_s:.1f}")
    table.add_row("mean acceptance length", f"{stats.mean_acceptance_length:.2f}")
    table.add_row("acceptance rate", f"{stats.acceptance_rate:.1%}")
    table.add_row("finish reasons", ", ".join(f"{r}: {c}" for r, c in sorted(reasons.items())))
    console.print(table)
    for line in lines:
        if line.get("error"):
            logger.warning("request %s sample %d: %s", line["id"], line["sample"], line["error"])


@app.command()
def train(
    config: Annotated[Path | None, typer.Option("--config", "-c", help="YAML config with a 'train' section.")] = None,
    overrides: Annotated[list[str] | None, typer.Option("--set", help="Override a key: --set train.steps=3")] = None,
) -> None:
    """Run the post-training flow (rollout -> rewards -> GRPO update -> weight and drafter sync) per step."""
    from flows.post_training import check_train_config

    with user_errors(ValueError):
        check_train_config(load_config(config, overrides or ()))
    from flows.post_training import post_training
    from tasks.data import DataError

    with user_errors(DataError):  # a bad dataset fails in the first task, before any rollout
        result = post_training(config_path=str(config) if config else None, overrides=list(overrides or ()))
    _print_train_summary(result)


def _print_train_summary(result: dict) -> None:
    """The per-step table (reward, rollout, acceptance, the step's time split) and, when the run evaluated, the
    held-out evaluation before and after training with the rollout speedup measured on the same prompts."""
    out = Console(width=max(console.width, 120))  # the tables' columns, not cut to a pipe's 80
    steps = {step: metrics for step, metrics in result["steps"].items() if step > 0}
    table = Table(title=f"post-training -> {result['run_dir']}")
    columns = [("step", "step", "{}"), ("reward", "reward/mean", "{:.3f}"), ("accuracy", "accuracy", "{:.2f}"),
               ("accept len", "rollout/mean_acceptance_length", "{:.2f}"),
               ("verify len", "rollout/mean_verify_length", "{:.2f}"), ("loss", "train/loss", "{:.4f}"),
               ("rollout s", "time/rollout_s", "{:.1f}"), ("reward s", "time/reward_s", "{:.1f}"),
               ("update s", "time/update_s", "{:.1f}"), ("sync s", "time/sync_s", "{:.1f}"),
               ("eval s", "time/eval_s", "{:.1f}")]
    _add_rows(table, columns, [steps[step] for step in sorted(steps)])
    out.print(table)
    evaluations = [metrics for _, metrics in sorted(result["steps"].items()) if "eval/reward/mean" in metrics]
    if evaluations:
        table = Table(title="held-out evaluation (the same prompts and sampling noise each time)")
        columns = [("after step", "step", "{}"), ("policy", "eval/policy_version", "v{}"),
                   ("reward", "eval/reward/mean", "{:.3f}"), ("accuracy", "eval/accuracy", "{:.2f}"),
                   ("rollout s", "eval/rollout_s", "{:.1f}"), ("accept len", "eval/mean_acceptance_length", "{:.2f}"),
                   ("plain decoding s", "eval/ar_rollout_s", "{:.1f}"),
                   ("speedup", "eval/rollout_speedup", "{:.2f}x"), ("identical", "eval/identical", "{:.0%}")]
        _add_rows(table, columns, evaluations)
        out.print(table)
        first, last = evaluations[0], evaluations[-1]
        if len(evaluations) > 1:
            out.print(f"held-out reward {first['eval/reward/mean']:.3f} -> {last['eval/reward/mean']:.3f}, "
                      f"accuracy {first['eval/accuracy']:.2f} -> {last['eval/accuracy']:.2f} (policy "
                      f"v{first['eval/policy_version']} -> v{last['eval/policy_version']})",
                      highlight=False, soft_wrap=True)
        if "eval/rollout_speedup" in last:
            out.print(f"rollout speedup over plain decoding on the held-out prompts (v{last['eval/policy_version']}"
                      f"): {last['eval/rollout_speedup']:.2f}x ({last['eval/ar_rollout_s']:.1f} s -> "
                      f"{last['eval/rollout_s']:.1f} s), outputs identical: {last['eval/identical']:.0%}",
                      highlight=False, soft_wrap=True)
    if (note := _speculation_note(list(steps.values()))) is not None:
        out.print(note, highlight=False, soft_wrap=True)
    console.print(f"run directory: {result['run_dir']}\nW&B files: {result['wandb_dir']}", highlight=False)


SPECULATION_OFF_BELOW = 0.1  # mean verify length (draft tokens verified per row per round) under which it stayed off


def _speculation_note(steps: list[dict]) -> str | None:
    """A line saying why the acceptance length stayed at 1 when the verify-length policy chose (almost) no drafts
    over the whole run: that is its cost model's decision, not drafts failing; None otherwise (and for plain
    decoding, which has no drafters to report)."""
    lengths = [m["rollout/mean_verify_length"] for m in steps if "rollout/mean_verify_length" in m]
    drafting = any(key.startswith("drafter/") for m in steps for key in m)
    if not drafting or not lengths or max(lengths) >= SPECULATION_OFF_BELOW:
        return None
    return (f"speculation stayed off: the verify-length policy verified at most {max(lengths):.2f} draft tokens per "
            "row per round in any step, judging from the measured verify costs and the drafts' acceptance that "
            "wider verifies would cost more than they return at this batch on this machine (docs/training.md, "
            "'Speculation in the main job')")


def _add_rows(table: Table, columns: list[tuple[str, str, str]], rows: list[dict]) -> None:
    for label, _, _ in columns:
        table.add_column(label, justify="right", no_wrap=True)
    for metrics in rows:
        table.add_row(*[fmt.format(metrics[key]) if key in metrics else "-" for _, key, fmt in columns])


@app.command()
def deploy(
    name: Annotated[str, typer.Option("--name", help="Deployment name.")] = "post-training",
    config: Annotated[Path | None, typer.Option("--config", "-c", help="Config passed to every run.")] = None,
    overrides: Annotated[list[str] | None, typer.Option(
        "--set", help="Override a key in every run: --set rollout.replicas=2 (checked now, as `train` does)")] = None,
) -> None:
    """Serve the post-training flow as a Prefect deployment (start runs with `prefect deployment run`)."""
    from flows.post_training import check_train_config, post_training

    with user_errors(ValueError):  # a bad config or override fails here, not in every run the deployment starts
        check_train_config(load_config(config, overrides or ()))
    parameters = {"config_path": str(config.resolve()) if config else None, "overrides": list(overrides or ())}
    console.print(f"serving deployment 'post_training/{name}'; run it with: "
                  f"prefect deployment run 'post_training/{name}'", highlight=False)
    post_training.serve(name=name, parameters=parameters)


drafter_app = typer.Typer(help="Train draft models.", no_args_is_help=True)
app.add_typer(drafter_app, name="drafter")


@drafter_app.command("distill")
def drafter_distill(
    target: Annotated[str, typer.Option("--target", help="Target model: a registered name or a local HF dir.")],
    data: Annotated[Path, typer.Option("--data", help="Rollout records (prompt_token_ids + token_ids, e.g. a run's "
                                       "steps/*/rollouts.jsonl) or a prompt file to roll out with the target.")],
    out: Annotated[Path, typer.Option("--out", help="Output HF model dir; a run finding one resumes it.")],
    init: Annotated[str | None, typer.Option("--init", help="Drafter to start from (name or HF dir).")] = None,
    init_layers: Annotated[int | None, typer.Option(
        "--init-layers", min=1, help="Start from the target's first N layers + its norm and head.")] = None,
    dtype: Annotated[Dtype, typer.Option("--dtype", help="Training dtype.")] = "float32",
    steps: Annotated[int, typer.Option("--steps", min=1, help="Optimizer steps in total (resumed runs count on).")] = 200,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1)] = 8,
    lr: Annotated[float, typer.Option("--lr", min=0.0)] = 3e-4,
    save_every: Annotated[int, typer.Option("--save-every", min=1, help="Save (and allow resuming) every N steps.")] = 50,
    max_minutes: Annotated[float | None, typer.Option(
        "--max-minutes", min=0.0, help="Stop training after this long, counted from the start (sampling and "
        "the teacher pass included).")] = None,
    samples: Annotated[int, typer.Option("--samples", min=1, help="Samples per prompt when --data holds prompts.")] = 4,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", min=1, help="When rolling out prompts.")] = 256,
    seed: Annotated[int, typer.Option("--seed", min=0)] = 0,
    soft_top_k: Annotated[int, typer.Option(
        "--soft-top-k", min=0, help="Train on the target's top-k next-token distribution at every position "
        "(one teacher-forced pass, cached in --out); 0: on the sampled tokens only.")] = 32,
    draft_vocab: Annotated[int, typer.Option(
        "--draft-vocab", min=0, help="Give the drafter a head over the N tokens the target uses most in the "
        "data (saved as draft_vocab.json; drafting gets cheaper, output stays exact); 0: the full vocabulary.")] = 16384,
    freeze_embeddings: Annotated[bool, typer.Option(
        "--freeze-embeddings/--train-embeddings", help="Keep the (tied) embeddings fixed: faster steps.")] = True,
    bf16_autocast: Annotated[bool, typer.Option(
        "--bf16-autocast/--no-bf16-autocast", help="Sampling the prompts (a bf16 copy of the target), the teacher "
        "pass and training steps in bfloat16 (weights and optimizer stay in --dtype): 1.4-2x faster on CPUs with "
        "AVX-512 BF16.")] = True,
    lr_decay: Annotated[bool, typer.Option(
        "--lr-decay/--constant-lr", help="Warm up for 10 steps, then decay the learning rate linearly to a tenth "
        "by the last step or the end of --max-minutes, whichever comes first.")] = True,
    student_rounds: Annotated[int, typer.Option(
        "--student-rounds", min=0, help="On-policy data: this many times, spread over the run, the drafter samples "
        "the training prompts itself and the target labels every position with its top-k (needs --soft-top-k); "
        "cached in --out.")] = 0,
    student_samples: Annotated[int, typer.Option(
        "--student-samples", min=1, help="Drafter samples per prompt in each --student-rounds round.")] = 2,
    loss: Annotated[Literal["kl", "coupled"], typer.Option(
        "--loss", help="With --soft-top-k: 'kl' is cross-entropy to the target's top-k; 'coupled' maximises the "
        "probability that a draft token is accepted under the engine's shared-noise rule, plus --kl-weight x the "
        "cross-entropy.")] = "kl",
    kl_weight: Annotated[float, typer.Option(
        "--kl-weight", min=0.0, help="Weight of the cross-entropy term in --loss coupled.")] = 0.1,
    freeze_layers: Annotated[int, typer.Option(
        "--freeze-layers", min=0, help="Keep the drafter's first N blocks as they are (with --init-layers: the "
        "target's own): no backward through them, so steps are faster, and fewer weights to over-fit.")] = 0,
    cache_dir: CacheDirOption = None,
) -> None:
    """Distil a draft model from a target on its own samples (progress bar, resumable, HF output)."""
    from specactor_engine.training.job import DistillJob, run_distill
    from specactor_engine.training.samples import DistillDataError

    job = DistillJob(target=target, data=data, out=out, init=init, init_layers=init_layers, dtype=dtype,
                     cache_dir=cache_dir, steps=steps, batch_size=batch_size, lr=lr, save_every=save_every,
                     max_minutes=max_minutes, samples=samples, max_new_tokens=max_new_tokens, seed=seed,
                     soft_top_k=soft_top_k, draft_vocab=draft_vocab, freeze_embeddings=freeze_embeddings,
                     bf16_autocast=bf16_autocast, lr_decay=lr_decay, student_rounds=student_rounds,
                     student_samples=student_samples, loss=loss, kl_weight=kl_weight, freeze_layers=freeze_layers)
    with user_errors(DistillDataError, ValueError):
        result = run_distill(job, _ConsoleReporter())
    first, last = result.loss_first, result.loss_last
    console.print(f"drafter saved to {out} after {result.steps} steps "
                  f"({result.trained_steps} now, {result.seconds:.0f} s, "
                  f"{result.student_rounds} on-policy rounds"
                  + (f", loss {first:.3f} -> {last:.3f}" if first is not None else "") + ")", highlight=False)


@drafter_app.command("feature")
def drafter_feature(
    target: Annotated[str, typer.Option("--target", help="Target model: a registered name or a local HF dir.")],
    data: Annotated[Path, typer.Option("--data", help="Rollout records (prompt_token_ids + token_ids) or a prompt "
                                       "file to roll out with the target.")],
    out: Annotated[Path, typer.Option("--out", help="Output directory (feature_drafter.safetensors, draft_vocab.json, "
                                      "feature_report.json); a run finding its state there resumes it.")],
    dtype: Annotated[Dtype, typer.Option("--dtype", help="Target and drafter dtype.")] = "float32",
    steps: Annotated[int, typer.Option("--steps", min=1, help="Optimizer steps in total (resumed runs count on).")] = 300,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1)] = 4,
    lr: Annotated[float, typer.Option("--lr", min=0.0)] = 3e-4,
    save_every: Annotated[int, typer.Option("--save-every", min=1, help="Save (and allow resuming) every N steps.")] = 25,
    max_minutes: Annotated[float | None, typer.Option(
        "--max-minutes", min=0.0, help="Stop training after this long, counted from the start (sampling and the "
        "features' pass included).")] = None,
    samples: Annotated[int, typer.Option("--samples", min=1, help="Samples per prompt when --data holds prompts.")] = 2,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", min=1, help="When rolling out prompts.")] = 256,
    seed: Annotated[int, typer.Option("--seed", min=0)] = 0,
    draft_vocab: Annotated[int, typer.Option(
        "--draft-vocab", min=0, help="A head over the N tokens the data use most (saved as draft_vocab.json); "
        "0: the full vocabulary.")] = 32768,
    feature_weight: Annotated[float, typer.Option(
        "--feature-weight", min=0.0, help="Weight of the feature regression beside the cross-entropy.")] = 1.0,
    noise: Annotated[float, typer.Option(
        "--noise", min=0.0, help="Uniform noise (+-) on the input features while training.")] = 0.1,
    passes: Annotated[int, typer.Option(
        "--passes", min=1, help="Draft steps trained per position (training-time test): 1 trains on the target's "
        "features only; P > 1 also trains steps 2..P as drafting runs them, on the drafter's own predicted features "
        "(each pass costs about as much as the first).")] = 1,
    feature_dtype: Annotated[Dtype | None, typer.Option(
        "--feature-dtype", help="The target's dtype for the features' pass (default: --dtype): bfloat16 gives the "
        "features a bf16-served target computes, and runs faster on a CPU with bf16 units; the drafter still "
        "trains in --dtype.")] = None,
    bf16_autocast: Annotated[bool, typer.Option(
        "--bf16-autocast/--no-bf16-autocast", help="Training steps' matmuls in bfloat16 (weights, optimizer and "
        "the loss's softmaxes stay in --dtype float32): 1.5-2x faster steps on CPUs with AVX-512 BF16.")] = True,
    cache_dir: CacheDirOption = None,
) -> None:
    """Train a feature-level drafter (EAGLE-style: one decoder layer over the target's last hidden states) on the
    target's own samples; use it with `rollout.drafters: [{kind: feature, path: OUT}]`."""
    from specactor_engine.training.feature_job import FeatureJob, run_feature_distill
    from specactor_engine.training.samples import DistillDataError

    job = FeatureJob(target=target, data=data, out=out, dtype=dtype, cache_dir=cache_dir, steps=steps,
                     batch_size=batch_size, lr=lr, save_every=save_every, max_minutes=max_minutes, samples=samples,
                     max_new_tokens=max_new_tokens, seed=seed, draft_vocab=draft_vocab, feature_weight=feature_weight,
                     noise=noise, passes=passes, feature_dtype=feature_dtype, bf16_autocast=bf16_autocast)
    with user_errors(DistillDataError, ValueError):
        result = run_feature_distill(job, _ConsoleReporter())
    loss = "" if result.loss_first is None else f", loss {result.loss_first:.3f} -> {result.loss_last:.3f}"
    top1 = "" if result.held_out_top1 is None else f", held-out top-1 agreement {result.held_out_top1:.3f}"
    if result.held_out_acceptance:
        table = Table(title="held-out chance of acceptance per draft step (T = 1, shared noise), by drafting "
                      "temperature scale")
        table.add_column("scale")
        for step in range(len(next(iter(result.held_out_acceptance.values())))):
            table.add_column(f"step {step + 1}")
        for scale, rates in result.held_out_acceptance.items():
            kept = " (kept)" if scale == result.temperature_scale else ""
            table.add_row(f"{scale:g}{kept}", *(f"{rate:.3f}" for rate in rates))
        console.print(table)
    console.print(f"feature drafter saved to {out} after {result.steps} steps ({result.trained_steps} now, "
                  f"{result.seconds:.0f} s{loss}{top1})", highlight=False)


class _ConsoleReporter:
    """A training job's notes as console lines and its phases as progress bars (with the loss)."""

    def note(self, message: str) -> None:
        console.print(message, highlight=False)

    @contextlib.contextmanager
    def phase(self, name: str, total: int) -> Iterator[PhaseProgress]:
        if not console.is_terminal:  # a log file or a pipe: lines (a 60-minute training run logged nothing until its end)
            lines = _LineProgress(console, name, "")
            yield lambda done, loss=None: lines(done, total, loss)
            return
        with _progress() as progress:
            task = progress.add_task(name, total=total, loss=float("nan"))

            def update(done: int, loss: float | None = None) -> None:
                progress.update(task, completed=done, **({} if loss is None else {"loss": loss}))

            yield update


def _progress():  # noqa: ANN202 - a rich Progress context
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("loss {task.fields[loss]:.3f}"), TimeElapsedColumn(), console=console)


def _add_bench_command() -> None:
    """`specactor bench ...` is the benchmark harness's own Typer app (benchmark/cli.py); `specactor simulate`
    replays its runs under a cost model (benchmark/simulate)."""
    try:
        from benchmark.cli import bench
        from benchmark.simulate.cli import simulate
    except ImportError:  # the harness is not installed with this checkout
        return
    app.command(name="bench")(bench)
    app.command(name="simulate")(simulate)


def main() -> None:
    """Entry point of the `specactor` console script."""
    _add_bench_command()
    app()


if __name__ == "__main__":
    main()
