"""A simulated continuous-batching rollout server, for `VirtualTimeLoop`.

It models what SGLang's scheduler does to the timing of requests: requests wait in a FIFO queue,
at most `max_running` run at once, every decode step gives each running request one token and
takes `cost.decode_step_seconds(batch)`, and a request joining the batch adds its prefill to the
step in which it joins. Batch membership only changes at step boundaries, as in the real engine.

Simulating token by token would cost a Python iteration per decode step, far too slow for a
1024-GPU run. Between membership changes the batch is constant, so every step takes the same time
and the server jumps from event to event analytically: a single counter holds the number of tokens
each running request has received since the server started, every running request finishes when
the counter reaches the value stored for it in a heap, and the next event, the earliest finish, is
(that value - counter) steps away. The span between membership changes is a *segment*; an arrival,
a pause or an abort in the middle of one is resolved to the step boundary it falls on.

The server is driven by loop timers, not by a task: one timer, at the next boundary where
something happens, and futures for the callers. All requests arriving at the same virtual instant
are admitted by one callback.
"""

from __future__ import annotations

import asyncio
import heapq
import math
from collections import deque

from rlctl.costs.model import CostModel


class _Request:
    __slots__ = ("future", "prompt_tokens", "new_tokens", "t_start", "admitted_at", "key")

    def __init__(self, future: asyncio.Future[tuple[float, float, int]], prompt_tokens: int,
                 new_tokens: int, key: str | None = None) -> None:
        self.key = key
        self.future = future
        self.prompt_tokens = prompt_tokens
        self.new_tokens = new_tokens
        self.t_start = 0.0
        self.admitted_at = 0  # the server's token counter when the request joined the batch


class SimServer:
    """One simulated rollout server (a tensor-parallel group of `cost.gpus_per_server` GPUs).

    Bound to the event loop of its first `generate` call. A caller cancelled while its request
    waits in the queue is dropped; one cancelled after admission keeps its slot until the request
    finishes (as when a client disconnects from an engine that does not check), so cancel through
    `abort_all` to free the batch.
    """

    def __init__(self, name: str, cost: CostModel, max_running: int) -> None:
        if max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {max_running}")
        if cost.decode_step_seconds(1) <= 0:
            raise ValueError("the cost model gives decode steps no duration; virtual time could not advance")
        self.name = name
        self.cost = cost
        self.max_running = max_running
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: deque[_Request] = deque()
        # Running requests as (counter value at which the request is done, admission order, request).
        self._running: list[tuple[int, int, _Request]] = []
        self._admitted = 0
        self._counter = 0  # tokens every running request has received, counted since the start
        self._prefill_owed = 0.0  # prefill seconds of admitted requests whose first step is not done
        self._paused = False
        # The current segment: a constant batch decoding from _seg_start. Its first step also
        # carries _seg_prefill; step j (j >= 1) ends at _seg_start + _seg_prefill + j * _seg_step.
        # _active is False when nothing is decoding (idle, or stopped by pause()).
        self._active = False
        self._seg_start = 0.0
        self._seg_prefill = 0.0
        self._seg_step = 0.0
        # The one pending timer, at step boundary _timer_steps of the current segment.
        self._timer: asyncio.TimerHandle | None = None
        self._timer_steps = 0
        self._busy = 0.0
        self._tokens = 0
        self._aborting: set[str] = set()
        self._step_seconds: dict[int, float] = {}  # decode_step_seconds by batch size, computed once each

    async def generate(self, prompt_tokens: int, new_tokens: int, key: str | None = None) -> tuple[float, float, int]:
        """Queue a request for `new_tokens` tokens after a `prompt_tokens` prompt, and wait for it.

        Returns (t_start, t_end, tokens): the virtual time it joined the running batch, the time it
        finished, and the tokens it got (`new_tokens`, fewer if aborted; an aborted request that
        never ran has t_start == t_end and 0 tokens). `key` names the request for `abort`."""
        if new_tokens < 1:
            raise ValueError(f"new_tokens must be >= 1, got {new_tokens}")
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif self._loop is not loop:
            raise RuntimeError(f"SimServer {self.name} is bound to another event loop")
        request = _Request(loop.create_future(), prompt_tokens, new_tokens, key)
        self._queue.append(request)
        self._wake()
        return await request.future

    def pause(self) -> None:
        """Stop decoding at the end of the current step; requests keep their progress and place."""
        if self._paused:
            return
        self._paused = True
        if self._active:
            self._schedule(self._next_boundary(self._now()))

    def resume(self) -> None:
        """Continue after `pause`, admitting what queued up meanwhile."""
        if not self._paused:
            return
        self._paused = False
        if self._running or self._queue:
            self._wake()

    def abort_all(self) -> int:
        """Finish every running and queued request now, each with the tokens it has so far (the
        step in progress is lost). Returns how many requests were aborted."""
        if self._loop is None:
            return 0
        t = self._now()
        steps = self._steps_done(t)
        if self._active:
            self._busy += t - self._seg_start
        self._counter += steps
        self._tokens += steps * len(self._running)
        for _, _, request in self._running:
            self._finish(request, t, self._counter - request.admitted_at)
        for request in self._queue:
            request.t_start = t
            self._finish(request, t, 0)
        aborted = len(self._running) + len(self._queue)
        self._running.clear()
        self._queue.clear()
        self._aborting.clear()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._active = False
        self._prefill_owed = 0.0
        self._seg_start = t
        return aborted

    def abort(self, key: str) -> None:
        """Abort one request: a queued one at once (0 tokens); a running one at the next step
        boundary, with the tokens it has by then, freeing its place in the batch."""
        for request in self._queue:
            if request.key == key:
                self._queue.remove(request)
                request.t_start = self._now()
                self._finish(request, request.t_start, 0)
                return
        if any(r.key == key for _, _, r in self._running):
            self._aborting.add(key)
            if self._active:
                self._schedule(self._next_boundary(self._now()))
            else:
                self._drop_aborting(self._now())

    def _drop_aborting(self, t: float) -> None:
        if not self._aborting:
            return
        keep = []
        for entry in self._running:
            request = entry[2]
            if request.key in self._aborting:
                self._finish(request, t, self._counter - request.admitted_at)
            else:
                keep.append(entry)
        heapq.heapify(keep)
        self._running = keep
        self._aborting.clear()

    @property
    def busy_seconds(self) -> float:
        """Virtual seconds during which at least one request was decoding (or prefilling)."""
        if not self._active:
            return self._busy
        return self._busy + min(self._now(), self._boundary(self._timer_steps)) - self._seg_start

    @property
    def tokens_generated(self) -> int:
        """Tokens generated so far, over all requests, counting only completed decode steps."""
        if not self._active:
            return self._tokens
        return self._tokens + self._steps_done(self._now()) * len(self._running)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_queued(self) -> int:
        return len(self._queue)

    def _now(self) -> float:
        assert self._loop is not None
        return self._loop.time()

    def _boundary(self, j: int) -> float:
        """Virtual time of the end of step j of the current segment (j = 0: its start)."""
        if j == 0:
            return self._seg_start
        return self._seg_start + self._seg_prefill + j * self._seg_step

    def _next_boundary(self, t: float) -> int:
        """The first step boundary of the current segment at or after t: the earliest moment the
        batch can change."""
        if t <= self._seg_start:
            return 0
        j = max(1, math.ceil((t - self._seg_start - self._seg_prefill) / self._seg_step))
        # Guard the float division: j is the smallest index with boundary(j) >= t.
        while j > 1 and self._boundary(j - 1) >= t:
            j -= 1
        while self._boundary(j) < t:
            j += 1
        return j

    def _steps_done(self, t: float) -> int:
        """Decode steps of the current segment completed by time t."""
        if not self._active:
            return 0
        j = min(self._timer_steps, max(0, math.floor((t - self._seg_start - self._seg_prefill) / self._seg_step)))
        while j < self._timer_steps and self._boundary(j + 1) <= t:
            j += 1
        while j > 0 and self._boundary(j) > t:
            j -= 1
        return j

    def _schedule(self, j: int) -> None:
        """Make sure the server wakes up at boundary j of the current segment (or earlier)."""
        assert self._loop is not None
        if self._timer is not None:
            if self._timer_steps <= j:
                return
            self._timer.cancel()
        self._timer_steps = j
        self._timer = self._loop.call_at(self._boundary(j), self._on_boundary, j)

    def _wake(self) -> None:
        """Something was queued or the server resumed: admit at the next step boundary if the
        batch has room, starting a segment now if nothing is decoding."""
        if self._paused:
            return
        if not self._active:
            if self._timer is None:
                self._seg_start = self._now()
                self._schedule(0)
        elif len(self._running) < self.max_running:
            self._schedule(self._next_boundary(self._now()))

    def _on_boundary(self, j: int) -> None:
        """Timer callback at step boundary j: account the j steps, finish the requests that are
        done, admit from the queue, and start the next segment."""
        self._timer = None
        t = self._boundary(j)
        if self._active:
            self._busy += t - self._seg_start
        self._counter += j
        self._tokens += j * len(self._running)
        if j:
            self._prefill_owed = 0.0
        while self._running and self._running[0][0] <= self._counter:
            request = heapq.heappop(self._running)[2]
            self._finish(request, t, request.new_tokens)
        self._drop_aborting(t)
        self._start_segment(t)

    def _start_segment(self, t: float) -> None:
        """At boundary time t: fill the batch from the queue (unless paused) and schedule the
        earliest finish; the segment stays inactive if nothing can decode."""
        self._seg_start = t
        self._active = False
        if self._paused:
            return
        while self._queue and len(self._running) < self.max_running:
            request = self._queue.popleft()
            if request.future.done():  # the caller was cancelled while it waited
                continue
            request.t_start = t
            request.admitted_at = self._counter
            self._prefill_owed += self.cost.prefill_seconds(request.prompt_tokens)
            heapq.heappush(self._running, (self._counter + request.new_tokens, self._admitted, request))
            self._admitted += 1
        if not self._running:
            return
        self._active = True
        self._seg_prefill = self._prefill_owed
        batch = len(self._running)
        step = self._step_seconds.get(batch)
        if step is None:
            step = self._step_seconds[batch] = self.cost.decode_step_seconds(batch)
        self._seg_step = step
        self._schedule(self._running[0][0] - self._counter)

    @staticmethod
    def _finish(request: _Request, t: float, tokens: int) -> None:
        if not request.future.done():
            request.future.set_result((request.t_start, t, tokens))
