"""`rlctl simulate POOL.yaml`: several runs on one pool of simulated GPUs, in virtual time.

Each job is its recipe's own pipeline over simulated engines (rlctl/sim/engines.py), its calls
passing through the pool's scheduler (rlctl/plex/), the same code a live pool runs. Two runs per
job, side by side:

- dedicated: the job alone on its own rollout_gpus + trainer_gpus GPUs (through a one-job pool,
  which never waits and never moves a model: the plain run). It gives the baseline's wall time
  and GPU-hours, and how busy each of the job's models keeps its GPUs, which placement uses;
- pool: every job at once on the pool's GPUs, placed once, sliced in time.

Memory per GPU follows the engines: a rollout server holds its weights plus a KV cache that fills
the memory fraction SGLang takes (`CostModel.memory_fraction`); a trainer holds bf16 weights,
fp32 gradients, master weights and Adam moments (16 bytes/param besides the weights, split over
its GPUs) and activations. Releasing a KV cache copies nothing (it is dropped); offloading
weights or optimizer state copies them to host memory at `sim.host_bytes_per_s`.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from typing import Any

from rlctl.metrics import Recorder
from rlctl.pipelines.build import build_pipeline
from rlctl.pipelines.scoring import inline_scorer
from rlctl.rewards.verifiers import scored_by
from rlctl.plex.gates import PooledRollout, PooledTrainer
from rlctl.plex.placement import Block, Layout, co_location_fits
from rlctl.plex.scheduler import Model, SliceScheduler, State
from rlctl.plex.state import snapshot
from rlctl.recipe import Recipe, load_recipe
from rlctl.recipe.pool import PoolFile, PoolSimConfig
from rlctl.costs.model import HARDWARE, CostModel
from rlctl.sim.engines import SimRollout, SimTrainer
from rlctl.sim.loop import VirtualClock, run_virtual
from rlctl.sim.tools import sim_multi_turn
from rlctl.costs.recipe import cost_model

GB = 1e9


class _Dropped:
    """An event writer that keeps nothing: only the step records matter here."""

    def write(self, event: dict[str, Any]) -> None:
        pass

    def flush(self) -> None:
        pass


@dataclass
class PoolJobResult:
    name: str
    mode: str
    gpus: int
    """GPUs of its dedicated placement."""
    dedicated_s: float
    pool_s: float
    used_gpu_s: float
    """Its slices plus its moves, in the pool."""
    moved_gpu_s: float
    share: float
    loads: dict[str, float] = field(default_factory=dict)
    """Model -> fraction of the dedicated run its GPUs were busy."""

    @property
    def slowdown(self) -> float:
        return self.pool_s / self.dedicated_s

    @property
    def dedicated_gpu_s(self) -> float:
        return self.dedicated_s * self.gpus


@dataclass
class PoolSimResult:
    jobs: list[PoolJobResult]
    gpus: int
    makespan_s: float
    held_gpu_s: float
    """What the pool costs: each GPU from the start until the last job with a model on it ends
    (then it goes back to the cluster, as a dedicated job's GPUs do when it ends)."""
    busy_gpu_s: float
    co_location: dict[int, tuple[float, float]]
    """Devices where naive co-location does not fit: device -> (bytes needed, capacity)."""
    events: list[dict[str, Any]]

    @property
    def dedicated_gpu_s(self) -> float:
        return sum(j.dedicated_gpu_s for j in self.jobs)


def blocks(recipe: Recipe, cost: CostModel, sim: PoolSimConfig, loads: dict[str, float] | None = None) -> list[Block]:
    """What one job asks the pool for: its rollout servers and its trainer, bytes per GPU."""
    s, params = recipe.sim, cost.model.params
    loads = loads or {}
    hbm = cost.hardware.hbm_bytes
    per_server = cost.model.weight_bytes / s.tp
    servers = s.rollout_gpus // s.tp
    rollout = sum(loads.get(f"rollout-{i}", 0.5) for i in range(servers)) / servers
    out = [Block("rollout", s.rollout_gpus, per_server, hbm * cost.memory_fraction - per_server, rollout,
                 parts=servers, numbered=True)]
    n = s.trainer_gpus
    out.append(Block("trainer", n, 2 * params / n, 16 * params / n + sim.activation_gb * GB, loads.get("trainer", 0.5)))
    return out


class SimMover:
    """What a state change costs: a fixed overhead plus the bytes copied to or from the host."""

    def __init__(self, sim: PoolSimConfig, kept: dict[tuple[str, str], float]) -> None:
        self.sim = sim
        self.kept = kept
        """(job, model) -> working bytes that must be copied out on release (0: a KV cache)."""

    async def __call__(self, model: Model, to: State) -> None:
        kept = {State.ACTIVE: model.weights + self.kept[(model.job, model.name)], State.WEIGHTS: model.weights,
                State.OFFLOADED: 0.0}
        copied = abs(kept[to] - kept[model.state])
        await asyncio.sleep(self.sim.move_overhead_s + copied / self.sim.host_bytes_per_s)


def _job_engines(recipe: Recipe, cost: CostModel, sched: SliceScheduler, job: str):
    sim = recipe.sim
    servers = [SimRollout(f"{job}/rollout-{i}", cost, recipe.rollout.max_running_requests)
               for i in range(sim.rollout_gpus // sim.tp)]
    trainer = SimTrainer(cost, servers)
    names = [f"rollout-{i}" for i in range(len(servers))]
    pooled = [PooledRollout(s, sched, job, n) for s, n in zip(servers, names, strict=True)]
    return pooled, PooledTrainer(trainer, sched, job, "trainer", names)


async def _run_job(recipe: Recipe, cost: CostModel, sched: SliceScheduler, job: str, done: dict[str, float]) -> None:
    servers, trainer = _job_engines(recipe, cost, sched, job)
    rng = random.Random(recipe.run.seed)
    prompt = [0] * recipe.sim.prompt_tokens
    recorder = Recorder(_Dropped(), lambda record: None)
    pipeline = build_pipeline(
        recipe, servers, trainer, VirtualClock(), recorder.emit, lambda step: None, tokenize=lambda _: prompt,
        score=inline_scorer(lambda ids: "", scored_by(lambda r, a: float(rng.random() < recipe.sim.reward_rate))),
        multi_turn=sim_multi_turn(recipe, random.Random(recipe.run.seed + 1)))
    await pipeline.run(recipe.run.steps)
    done[job] = asyncio.get_running_loop().time()


def _schedule(jobs: list[tuple[str, Recipe, list[Model], float]], capacity: dict[int, float], sim: PoolSimConfig,
              quantum_s: float, switch_overhead: float = 0.1
              ) -> tuple[dict[str, float], dict[str, Any], SliceScheduler, list[dict[str, Any]]]:
    """Run the jobs together on one scheduler; returns each job's end time, the scheduler's
    snapshot at the end, the scheduler, its events."""
    events: list[dict[str, Any]] = []
    kept = {}
    for name, recipe, models, _ in jobs:
        for m in models:
            kept[(name, m.name)] = 0.0 if m.name.startswith("rollout") else 16 * cost_model(recipe).model.params / len(m.devices)
    done: dict[str, float] = {}

    async def main() -> tuple[SliceScheduler, dict[str, Any]]:
        sched = SliceScheduler(capacity, VirtualClock(), SimMover(sim, kept),
                               lambda kind, t, **f: events.append({"t": t, "event": kind, **f}), quantum_s=quantum_s,
                               switch_overhead=switch_overhead)
        for name, _, models, share in jobs:
            sched.add_job(name, models, share)
        await asyncio.gather(*(_run_job(r, cost_model(r), sched, name, done) for name, r, _, _ in jobs))
        return sched, snapshot(sched)

    sched, snap = run_virtual(main())
    return done, snap, sched, events


def dedicated(name: str, recipe: Recipe, sim: PoolSimConfig) -> tuple[float, dict[str, float]]:
    """The job alone on its own GPUs: its wall time, and how busy each model kept its GPUs."""
    cost = cost_model(recipe)
    capacity = {d: cost.hardware.hbm_bytes for d in range(recipe.sim.rollout_gpus + recipe.sim.trainer_gpus)}
    models = Layout(capacity).place(name, blocks(recipe, cost, sim))
    done, _, sched, _ = _schedule([(name, recipe, models, 1.0)], capacity, sim, quantum_s=1e9)
    wall = done[name]
    loads = {m.name: sum(sched.busy_s[d] for d in m.devices) / len(m.devices) / wall for m in models}
    return wall, loads


def simulate_pool(spec: PoolFile) -> PoolSimResult:
    sim = spec.sim
    hbm = HARDWARE[sim.gpu].hbm_bytes
    memory = spec.pool.devices.memory_gb * GB or hbm
    capacity = {d: memory for d in range(sim.gpus)}
    layout = Layout(capacity)
    prepared, results = [], []
    for i, job in enumerate(spec.jobs):
        recipe = load_recipe(job.recipe, [*job.overrides, f"sim.gpu={sim.gpu.value}"], check_paths=False)
        name = job.name or f"{recipe.run.name}-{i}"
        wall, loads = dedicated(name, recipe, sim)
        results.append(PoolJobResult(name, str(recipe.pipeline.mode), recipe.sim.rollout_gpus + recipe.sim.trainer_gpus,
                                     wall, 0.0, 0.0, 0.0, job.share, loads))
        prepared.append((name, recipe, loads, job.share))
    jobs = []
    for name, recipe, loads, share in sorted(prepared, key=lambda p: -(p[1].sim.rollout_gpus + p[1].sim.trainer_gpus)):
        models = layout.place(name, blocks(recipe, cost_model(recipe), sim, loads))
        jobs.append((name, recipe, models, share))
    naive = co_location_fits([m for _, _, models, _ in jobs for m in models], capacity)
    done, snap, sched, events = _schedule(jobs, capacity, sim, spec.pool.quantum_s, spec.pool.switch_overhead)
    used = snap["jobs"]
    for r in results:
        r.pool_s = done[r.name]
        r.used_gpu_s = used.get(r.name, {}).get("used_s", 0.0)
        r.moved_gpu_s = used.get(r.name, {}).get("moved_s", 0.0)
    held = {d: max((done[name] for name, _, models, _ in jobs if any(d in m.devices for m in models)), default=0.0)
            for d in capacity}
    return PoolSimResult(results, sim.gpus, max(done.values()), sum(held.values()), sum(sched.busy_s.values()), naive,
                         events)
