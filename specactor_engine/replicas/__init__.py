"""Rollout replicas: N engines in Ray actors behind one `Engine`-like pool (docs/distributed.md).

plan.py: which groups go out together; merge.py: one call's stats from the replicas'; actor.py: a replica's
actor and the drafter payload it loads; pool.py: `ReplicaPool`. `build_rollout_engine` picks the in-process
`Engine` (rollout.replicas 1) or the pool.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Union

if TYPE_CHECKING:
    from specactor_engine.config import SpecActorConfig
    from specactor_engine.engine import Engine
    from specactor_engine.replicas.pool import ReplicaPool

RolloutEngine = Union["Engine", "ReplicaPool"]


def build_rollout_engine(config: SpecActorConfig, policy_version: int = 0) -> RolloutEngine:
    """The in-process engine for rollout.replicas 1, else a pool of that many replicas."""
    if config.rollout.replicas > 1:
        from specactor_engine.replicas.pool import ReplicaPool

        return ReplicaPool.from_config(config, policy_version)
    from specactor_engine.engine import Engine

    engine = Engine.from_config(config)
    engine.policy_version = policy_version
    return engine
