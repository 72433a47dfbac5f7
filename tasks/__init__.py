"""Pipeline tasks: load prompts, run rollouts, score rewards, update the policy, sync weights.

Plain functions for now; they become Prefect tasks with the pipeline issue.
"""
