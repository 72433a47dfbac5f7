"""Building a run's process-local host: the rollout engine and the policy trainer at a policy version.

`host_for(run_root)` returns the host kept in this process (tasks/runtime.py) or builds it from the
last published checkpoint; `push_policy` moves the trainer's weights into the engine, `restore_engine`
puts the engine and its drafters back at an earlier version (after a failed sync). With rollout.replicas > 1
the engine is a `ReplicaPool` (specactor_engine/replicas/): the same calls reach every replica.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specactor_engine.config import SpecActorConfig, load_config
from tasks.drafter_store import load_drafters, load_initial_drafters
from tasks.run_dir import RunDir
from tasks.runtime import RunHost, get_host, set_host

if TYPE_CHECKING:
    from specactor_engine.replicas import RolloutEngine
    from tasks.trainer import PolicyTrainer
    from tasks.trainer_ranks import RankedTrainer

WEIGHTS_FILE = "model.safetensors"


def build_host(run_root: str, config: SpecActorConfig, with_trainer: bool = True) -> RunHost:
    """Engine (+ trainer) for a run, both at the last published policy version."""
    start_local_ray(config, with_trainer)
    run = RunDir(Path(run_root))
    version = run.latest_version()
    source = policy_source(run, config, version)
    engine = build_engine(config, source, version)
    host = RunHost(config=config, engine=engine, tokenizer=engine.tokenizer)
    if version:
        load_drafters(host, run.checkpoint(version), version)
    if with_trainer:  # the KL reference is the initial policy, also in a resumed run
        reference = policy_source(run, config, 0) if version and config.train.optim.use_reference else None
        host.trainer = build_trainer(config, source, version, reference)
    return set_host(run_root, host)


def local_ray_cpus(config: SpecActorConfig, with_trainer: bool = True) -> int:
    """Logical CPUs a local Ray instance needs for the run's actors: the rollout replicas' and the trainer ranks'
    threads. Both reserve theirs for the whole run though they compute in turns (rollout, then update), so on a
    machine with fewer cores the instance claims more CPUs than it has, or the ranks would never be placed."""
    from specactor_engine.replicas.pool import replica_threads
    from tasks.trainer_ranks import rank_threads

    replicas = config.rollout.replicas * replica_threads(config) if config.rollout.replicas > 1 else 0
    optim = config.train.optim
    ranks = optim.world_size * rank_threads(optim) if with_trainer and optim.world_size > 1 else 0
    return max(os.cpu_count() or 1, replicas + ranks)


def start_local_ray(config: SpecActorConfig, with_trainer: bool = True) -> None:
    """Start the local Ray instance the run's replicas and ranks share (`local_ray_cpus`), unless they join a
    cluster (rollout.ray_address / train.optim.ray_address), use none, or Ray is up in this process already."""
    optim = config.train.optim
    uses_ray = config.rollout.replicas > 1 or with_trainer and optim.world_size > 1
    if uses_ray and config.rollout.ray_address is None and optim.ray_address is None:
        from specactor_engine.decoupled.ray_transport import ensure_ray

        ensure_ray(None, num_cpus=local_ray_cpus(config, with_trainer))


def policy_source(run: RunDir, config: SpecActorConfig, version: int) -> Path:
    """The model directory of policy v<version>: its checkpoint, or the initial model for v0."""
    from specactor_engine.model.registry import resolve_model

    if version:
        return run.checkpoint(version)
    return resolve_model(config.model.target, dtype=config.model.dtype, cache_dir=config.model.cache_dir)


def build_engine(config: SpecActorConfig, source: Path, version: int) -> RolloutEngine:
    """The rollout engine on the weights at `source` (plain decoding when train.speculation is off): one
    in-process engine, or a pool of rollout.replicas replicas."""
    from specactor_engine.replicas import build_rollout_engine

    rollout = config.rollout if config.train.speculation else config.rollout.model_copy(update={"mode": "ar"})
    model = config.model.model_copy(update={"target": str(source)})
    return build_rollout_engine(config.model_copy(update={"model": model, "rollout": rollout}), version)


def build_trainer(config: SpecActorConfig, source: Path, version: int = 0,
                  reference: Path | None = None) -> PolicyTrainer | RankedTrainer:
    """The policy trainer configured by train.optim (float32 master weights; `world_size` > 1: Ray actors,
    tasks/trainer_ranks.py) on the model at `source`; for
    v<version> > 0, `source` is its checkpoint and the trainer is restored to it exactly (weights, optimizer
    and engine state, RNG streams). `reference`: the KL term's frozen policy (default: the model at `source`)."""
    from transformers import AutoModelForCausalLM

    from tasks.trainer import PolicyTrainer
    from tasks.trainer_ranks import RankedTrainer

    optim, temperature, seed = config.train.optim, config.sampling.temperature, config.sampling.seed
    if optim.world_size > 1:  # Ray actors, one rank each; the same interface
        trainer = RankedTrainer(source, optim, temperature=temperature, seed=seed, reference=reference)
    else:
        model = AutoModelForCausalLM.from_pretrained(source, dtype="float32")
        frozen = AutoModelForCausalLM.from_pretrained(reference, dtype="float32") if reference is not None else None
        trainer = PolicyTrainer(model, optim, temperature=temperature, seed=seed, reference=frozen)
    if version:
        trainer.load_checkpoint(source)
        if trainer.version not in (0, version):  # 0: a checkpoint without training state does not say
            raise RuntimeError(f"{source} holds the training state of v{trainer.version}, not v{version}")
        trainer.version = version
    return trainer


def run_config(run_root: str) -> SpecActorConfig:
    """The resolved config the flow wrote into the run directory."""
    host = get_host(run_root)
    return host.config if host is not None else load_config(Path(run_root) / "config.yaml")


def host_for(run_root: str) -> RunHost:
    """The run's host in this process, built from the last published checkpoint if there is none."""
    host = get_host(run_root)
    return host if host is not None else build_host(run_root, run_config(run_root))


def push_policy(host: RunHost, version: int) -> dict[str, Any]:
    """Load the trainer's weights into the engine (every replica) as policy v<version>; check that each holds
    the trainer's weights bit for bit; return the digest and, with replicas, how many hold it."""
    from specactor_engine.model.weights import weights_digest

    weights = list(host.trainer.state_dict_for_sync())  # exported once (ranks: one transfer); the digest holds
    host.engine.update_weights(weights, version=version)  # every tensor at once anyway
    # the engine holds them in its own dtype (a bf16 engine beside fp32 master weights): the trainer's weights
    # rounded as the load rounds them, bit for bit
    held_dtypes = {name: p.dtype for name, p in host.engine.runner.model.named_parameters(remove_duplicate=False)}
    expected = weights_digest((name, t.to(held_dtypes.get(name, t.dtype))) for name, t in weights)
    held = engine_digests(host.engine)
    if any(digest != expected for digest in held):
        raise RuntimeError(f"weights in the engine differ from the trainer's after sync to v{version} "
                           f"({sum(d != expected for d in held)} of {len(held)} copies)")
    metrics: dict[str, Any] = {"sync/policy_digest": expected[:16]}
    if len(held) > 1:  # the driver's copy, then each replica's answer to the load
        metrics |= {"sync/replicas": len(held) - 1, "sync/replica_digests_equal": 1.0}
    return metrics


def engine_digests(engine: RolloutEngine) -> list[str]:
    """The target's digest in the engine; a pool: the driver's, then each replica's (as answered at the load)."""
    from specactor_engine.model.weights import weights_digest
    from specactor_engine.replicas.pool import ReplicaPool

    held = [weights_digest(engine.runner.model.named_parameters())]
    return held + list(engine.digests) if isinstance(engine, ReplicaPool) else held


def restore_engine(host: RunHost, run: RunDir, version: int) -> None:
    """Reload the engine's target and drafters at policy v<version> (v0: the initial models)."""
    from safetensors.torch import load_file

    weights = load_file(Path(policy_source(run, host.config, version)) / WEIGHTS_FILE)
    host.engine.update_weights(weights.items(), version=version)
    if version:
        load_drafters(host, run.checkpoint(version), version)
    else:
        load_initial_drafters(host)
