"""Watchdogs for the roles that rollout.stall_timeout_s does not cover: the trainer and the
controller. No stall is silent: each ends in a stated failure within run.stall_timeout_s.

- The trainer: every call the controller makes to it has a deadline, `CallTimer.timeout(kind)`:
  run.stall_timeout_s, or 10 times the slowest call of that kind so far when that is longer
  (a step that grows slower as responses grow longer is not a hang). A call past its deadline
  fails the run, naming the call: a frozen trainer (SIGSTOP, a hung collective) answers nothing.
- The controller: its event loop touches the run's `heartbeat` file every HEARTBEAT_S; the
  supervisor (rlctl/launchers/local.py) fails the run when the file is older than
  run.stall_timeout_s, and kills the controller: a frozen controller would wait forever.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

HEARTBEAT_FILE = "heartbeat"
HEARTBEAT_S = 2.0
SLOWEST_FACTOR = 10.0


class CallTimer:
    """The deadline of each kind of call, from the slowest one seen so far."""

    def __init__(self, floor_s: float, factor: float = SLOWEST_FACTOR) -> None:
        self.floor_s, self.factor = floor_s, factor
        self.slowest: dict[str, float] = {}

    def timeout(self, kind: str) -> float:
        return max(self.floor_s, self.factor * self.slowest.get(kind, 0.0))

    def observe(self, kind: str, seconds: float) -> None:
        self.slowest[kind] = max(seconds, self.slowest.get(kind, 0.0))

    def explain(self, kind: str) -> str:
        """Why the deadline of `kind` is what it is, for the error that says it passed."""
        if kind in self.slowest and self.factor * self.slowest[kind] > self.floor_s:
            return f"{self.factor:g}x the slowest {kind} so far ({self.slowest[kind]:.1f} s)"
        return "run.stall_timeout_s"


async def beat(path: Path, every_s: float = HEARTBEAT_S) -> None:
    """Touch `path` every `every_s` for as long as the loop runs (cancel to stop)."""
    path.touch(mode=0o600)
    while True:
        os.utime(path)
        await asyncio.sleep(every_s)


def heartbeat_age(path: Path, now: float | None = None) -> float | None:
    """Seconds since `path` was last touched; None while it does not exist (not started yet)."""
    try:
        mtime = path.stat().st_mtime
    except FileNotFoundError:
        return None
    return (time.time() if now is None else now) - mtime
