"""Drafter training: distilling draft models from the target's own rollouts.

Not on the decode path: the engine never imports this package. `distill` holds the losses and the
distiller, `teacher` the target's top-k soft targets, `samples` the target's samples (rollout records
or rolled-out prompts), `offline` the resumable trainer on them, `on_policy` the drafter's own samples
scored by the target, `job` a whole `specactor drafter distill` run, `report` how a run tells its caller
what it is doing, `scorer` the acceptance a drafter would get.
"""
