"""rlctl: an experiment orchestrator for RL post-training of LLMs with verifiable rewards."""

__version__ = "0.1.0"
