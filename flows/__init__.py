"""Prefect flows (post-training, benchmark, evaluation): placeholder until the pipeline issue."""
