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
import contextvars
import heapq
import itertools
import selectors
from collections.abc import Callable, Coroutine
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
    the loop is not stopping, it is set to the due time of the earliest live timer, and every timer
    due by then becomes ready. Timers therefore fire in the order of their due times, those due at
    the same time in the order they were scheduled.

    A cluster-scale simulation runs a few callbacks per request and a timer per finishing request
    (hundreds of thousands a step), so the loop's own bookkeeping is most of its cost. `call_at`,
    `call_soon` and `_run_once` are therefore lean versions of the base class's: timers live in a
    heap of (due time, sequence, handle) tuples that compare in C (the base class's TimerHandles
    compare in Python), and an iteration polls no selector (a simulation does no I/O). This relies
    on private attributes of `asyncio.BaseEventLoop` (`_ready`, `_stopping`,
    `_timer_handle_cancelled`), as in CPython 3.11 and 3.12.
    """

    def __init__(self) -> None:
        super().__init__(_NoIOSelector())
        self._virtual_now = 0.0
        self._timers: list[tuple[float, int, asyncio.TimerHandle]] = []
        self._timer_seq = itertools.count()

    def time(self) -> float:
        return self._virtual_now

    def call_at(self, when: float, callback: Callable[..., object], *args: Any,
                context: contextvars.Context | None = None) -> asyncio.TimerHandle:
        if when is None:
            raise TypeError("when cannot be None")
        self._check_closed()
        timer = asyncio.TimerHandle(when, callback, args, self, context)
        heapq.heappush(self._timers, (when, next(self._timer_seq), timer))
        timer._scheduled = True  # type: ignore[attr-defined]
        return timer

    def call_soon(self, callback: Callable[..., object], *args: Any,
                  context: contextvars.Context | None = None) -> asyncio.Handle:
        self._check_closed()
        handle = asyncio.Handle(callback, args, self, context)
        self._ready.append(handle)  # type: ignore[attr-defined]
        return handle

    def _timer_handle_cancelled(self, handle: asyncio.TimerHandle) -> None:
        pass  # a cancelled timer stays in the heap and is skipped when it comes up

    def _run_once(self) -> None:
        ready = self._ready  # type: ignore[attr-defined]
        timers = self._timers
        if not ready and not self._stopping:  # type: ignore[attr-defined]
            # Drop cancelled timers from the head, so that the clock never jumps to the due time
            # of a timer that will not run.
            while timers and timers[0][2]._cancelled:  # type: ignore[attr-defined]
                heapq.heappop(timers)[2]._scheduled = False  # type: ignore[attr-defined]
            if not timers:
                raise SimulationDeadlock(
                    f"virtual time {self._virtual_now:.6g}: every task is waiting and no timer is scheduled")
            if timers[0][0] > self._virtual_now:
                self._virtual_now = timers[0][0]
        now = self._virtual_now
        while timers and timers[0][0] <= now:
            handle = heapq.heappop(timers)[2]
            handle._scheduled = False  # type: ignore[attr-defined]
            ready.append(handle)
        # Run what was ready when the iteration began; what those callbacks schedule runs next time.
        for _ in range(len(ready)):
            handle = ready.popleft()
            if not handle._cancelled:
                handle._run()

    def close(self) -> None:
        self._timers.clear()
        super().close()


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
