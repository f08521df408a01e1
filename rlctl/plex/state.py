"""What the pool's scheduler moves and asks: a model on its devices and its memory states."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol


class State(StrEnum):
    ACTIVE = "active"
    WEIGHTS = "weights"
    OFFLOADED = "offloaded"


@dataclass(eq=False)
class Model:
    """One job's model (a rollout server, or a trainer) on its devices."""

    job: str
    name: str
    """"rollout-0", "trainer": the job's own name for it."""
    devices: tuple[int, ...]
    weights: float
    """Bytes of weights on each of its devices."""
    working: float
    """Bytes besides the weights on each device when active (KV cache; gradients, optimizer)."""
    state: State = State.ACTIVE
    target: State = State.ACTIVE
    """The state it is in, or is moving to."""
    last_used: float = 0.0
    users: int = 0
    """Granted calls that need it: it may not move while there are any."""
    moving: asyncio.Future | None = None

    def resident(self, state: State | None = None) -> float:
        state = state or self.state
        return {State.ACTIVE: self.weights + self.working, State.WEIGHTS: self.weights, State.OFFLOADED: 0.0}[state]


RANK = {State.ACTIVE: 0, State.WEIGHTS: 1, State.OFFLOADED: 2}
"""Lower is more resident: a model in state x serves a call that needs y when rank x <= rank y."""


class Mover(Protocol):
    async def __call__(self, model: Model, to: State) -> None:
        """Move the model to state `to` (release or resume its memory)."""


class Clock(Protocol):
    def now(self) -> float: ...


Emit = Callable[..., None]
"""emit(kind, t, **fields): the pool's event sink."""
