"""Prefect flows: `post_training` (per step: rollout -> rewards -> policy update -> weight sync ->
publish; resumable) and `evaluate` (greedy rollouts of the held-out prompts at the published policy).

Each flow is a plain function calling the tasks of tasks/ in order; see docs/architecture.md.
"""
