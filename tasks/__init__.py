"""The post-training steps and what they are built from.

pipeline      the Prefect tasks of one step: load_prompts, run_rollout, score_rewards, update_policy, sync_weights
host          building the process-local host (rollout engine + policy trainer) at a policy version
runtime       the process-local host registry (RunHost, keyed by run directory) and the run logger
drafter_store drafter weights across policy versions: refresh, save beside a checkpoint, load, restore
metrics       what a step reports: rollout, per-drafter, speculation and reward metrics
alarms        the drafter acceptance-collapse alarm
run_dir       the run directory's layout, JSONL records, publish and resume
data          prompt datasets (reasoning-gym or local files) from the run config's train.data
prompts       reasoning-gym items and the chat prompt built from them
rewards       the reward registry and the combined reward
grpo          GRPO advantage estimators and loss
trainer       the DeepSpeed policy trainer, configured by train.optim
tracking      W&B logging of a run

The flows that call these tasks are in flows/; see docs/architecture.md.
"""
