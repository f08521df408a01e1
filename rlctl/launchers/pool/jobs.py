"""One run attached to a live pool: its models (placed once), its engine processes (started by the
pool on the devices placement chose, logging into the run's own directory), and the moves of its
models between memory states (the engines' own release/resume calls, with the run's token).

A rollout model's working memory is its KV cache (SGLang's tag `kv_cache`), its weights are tag
`weights`; a trainer's working memory is its optimizer state (`optimizer`). How much a model
holds is estimated from its weights file before anything starts (job_blocks).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlctl.engines.train.adapter import trainer_adapter
from rlctl.process.auth import key_of, read_token
from rlctl.errors import RunError, ServerUnreachable
from rlctl.models.hf_config import declared_dtype, read_config
from rlctl.process.topology import Role, Topology
from rlctl.plex.placement import Block
from rlctl.plex.scheduler import Model, State
from rlctl.recipe import Device, Recipe, recipe_from_yaml
from rlctl.run.dir import RunDir

_HAS = {State.ACTIVE: {"weights", "working"}, State.WEIGHTS: {"weights"}, State.OFFLOADED: set()}


def weights_bytes(model_path: str) -> float:
    files = list(Path(model_path).glob("*.safetensors")) or list(Path(model_path).glob("*.bin"))
    return float(sum(f.stat().st_size for f in files))


def job_blocks(recipe: Recipe, model_path: str, devices: int) -> list[Block]:
    """A run's servers (spread over up to all the pool's devices) and its trainer ranks, with the
    bytes each holds per device: a server its weights as stored, plus a KV cache counted as a
    quarter of them (the built-in server's grows with its batch); a torch trainer fp32 weights
    (and an fp32 reference model with KL), plus fp32 gradients and two Adam moments (12 bytes a
    parameter), split over its ranks; a Megatron trainer as rlctl/engines/train/megatron_memory.py
    counts its tags."""
    w = weights_bytes(model_path)
    stored = declared_dtype(read_config(model_path))
    params = w / {"float32": 4, "float16": 2, "bfloat16": 2}.get(stored, 4)
    n, ranks = recipe.rollout.servers, recipe.train.ranks
    trainer_weights, trainer_working = trainer_adapter(recipe.train.engine).pool_bytes(recipe, params)
    server_working = w / 4
    said = recipe.pool  # the run's own numbers, when it gives them, over the estimates
    if said.rollout_memory_gb:
        server_working = max(0.0, said.rollout_memory_gb * 1e9 - w)
    if said.trainer_memory_gb:
        trainer_working = max(0.0, said.trainer_memory_gb * 1e9 - trainer_weights)
    return [Block("rollout", min(n, devices), w, server_working, parts=n, numbered=True),
            Block("trainer", ranks, trainer_weights, trainer_working)]


def device_memory(spec) -> float:
    """Bytes the scheduler lets one device's models hold."""
    d = spec.pool.devices
    if d.memory_gb:
        return d.memory_gb * 1e9
    if d.kind is Device.CUDA:
        import torch

        return float(torch.cuda.get_device_properties(d.gpus[0] if d.gpus else 0).total_memory)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / spec.pool.devices_per_node()


@dataclass
class PoolJob:
    rd: RunDir
    recipe: Recipe
    plan: Topology
    token: str
    share: float
    models: list[Model] = field(default_factory=list)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    node_of: dict[str, str] = field(default_factory=dict)
    """On a Slurm pool: each process's node."""
    started: set[str] = field(default_factory=set)
    """Models whose processes have loaded them: only those have memory to move."""
    running: bool = False
    """Every model started: a server that dies now is started again."""
    restarts: dict[str, int] = field(default_factory=dict)
    """How often each server was started again after it died."""
    restarting: set[str] = field(default_factory=set)
    """Servers being started again."""
    attached_at: float = field(default_factory=time.monotonic)
    ended: str | None = None
    """Why it left the pool (detached, a process died), once it has."""
    left: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once it has left: its engines stopped, its ports given back, its usage written."""

    @classmethod
    def from_run_dir(cls, run_dir: Path) -> PoolJob:
        rd = RunDir(run_dir)
        info = rd.read()
        recipe = recipe_from_yaml(rd.recipe_path.read_text(), str(rd.recipe_path))
        try:
            token = read_token(rd.path)
        except ValueError as e:
            raise RunError(str(e)) from None
        return cls(rd, recipe, Topology.from_json(info["plan"]), token, recipe.pool.share)

    @property
    def name(self) -> str:
        return self.rd.id

    def roles(self, model: Model) -> list[Role]:
        if model.name == "trainer":
            return list(self.plan.trainers)
        return [self.plan.rollout[int(model.name.rsplit("-", 1)[1])]]

    def placement(self, cpus_per_device: int, kind: Device, gpus: list[int], nodes: list[str] | None = None,
                  per_node: int = 0) -> dict[str, dict[str, Any]]:
        """Each process's device: its cores on a CPU pool, its GPU on a GPU pool; on a Slurm pool
        (`nodes`, `per_node` devices each) also its node, the cores or GPU counted on that node."""
        out = {}
        for m in self.models:
            for role, device in zip(self.roles(m), m.devices, strict=True):
                local = device % per_node if nodes else device
                if kind is Device.CUDA:
                    out[role.name] = {"device": f"cuda:{gpus[local] if gpus else local}", "pool_device": device}
                else:
                    first = local * cpus_per_device
                    out[role.name] = {"device": "cpu", "cpus": list(range(first, first + cpus_per_device)),
                                      "pool_device": device}
                if nodes:
                    out[role.name]["node"] = nodes[device // per_node]
        return out

    def exited(self) -> tuple[str, int] | None:
        for name, p in self.procs.items():
            code = p.poll()
            if code is not None:
                return name, code
        return None

    def stop(self, grace_s: float = 3.0) -> None:
        import signal

        from rlctl.launchers.local import _signal_group

        for p in self.procs.values():
            _signal_group(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(p.poll() is None for p in self.procs.values()):
            time.sleep(0.05)
        steps = {n: (self.rd.read().get("processes") or {}).get(n, {}).get("slurm_step") for n in self.procs}
        for name, p in self.procs.items():  # a Slurm pool's engine: its step, wherever it runs
            if p.poll() is None and steps[name]:
                subprocess.run(["scancel", "--signal=KILL", steps[name]], capture_output=True, timeout=30)
        for name, p in self.procs.items():
            _signal_group(p.pid, signal.SIGKILL)
            if p.poll() is None:
                p.wait(timeout=5)
            self.rd.event("server_down" if name.startswith("rollout") else "process_exit", role=name, code=p.returncode)


class EngineMover:
    """The scheduler's Mover for live jobs: the engines' release/resume memory calls."""

    def __init__(self, jobs: dict[str, PoolJob], session_factory) -> None:
        self.jobs = jobs
        self.session = session_factory

    async def __call__(self, model: Model, to: State) -> dict | None:
        """The engine's own account of the move ({"bytes", "engine_s"}) for the move's event."""
        job = self.jobs.get(model.job)
        if job is None or model.name not in job.started:
            return None  # not loaded yet (its start loads it) or gone: no memory to move
        release, resume = _HAS[model.state] - _HAS[to], _HAS[to] - _HAS[model.state]
        client = self._client(job, model)
        working = "optimizer" if model.name == "trainer" else "kv_cache"
        tags = lambda names: sorted(working if n == "working" else n for n in names)  # noqa: E731
        said: dict = {}
        try:
            for names, call in ((release, client.release_memory_occupation), (resume, client.resume_memory_occupation)):
                if names:
                    reply = await call(tags(names))
                    if isinstance(reply, dict) and isinstance(reply.get("seconds"), int | float):
                        said["bytes"] = said.get("bytes", 0) + int(reply.get("bytes") or 0)
                        said["engine_s"] = said.get("engine_s", 0.0) + float(reply["seconds"])
        except Exception as e:
            if job.ended or job.exited() or (isinstance(e, ServerUnreachable) and await _exit_noticed(job)):
                return None  # its engine is gone, and its memory with it: nothing to move (the pool lets it go)
            raise
        return said

    def _client(self, job: PoolJob, model: Model):
        from rlctl.engines.rollout.client import RolloutClient
        from rlctl.engines.train.client import TrainerClient

        processes = job.rd.read().get("processes", {})  # each engine's own key (rlctl/process/auth.py role_key)
        if model.name == "trainer":
            return TrainerClient(job.plan.trainer_url, self.session(),
                                 key_of(job.token, processes, job.plan.trainers[0].name))
        index = int(model.name.rsplit("-", 1)[1])
        return RolloutClient(job.plan.server_urls[index], self.session(),
                             key_of(job.token, processes, job.plan.rollout[index].name))


EXIT_NOTICE_S = 5.0
"""How long an engine that refuses connections may take to be reported exited. A warm-started
engine's exit reaches the pool as a message from its forker (rlctl/launchers/pool/warm.py), a
moment after the engine stopped listening: a move that finds it gone in between would otherwise
fail another job's slice."""


async def _exit_noticed(job: PoolJob) -> bool:
    """Whether one of the job's engines is reported exited within EXIT_NOTICE_S."""
    deadline = time.monotonic() + EXIT_NOTICE_S
    while time.monotonic() < deadline:
        if job.ended or job.exited():
            return True
        await asyncio.sleep(0.05)
    return False


async def wait_healthy(urls: list[str], job: PoolJob, timeout_s: float) -> None:
    from rlctl.launchers.health import healthy

    deadline = time.monotonic() + timeout_s
    pending = list(urls)
    while pending:
        died = job.exited()
        if died:
            raise RunError(f"{died[0]} exited with code {died[1]} while starting; see {job.rd.log_path(died[0])}")
        if time.monotonic() > deadline:
            raise RunError(f"{', '.join(pending)} not healthy after {timeout_s:.0f} s; see the run's logs")
        ok = await asyncio.gather(*(asyncio.to_thread(healthy, u) for u in pending))
        pending = [u for u, up in zip(pending, ok, strict=True) if not up]
        if pending:
            await asyncio.sleep(0.2)
