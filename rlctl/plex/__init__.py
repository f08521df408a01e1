"""A pool that several runs share: placement once, then function-level time slicing of each
device among their calls (scheduler.py), the runs' engines wrapped to ask it (gates.py)."""
