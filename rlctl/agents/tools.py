"""Running tool calls off the controller's event loop, a bounded number at a time.

An environment's step is the user's code or a sandboxed process: it may block for seconds. Each
runs in one of `workers` threads, so the event loop that drives every request of the run never
waits on it, and no more than `workers` run at once (the others queue). A step that runs past
`timeout_s` is answered with an error at once; its thread cannot be stopped (a Python thread
cannot be killed: the python tool's sandbox is a process, and is killed at its own limit) and
stays counted as running. When every worker holds a step past its timeout, no call could ever
start again: the run ends with a RunError saying so, instead of waiting without end. The workers
are daemon threads, so a step that never returns does not hold up the controller's exit.
"""

from __future__ import annotations

import asyncio
import threading
import time
import queue
from concurrent.futures import Future
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any

from rlctl.agents.calls import ToolCall
from rlctl.errors import RunError


@dataclass(frozen=True)
class ToolResult:
    """What a tool call returned: the text the model reads, and how the call went."""

    text: str
    ok: bool
    seconds: float
    """From when the step started running (not its wait for a worker) to its answer."""
    queued: float = 0.0
    """Seconds it waited for a free worker."""
    timed_out: bool = False


class ToolRunner:
    """env.step(name, arguments) in worker threads, each bounded by timeout_s."""

    def __init__(self, workers: int, timeout_s: float, max_output_chars: int) -> None:
        self.workers = workers
        self.timeout_s = timeout_s
        self.max_output_chars = max_output_chars
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._running: dict[int, float] = {}
        """Steps running now: id -> when they started (time.monotonic)."""
        self._ids = 0

    def overdue(self) -> int:
        """Steps still running past their timeout: workers no call can use."""
        now = time.monotonic()
        with self._lock:
            return sum(now - t > self.timeout_s for t in self._running.values())

    async def __call__(self, env: Any, call: ToolCall) -> ToolResult:
        if call.error is not None:
            return ToolResult(f"error: {call.error}", ok=False, seconds=0.0)
        loop = asyncio.get_running_loop()
        started = asyncio.Event()
        self._ids += 1
        key = self._ids

        def work() -> tuple[bool, str]:
            with self._lock:
                self._running[key] = time.monotonic()
            loop.call_soon_threadsafe(started.set)
            try:
                return True, str(env.step(call.name, dict(call.arguments)))
            except BaseException as e:  # noqa: BLE001 - the environment's code: any failure is the call's error
                return False, f"error: {one_line(e)}"
            finally:
                with self._lock:
                    self._running.pop(key, None)

        t0 = time.monotonic()
        future = asyncio.wrap_future(self._submit(work))
        while not started.is_set() and not future.done():
            if self.overdue() >= self.workers:
                future.cancel()
                raise RunError(f"every one of the {self.workers} tool workers holds a call running past "
                               f"{self.timeout_s:g} s (rollout.multi_turn.tool_timeout_s): the environment's step "
                               "does not return; fix the environment or raise the timeout")
            try:
                await asyncio.wait_for(started.wait(), timeout=self.timeout_s)
            except TimeoutError:
                continue
        t1 = time.monotonic()
        try:
            ok, text = await asyncio.wait_for(asyncio.shield(future), timeout=self.timeout_s)
        except TimeoutError:
            return ToolResult(f"error: the tool call ran past {self.timeout_s:g} s", ok=False,
                              seconds=time.monotonic() - t1, queued=t1 - t0, timed_out=True)
        if len(text) > self.max_output_chars:
            text = text[: self.max_output_chars] + f"... [cut at {self.max_output_chars} characters]"
        return ToolResult(text, ok=ok, seconds=time.monotonic() - t1, queued=t1 - t0)

    def _submit(self, fn: Callable[[], tuple[bool, str]]) -> Future[tuple[bool, str]]:
        future: Future[tuple[bool, str]] = Future()

        def job() -> None:
            if future.set_running_or_notify_cancel():
                future.set_result(fn())  # fn catches what the step raises

        if len(self._threads) < self.workers:
            thread = threading.Thread(target=self._serve, name=f"rlctl-tool-{len(self._threads)}", daemon=True)
            self._threads.append(thread)
            thread.start()
        self._jobs.put(job)
        return future

    def _serve(self) -> None:
        while True:
            self._jobs.get()()



def one_line(e: BaseException) -> str:
    """`ToolError: message` as one line (a ToolError's message alone)."""
    from rlctl.agents.environments import ToolError

    message = " ".join(str(e).split())
    if isinstance(e, ToolError):
        return message or "the tool failed"
    return f"{type(e).__name__}: {message}" if message else type(e).__name__
