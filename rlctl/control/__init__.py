"""The controller process, which drives a run: controller.py runs the recipe's pipeline between
the rollout servers and the trainer, failover.py keeps it going when a server is lost,
checkpoints.py resumes, checkpoints and saves the final policy, samples.py writes samples.jsonl,
evaluation.py sets up the held-out evaluations, and colocate.py has the servers and the trainer
take turns on the same devices (colocate.enabled)."""
