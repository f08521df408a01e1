"""Multi-turn rollouts with tools: what a model's turn calls (calls.py), the environments that
answer (environments.py; the built-in calculator.py and sandbox.py, by name in builtin.py), how
their answers become tokens (turns.py), and how calls run off the event loop (tools.py).
rlctl/pipelines/episode.py runs a trajectory's turns through the pipeline."""
