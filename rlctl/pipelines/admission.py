"""Admission: which generation request goes to the servers next, and how many are out at once.

Every request of a group is keyed (group id, sample index); group ids grow in the order groups
are opened, so a smaller key belongs to a group that an earlier train batch needs.

- fifo: every request goes out at once, in the order it was made (a rollout batch floods the
  servers, which queue what they cannot run). This is how sync systems such as Slime dispatch.
- frontier: at most `bound` requests are out; when one returns, the smallest waiting key goes
  next. The groups of the next train batch (the frontier) are therefore generated first and
  complete early and steadily, instead of all groups finishing together at the end.
- longest: frontier's bound and train-batch order, and within a train batch the requests whose
  prompts ran longest before go first (rlctl/pipelines/lengths.py learns that from the run).

Both can be closed (no new request goes out, e.g. during a weight update) and drained.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from typing import Protocol

from rlctl.pipelines.lengths import LengthModel
from rlctl.recipe import Admission as AdmissionKind

Key = tuple[int, int]


class Admission(Protocol):
    in_flight: int

    async def acquire(self, key: Key, prompt: str = "") -> None:
        """Wait until this request (a sample of `prompt`) may go to a server."""

    def release(self) -> None:
        """The request came back (done, aborted or failed)."""

    def finished(self, prompt: str, tokens: int) -> None:
        """A sample of `prompt` is complete, `tokens` long."""

    def close(self) -> None:
        """Hold every new request until open() (in-flight ones continue)."""

    def open(self) -> None: ...

    async def drained(self) -> None:
        """Return when nothing is in flight."""


class _Gate:
    """Open/closed and in-flight accounting, with events instead of polling."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.is_open = True
        self._opened = asyncio.Event()
        self._opened.set()
        self._idle = asyncio.Event()
        self._idle.set()

    def _took(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def _gave_back(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    def close(self) -> None:
        self.is_open = False
        self._opened.clear()

    def open(self) -> None:
        self.is_open = True
        self._opened.set()

    async def drained(self) -> None:
        await self._idle.wait()

    def finished(self, prompt: str, tokens: int) -> None:
        pass  # only length-aware admission learns from lengths


class FifoAdmission(_Gate):
    async def acquire(self, key: Key, prompt: str = "") -> None:
        while not self.is_open:
            await self._opened.wait()
        self._took()

    def release(self) -> None:
        self._gave_back()


class FrontierAdmission(_Gate):
    def __init__(self, bound: int) -> None:
        super().__init__()
        self.bound = bound
        self._waiting: list[tuple[tuple, int, asyncio.Future[None]]] = []
        self._tie = itertools.count()

    def priority(self, key: Key, prompt: str) -> tuple:
        """The order of waiting requests: smallest first."""
        return key

    async def acquire(self, key: Key, prompt: str = "") -> None:
        if self.is_open and self.in_flight < self.bound and not self._waiting:
            self._took()
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting, (self.priority(key, prompt), next(self._tie), fut))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # admitted just as we were cancelled: give the slot back
            else:
                self._waiting = [w for w in self._waiting if w[2] is not fut]
                heapq.heapify(self._waiting)
            raise

    def _admit_waiting(self) -> None:
        while self.is_open and self.in_flight < self.bound and self._waiting:
            _, _, fut = heapq.heappop(self._waiting)
            if fut.done():
                continue
            self._took()
            fut.set_result(None)

    def release(self) -> None:
        self._gave_back()
        self._admit_waiting()

    def open(self) -> None:
        super().open()
        self._admit_waiting()


class LongestAdmission(FrontierAdmission):
    """At most `bound` requests out; the train batches' order is frontier's, and within a train
    batch the request expected to run longest goes first.

    Sample i of group g feeds train batch g // groups_per_batch (groups are numbered in the
    order they are opened). A batch is complete when its slowest group is, so starting its
    longest requests first ends it sooner: longest-processing-time-first within the batch. How
    long a request runs is expected from its prompt's earlier samples (rlctl/pipelines/lengths.py);
    a prompt never seen expects the run's mean, and with nothing learned the order is frontier's.
    Requests never overtake those of an earlier train batch: a long request of a later batch sent
    before short ones of this batch would shorten the rollout, but complete this batch's groups
    later, and the trainer would wait for them. docs/pipelines.md ("Admission, measured") says
    what the policy buys."""

    def __init__(self, bound: int, groups_per_batch: int, lengths: LengthModel | None = None) -> None:
        super().__init__(bound)
        self.groups_per_batch = max(1, groups_per_batch)
        self.lengths = lengths or LengthModel()

    def priority(self, key: Key, prompt: str) -> tuple:
        return (key[0] // self.groups_per_batch, -self.lengths.expected_tokens(prompt), *key)

    def finished(self, prompt: str, tokens: int) -> None:
        self.lengths.finished(prompt, tokens)


def make_admission(kind: AdmissionKind, bound: int, groups_per_batch: int = 1) -> Admission:
    if kind is AdmissionKind.FRONTIER:
        return FrontierAdmission(bound)
    if kind is AdmissionKind.LONGEST:
        return LongestAdmission(bound, groups_per_batch)
    return FifoAdmission()
