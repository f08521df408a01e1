"""A run's server set (ServerSet): its own rollout servers, which server a request goes to, and what
happens when one is lost. Not the shared pool of several runs (rlctl/plex/, rlctl/launchers/pool/)."""

from __future__ import annotations

import asyncio
import heapq
from collections.abc import Callable
from typing import TYPE_CHECKING

from rlctl.errors import RunError, ServerUnreachable

if TYPE_CHECKING:
    from rlctl.engines.rollout.protocol import GenerateOutput, SamplingRequest
    from rlctl.pipelines.interfaces import Rollout


class ServerSet:
    """Spreads requests over the servers (data parallelism = several servers): each request goes
    to the server with the fewest requests in flight. How many go out is admission's business.

    A heap of (load, order, server) with lazy deletion finds that server in O(log n), which
    matters for simulated runs with hundreds of servers and tens of thousands of requests. Stale
    entries of loads no server has any more would pile up over a long run, so the heap is rebuilt
    from the live loads whenever it holds twice as many entries as there are servers.

    Failover: a server that does not answer (ServerUnreachable), or that the controller's watch
    declares lost (`lose`), gets no more requests, and the requests it had in flight are sent
    again to the others: the sample is generated once, by whichever server answers. A lost
    server comes back with `rejoin` (after it has the run's weights)."""

    def __init__(self, servers: list[Rollout], on_lost: Callable[[str, str, int], None] | None = None) -> None:
        self.servers = servers
        self.in_flight = {s.name: 0 for s in servers}
        self.where: dict[str, Rollout] = {}
        self._heap = [(0, i, s.name) for i, s in enumerate(servers)]
        self._order = {s.name: i for i, s in enumerate(servers)}
        self._by_name = {s.name: s for s in servers}
        self.lost: set[str] = set()
        self.on_lost = on_lost
        """on_lost(server name, reason, requests it had in flight): the watch records it."""
        self._calls: dict[str, set[asyncio.Task]] = {s.name: set() for s in servers}
        self.retried = 0

    def _least_busy(self) -> Rollout:
        while self._heap:
            load, _, name = self._heap[0]
            if load == self.in_flight[name] and name not in self.lost:
                return self._by_name[name]
            heapq.heappop(self._heap)  # stale entry, or a lost server's
        raise RunError(f"every rollout server is lost ({', '.join(sorted(self.lost))}); see their logs")

    def _set_load(self, name: str, delta: int) -> None:
        self.in_flight[name] += delta
        heapq.heappush(self._heap, (self.in_flight[name], self._order[name], name))
        if len(self._heap) > 2 * len(self._order) + 64:
            self._heap = [(load, self._order[n], n) for n, load in self.in_flight.items()]
            heapq.heapify(self._heap)

    async def generate(self, input_ids: list[int], sampling: SamplingRequest, rid: str) -> tuple[Rollout, GenerateOutput]:
        while True:
            server = self._least_busy()
            task = asyncio.current_task()
            self._set_load(server.name, +1)
            self.where[rid] = server
            self._calls[server.name].add(task)
            try:
                return server, await server.generate(input_ids, sampling, rid)
            except ServerUnreachable as e:
                self.lose(server.name, str(e))
            except asyncio.CancelledError:
                # Cancelled by lose() alone: send it elsewhere. Any other cancel stands.
                if server.name not in self.lost or task.uncancel() > 0:
                    raise
            finally:
                self._set_load(server.name, -1)
                self.where.pop(rid, None)
                self._calls[server.name].discard(task)
            self.retried += 1

    def lose(self, name: str, reason: str) -> None:
        """Take a server out: no new requests; those in flight go to the others."""
        if name in self.lost:
            return
        self.lost.add(name)
        calls = list(self._calls[name])
        if self.on_lost is not None:
            self.on_lost(name, reason, len(calls))
        for task in calls:
            if task is not asyncio.current_task():
                task.cancel()

    def rejoin(self, name: str) -> None:
        if name in self.lost:
            self.lost.discard(name)
            heapq.heappush(self._heap, (self.in_flight[name], self._order[name], name))

    async def abort(self, rids: list[str]) -> None:
        targets = [(rid, self.where[rid]) for rid in rids if rid in self.where]
        await asyncio.gather(*(server.abort(rid) for rid, server in targets), return_exceptions=True)
