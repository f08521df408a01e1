"""Simulation substrate for `rlctl simulate`: the real scheduler, driven by simulated engines
whose durations come from a cost model, under a virtual-time event loop.

    loop.py       VirtualTimeLoop: asyncio whose clock jumps to the next timer
    cost.py       the cost model: decode, prefill, training and broadcast times per GPU kind
    server.py     SimServer: continuous batching, jumping from event to event
    engines.py    SimRollout, SimTrainer: the scheduler's Rollout and Trainer over the cost model
    calibrate.py  fit the cost model to a measured run
    run.py        simulate_run: the composition root
"""

from rlctl.costs.model import HARDWARE, CostModel, Hardware, ModelShape
from rlctl.sim.loop import SimulationDeadlock, VirtualClock, VirtualTimeLoop, run_virtual
from rlctl.sim.server import SimServer

__all__ = [
    "HARDWARE",
    "CostModel",
    "Hardware",
    "ModelShape",
    "SimServer",
    "SimulationDeadlock",
    "VirtualClock",
    "VirtualTimeLoop",
    "run_virtual",
]
