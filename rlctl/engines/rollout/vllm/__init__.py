"""rollout.engine=vllm: everything rlctl knows about vLLM, read from vLLM's own source.

adapter.py (VllmAdapter: what the rest of rlctl asks of the engine), launch.py (the command,
environment and releases), client.py (its HTTP API), auth.py (the token middleware vLLM loads),
group.py and sender.py (vLLM's NCCL weight-transfer group, from the trainer's side).
"""
