"""The cost model: what a step of a recipe costs on given hardware, in seconds and bytes.

`rlctl simulate` (rlctl/sim/) runs its simulated engines on it and `rlctl plan` (rlctl/planner/)
predicts placements from it, so the two differ only in how they schedule. model.py (hardware,
model shape, the time of a prefill, a decode step and a training step), shape.py (the recipe's
model as the cost model sees it), lengths.py (the response-length distribution), memory.py and
activations.py (bytes per GPU of a server and a trainer rank), recipe.py (a recipe's cost model).
"""
