"""A virtual-time asyncio event loop: simulated durations cost no wall time.

`rlctl simulate` runs the real scheduler code (rlctl.pipelines) against simulated engines whose
work is modelled as `asyncio.sleep`s / timers of the durations the cost model predicts. On an
ordinary loop a 1024-GPU step would then take as long as the real step. `VirtualTimeLoop` keeps
the asyncio semantics (tasks, futures, gather, Condition, Queue, wait_for all unchanged) but reads
time from a virtual clock, and whenever no callback is ready it jumps that clock straight to the
earliest scheduled timer instead of waiting for it. Only the Python work the simulation itself
does costs wall time.

Everything happens in one thread; the simulation must not depend on I/O or other threads to make
progress (`run_in_executor`, sockets), because with virtual time there is no meaningful "wait for
the outside world". If every task is waiting and no timer is scheduled, nothing can ever happen
again: the loop raises `SimulationDeadlock` instead of hanging.
"""

from __future__ import annotations

import asyncio
import heapq
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class SimulationDeadlock(RuntimeError):
    """Every task waits on something that no scheduled timer or ready callback will ever cause."""


class _NoIOSelector(selectors.SelectSelector):
    """A simulation does no I/O: polling costs a system call per loop iteration for nothing."""

    def select(self, timeout: float | None = None) -> list:
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop whose `time()` is a virtual clock starting at 0.

    The clock only moves in `_run_once`, the loop's iteration step: when no callback is ready and
    the loop is not stopping, it is set to the due time of the earliest live timer, so the base
    implementation then polls the selector with a zero timeout and runs that timer at once. Timers
    therefore fire in exactly the order and at exactly the virtual times they were scheduled for.
    This relies on private attributes of `asyncio.BaseEventLoop` (`_ready`, `_scheduled`,
    `_stopping`, `_timer_cancelled_count`), as in CPython 3.11.
    """

    def __init__(self) -> None:
        super().__init__(_NoIOSelector())
        self._virtual_now = 0.0

    def time(self) -> float:
        return self._virtual_now

    def _run_once(self) -> None:
        if not self._ready and not self._stopping:
            scheduled = self._scheduled
            # Drop cancelled timers from the head, as the base class would, so that the clock
            # never jumps to the due time of a timer that will not run.
            while scheduled and scheduled[0]._cancelled:
                self._timer_cancelled_count -= 1
                heapq.heappop(scheduled)._scheduled = False
            if not scheduled:
                raise SimulationDeadlock(
                    f"virtual time {self._virtual_now:.6g}: every task is waiting and no timer is scheduled")
            self._virtual_now = max(self._virtual_now, scheduled[0]._when)
        super()._run_once()


def run_virtual(coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` to completion on a fresh `VirtualTimeLoop` and return its result (the virtual
    counterpart of `asyncio.run`). Tasks still pending at the end are cancelled and awaited, async
    generators are finalized, and the loop is closed."""
    loop = VirtualTimeLoop()
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(coro)
    finally:
        try:
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()


class VirtualClock:
    """The `Clock` of rlctl.pipelines.interfaces for simulations: the running loop's (virtual) time."""

    def now(self) -> float:
        return asyncio.get_running_loop().time()
