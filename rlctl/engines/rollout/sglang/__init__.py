"""rollout.engine=sglang: everything rlctl knows about SGLang, read from SGLang's own source.

adapter.py (SGLangAdapter: what the rest of rlctl asks of the engine) and launch.py (the command,
its options file and the versions spoken). SGLang's HTTP API is rlctl's base rollout protocol:
rlctl/engines/rollout/client.py speaks it, and rlctl/engines/weightsync/ sends weights the way its
servers receive them; the built-in server speaks it too.
"""
