"""The controller process, which drives a run: controller.py runs the recipe's pipeline between
the rollout servers and the trainer, and failover.py keeps it going when a server is lost."""
