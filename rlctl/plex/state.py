"""What the pool's scheduler moves and asks: a model on its devices and its memory states."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol


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
    move_s: dict[tuple[State, State], float] = field(default_factory=dict)
    """(from, to) -> seconds its last such move took: what moving it again is expected to cost."""

    def resident(self, state: State | None = None) -> float:
        state = state or self.state
        return {State.ACTIVE: self.weights + self.working, State.WEIGHTS: self.weights, State.OFFLOADED: 0.0}[state]


@dataclass
class JobState:
    name: str
    share: float = 1.0
    used: float = 0.0
    """Device-seconds: its slices on every device, plus its models' moves."""
    moved: float = 0.0
    """The part of `used` spent moving its models."""
    v0: float = 0.0
    """Its virtual time when it joined: the least of the others' then (start-time fair queueing),
    so a job that joins late is not owed all the device time the others used before it came."""
    holds: dict[int, int] = field(default_factory=dict)
    """device -> calls of this job running there."""
    since: dict[int, float] = field(default_factory=dict)
    """device -> when this job's current slice there began."""
    yielding: set[int] = field(default_factory=set)
    """Devices where its new generates wait: its slice is over and another job waits."""
    left: dict[int, float] = field(default_factory=dict)
    """device -> when its last slice there ended, until its next call there comes."""
    think: dict[int, float] = field(default_factory=dict)
    """device -> how long it takes to come back to the device after a slice there (a moving
    average): the controller's own work between two calls, or its calls on other devices."""

    @property
    def vtime(self) -> float:
        """Device time per unit of share, from when it joined: the least is served first."""
        return self.v0 + self.used / self.share

    def came_back(self, device: int, now: float) -> None:
        if device in self.left and device not in self.holds:
            gap = now - self.left.pop(device)
            self.think[device] = gap if device not in self.think else 0.7 * self.think[device] + 0.3 * gap


KIND_RANK = {"sync": 0, "train": 1, "checkpoint": 1, "generate": 2}
"""Among one job's waiting calls: a weight sync first (it may hold the job's paused generates),
then training, then generates (which keep coming; training waits on none of them)."""


@dataclass(eq=False)
class Waiting:
    """Waiting calls of one job that need the same models: granted together."""

    job: str
    needs: tuple[tuple[Model, State], ...]
    kind: str
    devices: frozenset[int]
    order: int
    futures: deque = field(default_factory=deque)

    @property
    def models(self) -> tuple[Model, ...]:
        return tuple(m for m, _ in self.needs)


RANK = {State.ACTIVE: 0, State.WEIGHTS: 1, State.OFFLOADED: 2}
"""Lower is more resident: a model in state x serves a call that needs y when rank x <= rank y."""


class Mover(Protocol):
    async def __call__(self, model: Model, to: State) -> dict | None:
        """Move the model to state `to` (release or resume its memory); what it returns (the
        engine's own bytes and seconds, say) goes into the move's event."""


class Clock(Protocol):
    def now(self) -> float: ...


class MonotonicClock:
    """A live pool's clock (the simulator passes its virtual one)."""

    def now(self) -> float:
        return time.monotonic()


Emit = Callable[..., None]
"""emit(kind, t, **fields): the pool's event sink."""


def snapshot(sched) -> dict[str, Any]:
    """A SliceScheduler's devices (holder, memory, busy time), jobs (device time used, of which
    moving models) and models, now: for `rlctl pool status` and a run's usage."""
    now = sched.clock.now()
    return {
        "devices": {str(d): {"holder": sched.holder[d], "capacity": sched.capacity[d], "resident": sched.resident(d),
                             "busy_s": sched.busy_s[d] + sum(now - j.since[d] for j in sched.jobs.values() if d in j.since)}
                    for d in sched.capacity},
        "jobs": {j.name: {"share": j.share, "used_s": j.used + sum(now - s for s in j.since.values()),
                          "moved_s": j.moved, "holds": sorted(j.holds)} for j in sched.jobs.values()},
        "models": [{"job": m.job, "name": m.name, "devices": list(m.devices), "state": m.state.value}
                   for m in sched.models.values()],
    }


def waiting(sched) -> list[dict[str, Any]]:
    """The calls waiting for a slice, and the jobs holding the devices they wait for: who blocks
    whom, for `rlctl pool status`."""
    return [{"job": w.job, "kind": w.kind, "devices": sorted(w.devices),
             "blocked_by": sorted({sched.holder[d] for d in w.devices if sched.holder[d] not in (None, w.job)})}
            for w in sched._waiting.values()]
