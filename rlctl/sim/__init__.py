"""Simulation substrate for `rlctl simulate`: the real scheduler, driven by simulated engines
whose durations come from a cost model, under a virtual-time event loop (see DESIGN.md,
"Simulation")."""

from rlctl.sim.cost import HARDWARE, CostModel, Hardware, ModelShape
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
