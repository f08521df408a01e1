"""The pool's service: `python -m rlctl.launchers.pool.service --pool-dir DIR`, started by `rlctl
pool up`. One aiohttp server over one SliceScheduler (rlctl/plex/scheduler.py) for the pool's
devices, on a free port written to pool.json: on 127.0.0.1, or on a Slurm pool on the first
node's own address (rlctl/launchers/pool/slurm.py).

Routes (every one but /health asks for a token):
    POST   /jobs                 {run_dir}            pool token: attach a run (place, start its engines)
    GET    /jobs/{job}                                pool token: its state and usage
    DELETE /jobs/{job}                                pool token: detach it (stop its engines)
    POST   /jobs/{job}/slice     {needs, kind}        the run's lease key: wait for a slice -> {call}
    POST   /jobs/{job}/release   {call}               the run's lease key: the call is done
    POST   /jobs/{job}/renew     {call}               the run's lease key: the call still runs (pool.lease_s)
    GET    /status                                    pool token: devices, jobs, usage
    POST   /shutdown                                  pool token: detach every job and stop

A run's calls carry its lease key, derived from the run's token (rlctl/process/auth.py role_key with
LEASE_ROLE), which only that run (and the pool that started its engines) can read: one run cannot
take or give back another's slices, and the token itself never goes to the pool's port.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from rlctl.engines.train.adapter import trainer_adapter
from rlctl.process.auth import LEASE_ROLE, listen_address, listening_socket, refusal, role_key
from rlctl.errors import RlctlError, RunError
from rlctl.launchers.pool.engines import EngineStarter
from rlctl.launchers.pool.slices import Leases, SliceRoutes
from rlctl.launchers.pool.jobs import EngineMover, PoolJob, device_memory, job_blocks
from rlctl.launchers.pool.pooldir import PoolDir
from rlctl.launchers.pool.slurm import PortBook, job_nodes
from rlctl.launchers.pool.warm import Forker
from rlctl.plex.placement import Layout
from rlctl.plex.scheduler import SliceScheduler, State
from rlctl.plex.state import MonotonicClock, snapshot, waiting
from rlctl.recipe import Device, Launcher
from rlctl.recipe.load import load_pool_file

log = logging.getLogger("rlctl.pool")


USAGE_EVERY_S = 2.0


class PoolService:
    def __init__(self, pd: PoolDir) -> None:
        self.pd = pd
        self.spec = load_pool_file(pd.spec_path)
        self.token = pd.token()
        self.t0 = time.monotonic()
        self.nodes: list[str] | None = job_nodes() if self.spec.pool.launcher is Launcher.SLURM else None
        """A Slurm pool's nodes (the first runs this service); None on this host."""
        self.ports = PortBook(self.spec.pool.slurm.port_base)
        self.url = ""
        capacity = dict.fromkeys(range(self.spec.pool.devices.count), device_memory(self.spec))
        self.layout = Layout(capacity)
        self.jobs: dict[str, PoolJob] = {}
        self.gone: dict[str, str | None] = {}
        """Jobs that have left: why."""
        self._session = None
        self.sched = SliceScheduler(capacity, MonotonicClock(), EngineMover(self.jobs, lambda: self._session),
                                    self.emit, quantum_s=self.spec.pool.quantum_s,
                                    switch_overhead=self.spec.pool.switch_overhead,
                                    beside=frozenset({"sync"} if self.spec.pool.overlap_syncs and
                                                     self.spec.pool.devices.kind is Device.CPU else ()))
        self.leases = Leases(self.spec.pool.lease_s)
        self.slices = SliceRoutes(self)
        self.stopping = asyncio.Event()
        self.restarting: set[asyncio.Task] = set()
        self.forker: Forker | None = None
        """Forks the jobs' engine processes warm (rlctl/launchers/pool/warm.py), with warm_start."""

    def emit(self, kind: str, t: float, **fields: Any) -> None:
        if "start" in fields:  # the scheduler's clock is monotonic: times from the pool's start
            fields["start"] = round(fields["start"] - self.t0, 6)
        self.pd.event(kind, round(t - self.t0, 6), **fields)

    # -- the door ------------------------------------------------------------------------------

    def middleware(self):
        from aiohttp import web

        @web.middleware
        async def door(request: web.Request, handler):
            parts = request.path.strip("/").split("/")
            token = self.token
            if len(parts) == 3 and parts[0] == "jobs" and parts[2] in ("slice", "release", "renew"):
                job = self.jobs.get(parts[1])
                # the job's lease key (rlctl/process/auth.py LEASE_ROLE); an unknown job: refused below, or 404
                token = role_key(job.token, LEASE_ROLE, job.name) if job else self.token
            status = refusal(request.path, request.headers.get("Authorization"), token)
            if status is not None:
                return web.json_response({"error": "Unauthorized" if status == 401 else "Forbidden"}, status=status)
            return await handler(request)

        return door

    # -- jobs ----------------------------------------------------------------------------------

    async def attach(self, request):
        from aiohttp import web

        body = await request.json()
        try:
            job = PoolJob.from_run_dir(Path(body["run_dir"]))
            if job.name in self.jobs:
                raise RunError(f"{job.name} is already attached")
            await self._admit(job)
        except (RlctlError, KeyError, ValueError, OSError) as e:
            return web.json_response({"error": str(e)}, status=409)
        except Exception as e:  # a bug: the run says what it was, the log has the traceback
            log.exception("attaching %s", body.get("run_dir"))
            return web.json_response({"error": f"{type(e).__name__}: {e} (see the pool's log)"}, status=500)
        return web.json_response({"job": job.name, "placement": job.rd.read()["pool"]["placement"]})

    async def _admit(self, job: PoolJob) -> None:
        train = job.recipe.train
        if trainer_adapter(train.engine).cuda_only and self.spec.pool.devices.kind is Device.CPU:
            raise RunError(f"train.engine={train.engine} needs CUDA: attach it to a pool of kind cuda")
        info = job.rd.read()
        job.models = self.layout.place(job.name, job_blocks(job.recipe, info["model_path"], len(self.layout.capacity)))
        try:
            self.sched.add_job(job.name, job.models, job.share)
        except RunError:
            self.layout.forget(job.name)
            raise
        self.jobs[job.name] = job
        self.gone.pop(job.name, None)
        d = self.spec.pool.devices
        placement = job.placement(d.cpus_per_device, d.kind, d.gpus, self.nodes, self.spec.pool.devices_per_node())
        if self.nodes:  # its engines on the nodes of their devices, on ports there
            job.node_of = {role: p["node"] for role, p in placement.items()}
            job.plan = self.ports.replan(job.plan, job.name, job.node_of)
        job.rd.update(lambda r: r.update(pool={"name": self.pd.name, "url": self.url, "job": job.name,
                                               "placement": placement}, plan=job.plan.to_json()))
        self.emit("job_attached", time.monotonic(), job=job.name, run_dir=str(job.rd.path), share=job.share,
                  models={m.name: {"devices": list(m.devices), "weights_bytes": m.weights, "working_bytes": m.working}
                          for m in job.models})
        try:  # a start is a slice: the memory it loads into is made free first
            if self._fit_together(job):  # all at once, as a run of its own starts them
                async with self.sched.slice(job.name, [(m.name, State.ACTIVE) for m in job.models], "start"):
                    await asyncio.gather(*(self._start(job, m) for m in job.models))
            else:
                for m in job.models:
                    async with self.sched.slice(job.name, [(m.name, State.ACTIVE)], "start"):
                        await self._start(job, m)
            job.running = True
        except BaseException as e:
            await self._detach(job, f"did not start: {e}")
            raise

    def _fit_together(self, job: PoolJob) -> bool:
        return all(sum(m.resident(State.ACTIVE) for m in job.models if d in m.devices) <= self.sched.capacity[d]
                   for d in {d for m in job.models for d in m.devices})

    async def _start(self, job: PoolJob, model) -> None:
        await EngineStarter(self.pd.name, self.nodes, self.forker).start(job, model)

    async def _restart(self, job: PoolJob, name: str, code: int) -> bool:
        """A server of a running job died: started again on its device, up to the run's
        rollout.max_restarts times, as a run's own supervisor does (its controller sends requests
        to the other servers meanwhile and gives it the weights when it is back); after that the
        run goes on without it. False (the job is let go): not a server, or one still starting."""
        from rlctl.launchers.local import describe_exit

        model = next((m for m in job.models if m.name != "trainer" and job.roles(m)[0].name == name), None)
        if model is None or not job.running or model.name in job.restarting:
            return False
        job.procs.pop(name)
        job.started.discard(model.name)  # no memory to move until it is back
        job.rd.event("process_exit", role=name, code=code)
        job.rd.event("server_down", role=name)
        job.restarts[name] = job.restarts.get(name, 0) + 1
        if job.restarts[name] > job.recipe.rollout.max_restarts:
            job.rd.event("server_given_up", role=name, restarts=job.recipe.rollout.max_restarts)
            return True
        job.rd.event("server_restarted", role=name, attempt=job.restarts[name], after=describe_exit(code))
        self.emit("server_restarted", time.monotonic(), job=job.name, role=name, attempt=job.restarts[name])

        async def start() -> None:
            job.restarting.add(model.name)
            try:
                async with self.sched.slice(job.name, [(model.name, State.ACTIVE)], "start"):
                    await self._start(job, model)
            except (RlctlError, OSError) as e:
                await self._detach(job, f"{name} did not start again: {e}")
            finally:
                job.restarting.discard(model.name)

        task = asyncio.create_task(start())
        self.restarting.add(task)  # held until done: the loop keeps only a weak reference
        task.add_done_callback(self.restarting.discard)
        return True

    async def detach(self, request):
        from aiohttp import web

        job = self.jobs.get(request.match_info["job"])
        if job is None:
            return web.json_response({"error": "no such job"}, status=404)
        usage = await self._detach(job, request.query.get("reason", "detached"))
        return web.json_response({"job": job.name, "usage": usage})

    async def _detach(self, job: PoolJob, reason: str) -> dict[str, Any]:
        """Let the job go: its calls cancelled, its engines stopped, its ports given back. A second
        caller (the run's own detach while the watch loop lets it go) waits for the first, so a
        run says it has ended only once the pool has let it go."""
        if job.ended is None:
            job.ended = reason
            try:
                self.leases.drop_job(job.name)
                usage = self._usage(job)
                self.sched.remove_job(job.name)
                self.layout.forget(job.name)
                await asyncio.to_thread(job.stop)
                self.ports.give_back(job.name)
                job.rd.update(lambda r: r.setdefault("pool", {}).update(usage=usage, detached=reason))
                self.emit("job_detached", time.monotonic(), job=job.name, reason=reason, **usage)
            finally:
                job.left.set()
        await job.left.wait()
        self.jobs.pop(job.name, None)
        self.gone[job.name] = job.ended
        return job.rd.read().get("pool", {}).get("usage", {})

    def _usage(self, job: PoolJob) -> dict[str, Any]:
        """What it used (its slices and moves) against what the same placement would hold as a
        dedicated run: the devices its models are on, for the whole time."""
        state = snapshot(self.sched)["jobs"].get(job.name, {})
        wall = time.monotonic() - job.attached_at
        devices = len({d for m in job.models for d in m.devices})
        return {"used_device_s": round(state.get("used_s", 0.0), 3), "moved_device_s": round(state.get("moved_s", 0.0), 3),
                "wall_s": round(wall, 3), "devices": devices, "dedicated_device_s": round(wall * devices, 3),
                "share": job.share}

    async def job_state(self, request):
        from aiohttp import web

        name = request.match_info["job"]
        job = self.jobs.get(name)
        if job is None:
            if name in self.gone:  # its run asks why it was let go
                return web.json_response({"job": name, "ended": self.gone[name]})
            return web.json_response({"error": "no such job"}, status=404)
        return web.json_response({"job": job.name, "ended": job.ended, "usage": self._usage(job)})

    # -- the service ---------------------------------------------------------------------------

    async def status(self, request):
        from aiohttp import web

        snap = snapshot(self.sched)
        now = time.monotonic()
        return web.json_response({"name": self.pd.name, "uptime_s": now - self.t0, "devices": snap["devices"],
                                  "models": snap["models"], "jobs": {n: self._usage(j) for n, j in self.jobs.items()},
                                  "held": self.leases.held(), "waiting": waiting(self.sched)})

    async def shutdown(self, request):
        from aiohttp import web

        self.stopping.set()
        return web.json_response({"stopping": True})

    async def watch(self) -> None:
        """A job whose server died gets it again (_restart); a job whose other engine died leaves
        the pool (its run fails; the others go on); each job's usage is written into its run
        directory every few seconds."""
        last = 0.0
        while True:
            await asyncio.sleep(0.5)
            self.slices.expire()
            for job in list(self.jobs.values()):
                died = job.exited() if job.started else None
                if died and job.ended is None and not await self._restart(job, *died):
                    await self._detach(job, f"{died[0]} exited with code {died[1]}")
            if time.monotonic() - last > USAGE_EVERY_S:
                last = time.monotonic()
                for job in list(self.jobs.values()):
                    usage = self._usage(job)
                    job.rd.update(lambda r, u=usage: r.setdefault("pool", {}).update(usage=u))

    def app(self):
        from aiohttp import web

        app = web.Application(middlewares=[self.middleware()], client_max_size=1 << 20)
        app.router.add_get("/health", lambda r: web.json_response({"ok": True}))
        app.router.add_get("/status", self.status)
        app.router.add_post("/jobs", self.attach)
        app.router.add_get("/jobs/{job}", self.job_state)
        app.router.add_delete("/jobs/{job}", self.detach)
        app.router.add_post("/jobs/{job}/slice", self.slices.slice)
        app.router.add_post("/jobs/{job}/release", self.slices.release)
        app.router.add_post("/jobs/{job}/renew", self.slices.renew)
        app.router.add_post("/shutdown", self.shutdown)
        return app


async def serve(pd: PoolDir) -> None:
    import signal
    import socket

    import aiohttp
    from aiohttp import web

    service = PoolService(pd)
    if service.spec.pool.warm_start and not service.nodes:  # one host's forker: not across nodes
        service.forker = Forker(pd.path / "logs" / "forker.log")
    runner = web.AppRunner(service.app(), access_log=None)
    await runner.setup()
    host = socket.gethostname() if service.nodes else "127.0.0.1"  # loopback, or this node's own address
    sock = listening_socket(listen_address(host), 0)  # the port is written to pool.json
    port = sock.getsockname()[1]
    service.url = f"http://{host}:{port}"
    await web.SockSite(runner, sock).start()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, service.stopping.set)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        service._session = session
        where = {"launcher": "slurm", "nodes": service.nodes, "host": host,
                 "job_id": os.environ.get("SLURM_JOB_ID")} if service.nodes else {"launcher": "local"}
        pd.write(state="up", pid=os.getpid(), port=port, url=service.url, devices=service.spec.pool.devices.count,
                 **where)
        service.emit("pool_up", time.monotonic(), devices=service.spec.pool.devices.count,
                     memory_bytes=service.sched.capacity[0])
        watching = asyncio.create_task(service.watch())
        await service.stopping.wait()
        watching.cancel()
        for job in list(service.jobs.values()):
            await service._detach(job, "the pool shut down")
    await runner.cleanup()
    if service.forker is not None:
        service.forker.close()
    service.emit("pool_down", time.monotonic())
    pd.write(state="down")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlctl.launchers.pool.service")
    p.add_argument("--pool-dir", required=True, type=Path)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(asctime)s %(levelname)s pool: %(message)s")
    pd = PoolDir(args.pool_dir)
    try:
        asyncio.run(serve(pd))
    except RlctlError as e:
        print(f"error: {e}", flush=True)
        pd.write(state="failed", reason=str(e))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
