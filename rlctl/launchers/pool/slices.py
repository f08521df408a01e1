"""The routes by which a run's calls take and give back slices of the pool's devices, and the
slices granted, as leases: each call that holds a slice is renewed by its
run's controller while it runs (rlctl/launchers/pool/client.py), and one not renewed for
pool.lease_s is taken back. A run that stops while it holds a slice (SIGSTOP, a hung
controller, a client that keeps a slice it took) would otherwise hold its devices, and with
them every other run of the pool, for ever."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlctl.plex.scheduler import State

log = logging.getLogger("rlctl.pool")


@dataclass
class Lease:
    """A slice granted to one call of a job, held until released, taken back, or its job let go."""

    job: str
    kind: str
    done: asyncio.Event
    """Set to end the slice."""
    task: asyncio.Task
    granted: float = field(default_factory=time.monotonic)
    renewed: float = field(default_factory=time.monotonic)


class Leases:
    def __init__(self, lease_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.lease_s, self.clock = lease_s, clock
        self.calls: dict[str, Lease] = {}

    def grant(self, job: str, kind: str, done: asyncio.Event, task: asyncio.Task) -> str:
        call = uuid.uuid4().hex
        now = self.clock()
        self.calls[call] = Lease(job, kind, done, task, granted=now, renewed=now)
        return call

    def get(self, job: str, call: Any) -> Lease | None:
        """The job's lease of `call`, or None (never granted, given back, or taken back)."""
        lease = self.calls.get(str(call))
        return lease if lease is not None and lease.job == job else None

    def renew(self, job: str, call: Any) -> bool:
        lease = self.get(job, call)
        if lease is not None:
            lease.renewed = self.clock()
        return lease is not None

    def end(self, job: str, call: Any) -> Lease | None:
        """Give the lease back: its slice ends."""
        lease = self.get(job, call)
        if lease is not None:
            del self.calls[str(call)]
            lease.done.set()
        return lease

    def expired(self) -> list[Lease]:
        """Take back every lease not renewed for lease_s; returns them."""
        now = self.clock()
        gone = [(c, lease) for c, lease in self.calls.items() if now - lease.renewed > self.lease_s]
        for call, lease in gone:
            del self.calls[call]
            lease.done.set()
        return [lease for _, lease in gone]

    def drop_job(self, job: str) -> None:
        """The job leaves the pool: its calls are cancelled, granted or not."""
        for call, lease in list(self.calls.items()):
            if lease.job == job:
                lease.task.cancel()
                del self.calls[call]

    def held(self) -> list[dict[str, Any]]:
        """Who holds a slice, for how long, and how long until it is taken back unless renewed."""
        now = self.clock()
        return [{"job": c.job, "kind": c.kind, "held_s": round(now - c.granted, 1),
                 "lease_left_s": round(self.lease_s - (now - c.renewed), 1)} for c in self.calls.values()]


class SliceRoutes:
    """POST /jobs/{job}/slice, /renew and /release of the pool's service (rlctl/launchers/pool/service.py)."""

    def __init__(self, service: Any) -> None:
        self.service = service

    async def slice(self, request):
        from aiohttp import web

        name = request.match_info["job"]
        if name not in self.service.jobs:
            return web.json_response({"error": f"job {name} is not in the pool"}, status=404)
        body = await request.json()
        needs = [(m, State(s)) for m, s in body["needs"]]
        entered, done = asyncio.Event(), asyncio.Event()

        async def hold() -> None:
            async with self.service.sched.slice(name, needs, str(body.get("kind", "call"))):
                entered.set()
                await done.wait()

        task = asyncio.create_task(hold())
        waiter = asyncio.create_task(entered.wait())
        try:
            await asyncio.wait([task, waiter], return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not entered.is_set():
                task.cancel()  # the caller left, or the slice failed
            waiter.cancel()
        if not entered.is_set():
            error = task.exception() if task.done() and not task.cancelled() else None
            return web.json_response({"error": str(error or "cancelled")}, status=409)
        call_id = self.service.leases.grant(name, str(body.get("kind", "call")), done, task)
        job = self.service.sched.jobs.get(name)
        join_s = self.service.spec.pool.quantum_s * (job.share if job else 1.0)  # a slice stays joinable this long
        return web.json_response({"call": call_id, "join_s": join_s, "lease_s": self.service.spec.pool.lease_s})

    async def renew(self, request):
        from aiohttp import web

        if not self.service.leases.renew(request.match_info["job"], (await request.json()).get("call")):
            return web.json_response({"error": "no such call (its lease expired, or it was given back)"}, status=404)
        return web.json_response({"lease_s": self.service.spec.pool.lease_s})

    def expire(self) -> None:
        """Take back every slice whose lease was not renewed for pool.lease_s: its holder is
        frozen or keeps it; the devices go on to the others."""
        for lease in self.service.leases.expired():
            said = {"job": lease.job, "call": lease.kind, "held_s": round(time.monotonic() - lease.granted, 1)}
            log.warning("%s's %s slice not renewed for %.0f s: taken back", lease.job, lease.kind,
                        self.service.leases.lease_s)
            self.service.emit("lease_expired", time.monotonic(), **said)
            job = self.service.jobs.get(lease.job)
            if job is not None:
                job.rd.event("pool_lease_expired", **said)

    async def release(self, request):
        from aiohttp import web

        body = await request.json()
        lease = self.service.leases.end(request.match_info["job"], body.get("call"))
        if lease is None:
            return web.json_response({"error": "no such call (its lease expired, or it was given back)"}, status=404)
        await asyncio.gather(lease.task, return_exceptions=True)
        return web.json_response({})
