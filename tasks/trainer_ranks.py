"""The policy update on several DeepSpeed ranks: one Ray actor per rank, behind `PolicyTrainer`'s interface.

`RankedTrainer(source, cfg, ...)` starts `cfg.world_size` actors (on a local Ray instance unless
`cfg.ray_address`; `ensure_ray`), each building a `PolicyTrainer` as rank r of one process group (gloo on
CPU, NCCL on GPU, one GPU per actor; rank 0's node is the rendezvous). `step` deals the batch's rows to the
ranks, longest first and round robin, so each rank pads alike; `PolicyTrainer.backward` takes the mean over
every rank's tokens and DeepSpeed all-reduces the gradients, so the update is the one-rank update of the
whole batch. Checkpoints are written and read by every rank into one directory (a shared filesystem across
nodes). A rank that fails ends every rank (the others would wait in a collective for it) and raises
`TrainerRankError`: the step is not saved, so the run resumes before it.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from specactor_engine.config import OptimConfig
from tasks.trainer import RolloutBatch

START_TIMEOUT_S = 600.0  # actors that cannot be placed (too few CPUs or GPUs in the cluster) fail the start


class TrainerRankError(RuntimeError):
    """A training rank failed or died; every rank has been stopped."""


class TrainerRank:
    """One rank: the body of a Ray actor holding a `PolicyTrainer`."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.trainer: Any = None

    def address(self) -> tuple[str, int]:
        """This node's address and a free port on it (rank 0's: the process group's rendezvous)."""
        import ray

        with socket.socket() as sock:
            sock.bind(("", 0))
            return ray.util.get_node_ip_address(), sock.getsockname()[1]

    def start(self, master: tuple[str, int], source: str, cfg: OptimConfig, temperature: float, seed: int,
              reference: str | None, threads: int) -> None:
        """Join the process group and build the trainer on the model at `source`."""
        from transformers import AutoModelForCausalLM

        from tasks.trainer import PolicyTrainer

        os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world_size), LOCAL_RANK="0",
                          MASTER_ADDR=master[0], MASTER_PORT=str(master[1]))  # Ray shows each actor its own GPU
        torch.set_num_threads(threads)
        model = AutoModelForCausalLM.from_pretrained(source, dtype="float32")
        frozen = AutoModelForCausalLM.from_pretrained(reference, dtype="float32") if reference else None
        self.trainer = PolicyTrainer(model, cfg, temperature=temperature, seed=seed, reference=frozen)

    def step(self, batch: RolloutBatch) -> dict[str, float]:
        return self.trainer.step(batch)

    def logprobs(self, batch: RolloutBatch) -> list[list[float]]:
        return self.trainer.logprobs(batch)

    def weights(self) -> list[tuple[str, torch.Tensor]] | None:
        """The full weights from rank 0 (every rank takes part: bf16 master weights are gathered)."""
        pairs = list(self.trainer.state_dict_for_sync())
        return pairs if self.rank == 0 else None

    def save_checkpoint(self, directory: str) -> None:
        self.trainer.save_checkpoint(directory)

    def load_checkpoint(self, directory: str) -> int:
        self.trainer.load_checkpoint(directory)
        return self.trainer.version

    def set_version(self, version: int) -> None:
        self.trainer.version = version

    def optimizer_state(self) -> dict[str, Any]:
        """This rank's optimizer state dict (its ZeRO partition), for tests."""
        return self.trainer.engine.optimizer.state_dict()


class RankedTrainer:
    """`PolicyTrainer`'s interface (step, logprobs, state_dict_for_sync, save_checkpoint, load_checkpoint,
    version) over `cfg.world_size` Ray actors, one DeepSpeed rank each, on the model at `source`."""

    def __init__(self, source: str | Path, cfg: OptimConfig, *, temperature: float, seed: int,
                 reference: str | Path | None = None) -> None:
        import ray

        from specactor_engine.decoupled.ray_transport import ensure_ray
        from tasks.trainer import resolve_backend

        ensure_ray(cfg.ray_address)
        self.cfg, self._version = cfg, 0
        threads = rank_threads(cfg)
        gpus = 1 if resolve_backend(cfg.backend) == "nccl" else 0
        actor = ray.remote(TrainerRank).options(num_cpus=threads, num_gpus=gpus, max_restarts=0)
        self._ranks = [actor.remote(rank, cfg.world_size) for rank in range(cfg.world_size)]
        master = self._on_rank0("address", timeout_s=START_TIMEOUT_S)
        self._on_all("start", master, str(source), cfg, temperature, seed, reference and str(reference), threads,
                     timeout_s=START_TIMEOUT_S)

    def step(self, batch: RolloutBatch) -> dict[str, float]:
        """One optimizer update on `batch`, its rows dealt to the ranks; the whole batch's metrics."""
        if len(batch) < self.cfg.world_size:
            raise ValueError(f"a batch of {len(batch)} rows cannot feed {self.cfg.world_size} training ranks")
        metrics = self._on_all("step", per_rank=[batch.select(rows) for rows in deal_rows(batch, len(self._ranks))])
        self._version += 1
        return metrics[0]

    def logprobs(self, batch: RolloutBatch) -> list[list[float]]:
        """Logprobs of every output token under the current weights (rank 0 holds them whole under ZeRO 1-2)."""
        return self._on_rank0("logprobs", batch)

    def state_dict_for_sync(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self._on_all("weights")[0]

    def save_checkpoint(self, directory: str | Path) -> Path:
        self._on_all("save_checkpoint", str(directory))
        return Path(directory)

    def load_checkpoint(self, directory: str | Path) -> None:
        self._version = self._on_all("load_checkpoint", str(directory))[0]

    @property
    def version(self) -> int:
        """Updates the weights hold (`PolicyTrainer.version`)."""
        return self._version

    @version.setter
    def version(self, value: int) -> None:
        self._on_all("set_version", value)  # the ranks save it with their checkpoints
        self._version = value

    def close(self) -> None:
        """Stop every rank."""
        import ray

        for rank in self._ranks:
            ray.kill(rank, no_restart=True)
        self._ranks = []

    def _on_rank0(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        return self._wait([getattr(self._ranks[0], method).remote(*args)], method, timeout_s)[0]

    def _on_all(self, method: str, *args: Any, per_rank: list[Any] | None = None,
                timeout_s: float | None = None) -> list[Any]:
        """Call `method` on every rank (with `per_rank[r]` as the argument, if given); the results by rank."""
        calls = [getattr(rank, method).remote(*((per_rank[r],) if per_rank else args))
                 for r, rank in enumerate(self._ranks)]
        return self._wait(calls, method, timeout_s)

    def _wait(self, calls: list[Any], method: str, timeout_s: float | None) -> list[Any]:
        """The calls' results; on the first failure (or the timeout) every rank is stopped and the error raised."""
        import ray

        if not self._ranks:
            raise TrainerRankError("the training ranks were stopped after a failure; build a new trainer")
        pending = list(calls)
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=timeout_s)
            try:
                if not done:
                    raise TimeoutError(f"no result in {timeout_s} s (too few CPUs/GPUs for the ranks?)")
                ray.get(done[0])
            except Exception as exc:
                self.close()
                raise TrainerRankError(f"a training rank failed in {method}; every rank is stopped") from exc
        return ray.get(calls)


def rank_threads(cfg: OptimConfig) -> int:
    """torch threads (and Ray CPUs) of each rank: train.optim.threads_per_rank, else the cores divided among them."""
    return cfg.threads_per_rank or max(1, (os.cpu_count() or 1) // cfg.world_size)


def deal_rows(batch: RolloutBatch, ranks: int) -> list[list[int]]:
    """Row indices of each rank: rows by length, longest first, dealt round robin (each rank in batch order)."""
    lengths = [len(p) + len(o) for p, o in zip(batch.prompt_token_ids, batch.output_token_ids)]
    order = sorted(range(len(batch)), key=lambda i: -lengths[i])
    return [sorted(order[rank::ranks]) for rank in range(ranks)]
