"""What-if simulator: a recorded benchmark run replayed under a cost model (`specactor simulate`).

With position-keyed sampling the tokens a rollout emits do not depend on the batch, the hardware or
the drafts, and whether a draft token is accepted is a pure function of the committed output and the
drafter's proposal. So a run's outputs, plus one pass of every drafter over them, say how many tokens
each drafter would have had accepted at every row and position (`facts.py`). The replay
(`replay.py`) then runs the engine's own decode loop, scheduler and policies (verify length,
Fastest-of-N, shadows, combination, continuous batching) against those facts, on a clock that
advances by a cost model's seconds for each forward and draft (`costs.py`): the engine's CPU profile,
a GPU table from `make gpu-check`, or a roofline model of a GPU. `validate.py` compares predicted and
measured makespans; `project.py` projects speedups across per-worker batch sizes.

    facts.py     acceptance facts (and drafting costs) from a run directory's outputs
    costs.py     cost models: verify (rows, width, context), drafting, prefill, host work per round
    shapes.py    a model's roofline shape (weights, FLOPs and KV bytes per token)
    replay.py    the engine's loop on a simulated clock, with a target and drafters that replay facts
    report.py    validation and projection tables
    cli.py       `specactor simulate`
"""
