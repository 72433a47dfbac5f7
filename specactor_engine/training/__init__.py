"""Drafter training: distilling draft models from the target's own rollouts.

Not on the decode path: the engine never imports this package. `distill` holds the losses and the
distiller, `offline` the trainer on recorded rollouts, `on_policy` the drafter's own samples scored by
the target, `scorer` the acceptance a drafter would get.
"""
