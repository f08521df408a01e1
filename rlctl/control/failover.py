"""Failover: a rollout server that dies or stops answering is taken out, and comes back.

The controller's ServerWatch asks every server's health route once a second (the engine's
adapter names it: rlctl/engines/rollout/adapter.py health_route). A server is lost when
a request to it finds nobody there (connection refused or reset: ServerSet sees it first), or
when its health route has not answered 200 for rollout.stall_timeout_s: a frozen process
(SIGSTOP, a hung kernel), or a server whose engine died (SGLang's /health_generate runs a
generation). A paused server (a weight sync, a failed one, a colocated run's training) is asked
a route that does not generate: a paused SGLang server's generation check answers 503 after 20 s
however alive it is (rlctl/engines/rollout/protocol.py). Losing a server:
- the server set sends it no more requests, and the requests it had in flight go to the others, so no
  sample is lost or generated twice, and in sync and rolloutpipe every sample of a step still
  comes from the step's weights (every server holds them);
- a server process that is still there (frozen) is killed: locally its process group, under
  Slurm its own srun step (scancel --signal=KILL JOB.STEP); the supervisor
  (rlctl/launchers/local.py) or the batch script (rlctl/launchers/slurm/script.py) starts a
  dead one again, up to rollout.max_restarts times.
A server that was started again while nobody noticed (a new key_id in run.json: every start of
a server draws one once it holds its port, rlctl/process/auth.py) is lost too: the new process holds
none of the run's weights. A lost server rejoins once it has been started again and answers
/health; one that answers under its old key_id is not the run's (the process it was is dead,
someone else holds its port) and gets nothing but keyless probes. It rejoins at the next weight
sync: the trainer forms
the weight-sync group anew with the servers then in it (a group cannot take new members), the
sync gives it the current weights, and only then does it get requests again. Until then every
sync goes to the servers left. Events: server_lost, server_rejoined.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import aiohttp

from rlctl.engines.rollout.client import RolloutClient
from rlctl.engines.rollout.registry import rollout_adapter
from rlctl.errors import RunError
from rlctl.pipelines.core import Clock, EventSink
from rlctl.pipelines.interfaces import RunTrainer, TrainerLayer
from rlctl.pipelines.servers import ServerSet
from rlctl.recipe import Launcher, Recipe

if TYPE_CHECKING:
    from rlctl.run.dir import RunDir

log = logging.getLogger("rlctl.control.failover")

POLL_S = 1.0
SYNC_TRIES = 3


class ServerWatch:
    """Polls the servers' /health; loses those that stall, and finds the lost ones back."""

    def __init__(self, server_set: ServerSet, clients: list[RolloutClient], recipe: Recipe, rd: RunDir,
                 emit: EventSink, clock: Clock) -> None:
        self.server_set, self.clients, self.recipe, self.rd = server_set, clients, recipe, rd
        self.emit, self.clock = emit, clock
        self.stall_s = recipe.rollout.stall_timeout_s
        self.last_ok = {c.name: clock.now() for c in clients}
        self.probes: dict[str, asyncio.Task] = {}
        self.probed_key_id: dict[str, str | None] = {}
        """The key_id in run.json when each server's probe now out was sent."""
        self.back: set[str] = set()
        """Lost servers started again that answer /health: they rejoin at the next sync."""
        self.probed_route: dict[str, str] = {}
        """The route each server's probe now out asks."""
        self.paused: set[str] = set()
        """Servers held from generating (pause): asked the route that does not generate."""
        adapter = rollout_adapter(recipe.rollout.engine)
        self.route = lambda paused: adapter.health_route(recipe.rollout, paused)  # noqa: E731
        self.key_ids, self.pids = self._starts()
        """The key_id (rlctl/process/auth.py) of the start each client's key belongs to, and the pid of
        that start. A server with another pid or key_id in run.json has been started again: a
        new process, which holds no weights of the run yet. And a lost server that answers
        /health under its old key_id is no start of the run's: a dead process cannot answer, so
        someone else is on its port."""
        server_set.on_lost = self._on_lost

    def _starts(self) -> tuple[dict[str, str | None], dict[str, int | None]]:
        processes = self.rd.read().get("processes", {})
        found = {c.name: processes.get(c.name) or {} for c in self.clients}
        return {n: p.get("key_id") for n, p in found.items()}, {n: p.get("pid") for n, p in found.items()}

    def _on_lost(self, name: str, reason: str, in_flight: int) -> None:
        log.warning("%s lost (%s); %d requests in flight go to the other servers", name, reason, in_flight)
        self.emit("server_lost", self.clock.now(), server=name, reason=reason, in_flight=in_flight)
        self.back.discard(name)
        probe = self.probes.pop(name, None)
        if probe is not None:
            probe.cancel()  # it may have started before the loss: its answer says nothing now

    def _kill(self, name: str) -> None:
        """A frozen server cannot restart itself: end it, and the supervisor (local) or the batch
        script (Slurm: SIGKILL to the server's own srun step, on its node) starts it again."""
        proc = self.rd.read().get("processes", {}).get(name) or {}
        if self.recipe.launcher is Launcher.SLURM:
            if proc.get("slurm_step"):
                cmd = ["scancel", "--signal=KILL", proc["slurm_step"]]
                try:
                    res = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
                    said = res.stderr.strip() if res.returncode else ""
                except (OSError, subprocess.TimeoutExpired) as e:
                    said = str(e)
                if said:
                    log.warning("%s: %s failed: %s", name, " ".join(cmd), said)
            return
        if proc.get("pid"):
            try:
                os.killpg(proc["pid"], signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def pause(self, names: list[str]) -> None:
        """These servers stop generating (they are being paused): a probe still out on the route
        that generates is dropped (a paused SGLang server would hold it 20 s and answer 503), and
        the next one asks the route that does not. A probe that has answered is left for the
        next tick to read: syncs come more often than ticks, and dropping answers would starve
        the watch of them."""
        generating = self.route(False)
        for name in names:
            self.paused.add(name)
            probe = self.probes.get(name)
            if probe is not None and not probe.done() and self.probed_route.get(name) == generating:
                probe.cancel()
                del self.probes[name]

    def unpause(self, names: list[str]) -> None:
        self.paused.difference_update(names)

    async def _probe(self, c: RolloutClient, route: str | None = None) -> bool:
        route = route or self.route(c.name in self.paused)
        try:
            # No credential: whoever answers on a lost server's port learns nothing from a probe.
            async with c.session.get(c.url + route, timeout=aiohttp.ClientTimeout(total=self.stall_s)) as resp:
                return resp.status == 200
        except (TimeoutError, aiohttp.ClientError):
            return False

    def check_once(self) -> None:
        """One tick: start a /health probe where none is out, take in those that finished, and
        lose the servers not seen healthy for stall_timeout_s or started again since their key.
        A probe that hangs (a frozen process) does not delay the verdict: it is judged by the
        time since the last 200. A lost server is back when it answers /health and its newest
        start has recorded a new key_id (it binds its port first)."""
        now = self.clock.now()
        key_ids, pids = self._starts()
        for c in self.clients:
            restarted = key_ids[c.name] != self.key_ids[c.name] or pids[c.name] != self.pids[c.name]
            if restarted and c.name not in self.server_set.lost:
                self.server_set.lose(c.name, "started again: the new process holds none of the run's weights yet")
            probe = self.probes.get(c.name)
            if probe is not None and probe.done():
                if not probe.cancelled() and probe.result():
                    self.last_ok[c.name] = now
                    # Back: a probe sent after the new start had recorded its key_id (so after it
                    # had bound the port) answered; an earlier one may have reached someone else.
                    new = self.probed_key_id.get(c.name) not in (None, self.key_ids[c.name])
                    if c.name in self.server_set.lost and c.name not in self.back and new:
                        self.back.add(c.name)
                        self.emit("server_back", now, server=c.name)
                probe = None
            if probe is None:
                route = self.probed_route[c.name] = self.probe_route(c.name)
                self.probes[c.name] = asyncio.create_task(self._probe(c, route))
                self.probed_key_id[c.name] = key_ids[c.name]
            if c.name not in self.server_set.lost and now - self.last_ok[c.name] > self.stall_s:
                route = self.probe_route(c.name)
                self.server_set.lose(c.name, f"{route} has not answered 200 for {now - self.last_ok[c.name]:.0f} s")
                self._kill(c.name)  # frozen, not dead: it is restarted once it is

    def probe_route(self, name: str) -> str:
        """The route a probe of `name` asks: the generating one only while the server should be
        generating. A paused server, and a lost one, ask the one that does not generate: a lost
        server started again holds none of the run's weights, and what tells it is back is that
        it answers at all; a generating check of it may wait out SGLang's health timeout (20 s)
        while it is held, as a pool holds a model it has moved out."""
        return self.route(name in self.paused or name in self.server_set.lost)

    def rejoin(self, name: str, key_id: str, version: int) -> None:
        """A server back from the dead has the run's weights (version): it gets requests again,
        and the start it is (key_id, pid) is the one watched from now on."""
        self.back.discard(name)
        self.key_ids[name] = key_id
        self.pids[name] = self._starts()[1][name]
        self.server_set.rejoin(name)
        self.emit("server_rejoined", self.clock.now(), server=name, version=version)

    async def lose_silent(self, names: list[str]) -> None:
        """After a failed sync: lose at once each of these servers that does not answer its
        health route (they stay paused: the route that does not generate)."""
        members = [c for c in self.clients if c.name in names]
        results = await asyncio.gather(*(self._probe(c) for c in members))
        for c, ok in zip(members, results, strict=True):
            if ok:
                continue
            if c.name in self.server_set.lost:
                self.back.discard(c.name)  # it was back, and is gone again
            else:
                self.server_set.lose(c.name, "did not answer during a weight sync")

    async def run(self) -> None:
        try:
            while True:
                await asyncio.sleep(POLL_S)
                self.check_once()
        finally:
            for probe in self.probes.values():
                probe.cancel()


class FailoverTrainer(TrainerLayer):
    """The trainer as the pipeline sees it, with syncs that follow the server set's membership: before
    a sync, a group whose members are no longer the servers in the set (one lost, one back) is
    formed anew; after it, the servers that came back rejoin the set."""

    def __init__(self, inner: RunTrainer, watch: ServerWatch,
                 connect: Callable[[list[RolloutClient]], Awaitable[dict[str, str]]]) -> None:
        super().__init__(inner)
        self.watch = watch
        self.connect = connect
        """connect(clients): has the trainer form the weight-sync group anew with those servers,
        each client given its current key; returns the key_id of each."""
        self.members = [c.name for c in watch.clients]

    def synced(self) -> list[RolloutClient]:
        """The servers the last sync went to and not lost since (a server may come back, or be
        lost, while a sync runs)."""
        return [c for c in self.servers() if c.name in self.members]

    def servers(self) -> list[RolloutClient]:
        """The servers a sync now goes to: those in the set and those back from the dead."""
        lost = self.watch.server_set.lost
        return [c for c in self.watch.clients if c.name not in lost or c.name in self.watch.back]

    async def sync_weights(self, version: int, pause_mode: str = "abort") -> dict[str, Any]:
        """Sync the servers in the set; a sync that fails because a server was lost meanwhile
        is done again without it (up to SYNC_TRIES times)."""
        for attempt in range(1, SYNC_TRIES + 1):
            before = [c.name for c in self.servers()]
            try:
                return await self._sync(version, pause_mode)
            except RunError:
                await self.watch.lose_silent(before)
                if [c.name for c in self.servers()] == before or attempt == SYNC_TRIES:
                    raise
                log.warning("the sync to version %d failed with a server lost; again without it", version)
        raise AssertionError("unreachable")

    async def _sync(self, version: int, pause_mode: str) -> dict[str, Any]:
        targets = self.servers()
        if not targets:
            raise RunError("every rollout server is lost; see their logs")
        names = [c.name for c in targets]
        used: dict[str, str] = {}
        if names != self.members:
            used = await self.connect(targets)  # each client gets its start's key
            self.members = names
            self.watch.emit("weight_group_formed", self.watch.clock.now(), servers=names, version=version)
        held = self.watch.paused & set(names)  # paused before the sync (a colocated turn): they stay so
        self.watch.pause(names)  # paused until a whole sync has given them the weights
        stats = await self.inner.sync_weights(version, pause_mode)
        self.watch.unpause([n for n in names if n not in held])
        for name in [n for n in names if n in self.watch.back]:
            self.watch.rejoin(name, used[name], version)
        return stats
