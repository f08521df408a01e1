"""The controller process: the recipe's pipeline between the real rollout servers and the
trainer, recorded as it goes.

It waits for every server and the trainer, has the trainer form the weight-sync group with the
servers, and runs `run.steps` steps. The Recorder (rlctl/metrics/recorder.py) streams every event
to events.jsonl and, at each step's end, writes the step's metrics to metrics.jsonl and the
tracker; nothing is kept in memory from one step to the next but what the metrics need.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from rlctl.engines.rollout.client import RolloutClient
from rlctl.engines.train.client import TrainerClient
from rlctl.errors import RunError
from rlctl.metrics import Recorder
from rlctl.pipelines.build import build_pipeline
from rlctl.pipelines.core import Clock, EventSink
from rlctl.pipelines.scoring import PooledScorer
from rlctl.plan import RunPlan
from rlctl.recipe import Device, Launcher, Recipe, RolloutEngine, SyncBackend
from rlctl.rewards.verifiers import make_verifier
from rlctl.rundir import HOST, PROCESS_CLOCK, EventLog, RunDir
from rlctl.tracking import make_tracker

if TYPE_CHECKING:
    import aiohttp

log = logging.getLogger("rlctl.controller")

READY_TIMEOUT_S = 300.0


async def run_controller(rd: RunDir, recipe: Recipe, plan: RunPlan, model_path: str) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    clock = PROCESS_CLOCK
    events = EventLog(rd.events_path)
    _flush_on_sigterm(events)
    recorder = Recorder(events, rd.append_metrics, make_tracker(rd, recipe), wall_clock=time.time)
    make_verifier(recipe.reward)  # a reward function that cannot load fails here, saying why, not in a worker
    scorer = PooledScorer(model_path, recipe.reward)
    try:
        async with _http_session() as session:
            servers = await connect_servers(recipe, plan, session)
            trainer: TrainerClient | CheckedTrainer = await connect_trainer(recipe, plan, session)
            await scorer.ready()
            recorder.emit("run_start", clock.now(), steps=recipe.run.steps, mode=recipe.pipeline.mode, host=HOST)
            if recipe.pipeline.check_weights:
                trainer = CheckedTrainer(trainer, servers, recorder.emit, clock)
            await send_initial_weights(trainer, recorder.emit, clock)
            pipeline = build_pipeline(recipe, servers, trainer, clock, recorder.emit,
                                      on_step_end=lambda step: _log_step(recorder.last),
                                      tokenize=lambda text: tokenizer(text)["input_ids"], score=scorer)
            await pipeline.run(recipe.run.steps)
    finally:
        scorer.close()
        recorder.close(completed=recorder.recorded == recipe.run.steps)


class CheckedTrainer:
    """pipeline.check_weights: after every weight sync, the sha256 of every tensor on each server
    must equal the trainer's (built-in servers; slow, for tests and debugging)."""

    def __init__(self, trainer: TrainerClient, clients: list[RolloutClient], emit: EventSink, clock: Clock) -> None:
        self.trainer, self.clients, self.emit, self.clock = trainer, clients, emit, clock

    async def accumulate(self, samples: list[dict[str, Any]]) -> dict[str, float]:
        return await self.trainer.accumulate(samples)

    async def train(self, samples: list[dict[str, Any]]) -> dict[str, float]:
        return await self.trainer.train(samples)

    async def sync_weights(self, version: int, pause_mode: str = "abort") -> dict[str, Any]:
        stats = await self.trainer.sync_weights(version, pause_mode)
        want = (await self.trainer.weight_checksums())["checksums"]
        for c in self.clients:
            got = await c.weight_checksums()
            for rank, sums in enumerate([got["checksums"], *got.get("tp_ranks", [])]):
                wrong = [n for n, h in want.items() if sums.get(n) != h]
                if wrong:
                    raise RunError(f"after the sync to version {version}, {c.url} (TP rank {rank}) differs from the "
                                   f"trainer in {len(wrong)} of {len(want)} tensors (first: {wrong[0]})")
        self.emit("weights_checked", self.clock.now(), version=version, tensors=len(want), servers=len(self.clients))
        return stats


async def send_initial_weights(trainer: TrainerClient | CheckedTrainer, emit: EventSink, clock: Clock) -> None:
    """Version 0 reaches every server before step 0. What a server loaded from the model path is
    not necessarily the trainer's weights (another dtype, a trainer that starts elsewhere), and
    until its first update SGLang stamps its generations with its --weight-version ("default"),
    which is no version of the run."""
    start = clock.now()
    stats = await trainer.sync_weights(0)
    emit("initial_sync", clock.now(), start=start, **{k: v for k, v in stats.items() if k not in ("version", "success")})


def _flush_on_sigterm(events: EventLog) -> None:
    """The supervisor ends a run's processes with SIGTERM: the events still buffered go to disk
    first, and then the signal takes its default course."""

    def terminate() -> None:
        events.flush()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, terminate)


@asynccontextmanager
async def _http_session() -> AsyncIterator[aiohttp.ClientSession]:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        yield session


def _api_key(recipe: Recipe) -> str:
    return recipe.rollout.sglang.api_key if recipe.rollout.engine is RolloutEngine.SGLANG else ""


async def connect_servers(recipe: Recipe, plan: RunPlan, session: aiohttp.ClientSession) -> list[RolloutClient]:
    """A client per rollout server, named by its role, once every server answers /health."""
    clients = [RolloutClient(url, session, _api_key(recipe) or None, name=role.name)
               for role, url in zip(plan.rollout, plan.server_urls)]
    for c in clients:
        await c.wait_healthy(READY_TIMEOUT_S)
    if recipe.rollout.engine is RolloutEngine.SGLANG:
        from rlctl.engines.rollout.sglang import speaks

        for c in clients:
            info = await c.server_info()
            log.info("%s: SGLang %s (%s)", c.url, info.get("version"), speaks(str(info.get("version", ""))))
    return clients


async def connect_trainer(recipe: Recipe, plan: RunPlan, session: aiohttp.ClientSession) -> TrainerClient:
    """The trainer service, once it answers /health and has formed the weight-sync group."""
    trainer = TrainerClient(plan.trainer_url, session)
    await trainer.wait_healthy(READY_TIMEOUT_S)
    await trainer.init_weight_sync(plan.server_urls, plan.trainers[0].host, plan.weight_sync_port,
                                   backend=sync_backend(recipe), bucket_mb=recipe.train.sync_bucket_mb,
                                   api_key=_api_key(recipe))
    return trainer


def sync_backend(recipe: Recipe) -> SyncBackend:
    """The weight-sync group's backend: train.sync_backend, or with `auto` NCCL when trainer and
    servers are on GPUs of different hosts (a Slurm run), gloo otherwise: NCCL refuses two ranks
    on one GPU, which a one-machine run may well have."""
    if recipe.train.sync_backend is not SyncBackend.AUTO:
        return recipe.train.sync_backend
    servers_on_gpus = recipe.rollout.device is Device.CUDA or recipe.rollout.engine is RolloutEngine.SGLANG
    on_gpus = recipe.train.device is Device.CUDA and servers_on_gpus
    return SyncBackend.NCCL if on_gpus and recipe.launcher is Launcher.SLURM else SyncBackend.GLOO


def _log_step(m: dict[str, Any] | None) -> None:
    if m is not None:
        log.info("step %d: reward %.3f, step time %.2f s (rollout %.2f, train %.2f, sync %.2f)",
                 m["step"], m["reward_mean"], m["step_time"], m["rollout_time"], m["train_time"], m["sync_time"])
