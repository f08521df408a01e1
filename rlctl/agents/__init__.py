"""Multi-turn rollouts with tools: what a model's turn calls (calls.py), the environments that
answer (environments.py, the built-in calculator.py and sandbox.py), how their answers become
tokens (turns.py), how calls run off the event loop (tools.py), and one sample's trajectory
(trajectory.py). rlctl/pipelines/episode.py runs a trajectory's turns through the pipeline."""
