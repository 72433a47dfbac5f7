"""SpecActor rollout engine: batched, lossless speculative decoding for RL rollouts.

The library has no Prefect, DeepSpeed or W&B imports. Entry points:
`specactor_engine.engine.Engine` (Python API), `specactor.cli` (the `specactor` command).
"""

__version__ = "0.1.0"
