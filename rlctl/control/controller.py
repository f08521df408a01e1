"""The controller process: the recipe's pipeline between the real rollout servers and the
trainer, recorded as it goes.

It waits for every server and the trainer, has the trainer form the weight-sync group with the
servers, and runs `run.steps` steps. The Recorder (rlctl/metrics/recorder.py) streams every event
to events.jsonl and, at each step's end, writes the step's metrics to metrics.jsonl and the
tracker; nothing is kept in memory from one step to the next but what the metrics need.
With run.save_every it writes a checkpoint after every save_every steps and the last one, and a
completed run's final policy (rlctl/control/checkpoints.py, rlctl/run/checkpoint.py); an attempt started by `rlctl resume` first loads the newest one into the
trainer and the scheduler and sends its weights to the servers. SIGUSR1 (a Slurm job's warning
before its time limit, passed on by the batch script) asks for a checkpoint at the end of the
step in progress, after which the controller stops with exit code PREEMPTED_EXIT and the job
requeues itself (rlctl/launchers/slurm/script.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from rlctl.control.checkpoints import checkpointer, load_checkpoint, restore_pipeline, save_final
from rlctl.control.colocate import ColocatedRollout, ColocatedTrainer, Turns, rank_sources
from rlctl.run.checkpoint import resume_point
from rlctl.engines.rollout.client import RolloutClient
from rlctl.engines.rollout.registry import rollout_adapter, rollout_client
from rlctl.engines.train.client import TrainerClient
from rlctl.process.auth import key_of
from rlctl.errors import RunError
from rlctl.control.failover import FailoverTrainer, ServerWatch
from rlctl.metrics import Recorder
from rlctl.pipelines.base import Pipeline
from rlctl.pipelines.build import build_pipeline
from rlctl.control.multi_turn import make_multi_turn
from rlctl.pipelines.episode import MultiTurn
from rlctl.pipelines.evaluation import Evaluator
from rlctl.pipelines.core import Clock, EventSink
from rlctl.pipelines.interfaces import RunTrainer, TrainerLayer
from rlctl.pipelines.servers import ServerSet
from rlctl.control.evaluation import make_evaluator
from rlctl.control.samples import SampleWriter
from rlctl.data.chat import PromptRenderer
from rlctl.pipelines.scoring import Score, run_scorer
from rlctl.process.topology import Topology
from rlctl.recipe import Device, Launcher, Recipe, SyncBackend
from rlctl.run.dir import HOST, PROCESS_CLOCK, EventLog, RunDir
from rlctl.run.tracking import make_tracker
from rlctl.process.watchdog import HEARTBEAT_FILE, CallTimer, beat

if TYPE_CHECKING:
    import aiohttp

    from rlctl.launchers.pool.client import PoolLease

log = logging.getLogger("rlctl.control.controller")

READY_TIMEOUT_S = 300.0


async def run_controller(rd: RunDir, recipe: Recipe, plan: Topology, model_path: str) -> None:
    from transformers import AutoTokenizer

    renderer = PromptRenderer(AutoTokenizer.from_pretrained(model_path), recipe.data)
    clock = PROCESS_CLOCK
    events = EventLog(rd.events_path)
    _flush_on_sigterm(events)
    preempt = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, _asked_to_stop(preempt))
    recorder = Recorder(events, rd.append_metrics, make_tracker(rd, recipe), wall_clock=time.time)
    scorer = run_scorer(renderer.response_text, recipe)
    resume_from = resume_point(rd.read())  # a resumed attempt (`rlctl resume`) starts from this checkpoint
    start = resume_from.steps if resume_from else 0
    if start:
        carry_progress(rd, recorder, start)
    beating = asyncio.create_task(beat(rd.path / HEARTBEAT_FILE))  # the supervisor's watchdog reads it
    evaluator = None
    try:
        async with _http_session() as session:
            token = _run_token(rd)
            keys = RunKeys(rd, token)
            servers = await connect_servers(recipe, plan, session, keys)
            client = await connect_trainer(recipe, plan, session, keys, servers)
            await scorer.ready()
            recorder.emit("run_start", clock.now(), steps=recipe.run.steps, mode=recipe.pipeline.mode, host=HOST,
                          **({"resumed_from": start} if resume_from else {}))
            recorder.events.flush()  # the launch's progress line names the phases before the first step
            lease = shared_pool(rd, recipe, session, token)
            turns = (Turns(recipe.colocate, servers, client, recorder.emit, clock, recipe.rollout.stall_timeout_s)
                     if recipe.colocate.enabled else None)
            server_set = ServerSet(generating_servers(servers, lease, turns))
            watch = ServerWatch(server_set, servers, recipe, rd, recorder.emit, clock)
            trainer = compose_trainer(recipe, plan, keys, client, watch, recorder.emit, clock, lease, turns)
            servers = server_set.servers
            state = await load_checkpoint(trainer, resume_from, recorder.emit, clock) if resume_from else None
            await send_initial_weights(trainer, recorder.emit, clock, version=int(state["version"]) if state else 0)
            recorder.events.flush()
            multi_turn = make_multi_turn(recipe.rollout.multi_turn, renderer)  # its tool workers are daemons
            pipeline = build_pipeline(recipe, servers, trainer, clock, recorder.emit,
                                      on_step_end=lambda step: _log_step(recorder.last),
                                      tokenize=renderer.ids, score=scorer, server_set=server_set,
                                      multi_turn=multi_turn)
            if state:
                restore_pipeline(pipeline, state, recorder.emit, clock)
            pipeline.after_step = checkpointer(rd, recipe, trainer, pipeline, recorder, clock, preempt)
            evaluator = await samples_and_evaluations(pipeline, rd, recipe, renderer, server_set, scorer,
                                                      recorder, clock, multi_turn)
            watching = asyncio.create_task(watch.run())
            try:
                await pipeline.run(recipe.run.steps, start)
                await save_final(rd, recipe, trainer, pipeline.version, recorder, clock)
            finally:
                watching.cancel()
    finally:
        beating.cancel()
        scorer.close()
        if evaluator is not None:
            evaluator.close()
        recorder.close(completed=start + recorder.recorded == recipe.run.steps)


async def samples_and_evaluations(pipeline: Pipeline, rd: RunDir, recipe: Recipe, renderer: PromptRenderer,
                                  server_set: ServerSet, scorer: Score, recorder: Recorder,
                                  clock: Clock, multi_turn: MultiTurn | None = None) -> Evaluator | None:
    """What the run writes besides its events and metrics: the samples of run.sample_groups groups
    a step (samples.jsonl), and the held-out evaluations of the eval section (eval.jsonl; the
    evaluator returned, to be closed at the end: it may hold scoring processes of its own)."""
    if recipe.run.sample_groups:
        pipeline.producer.on_completed = SampleWriter(rd, recipe.run.sample_groups)
    evaluator = make_evaluator(recipe, renderer, server_set, scorer, recorder.emit, clock,
                               recorder.evaluated(rd.append_eval), time.time, len(server_set.servers), multi_turn)
    if evaluator is not None:
        await evaluator.ready()
        pipeline.evaluate = evaluator
    return evaluator


def carry_progress(rd: RunDir, recorder: Recorder, start: int) -> None:
    """A resumed attempt's samples, tokens, optimizer steps and time go on from the record of the
    step before its checkpoint."""
    before = [m for m in rd.metrics() if m.get("step") == start - 1]
    if before:
        recorder.steps.carry(before[-1])


def shared_pool(rd: RunDir, recipe: Recipe, session: aiohttp.ClientSession, token: str) -> PoolLease | None:
    """launcher=pool: the lease the run asks its shared pool for slices with; None otherwise."""
    if recipe.launcher is not Launcher.POOL:
        return None
    from rlctl.launchers.pool.client import pool_lease

    return pool_lease(rd.read()["pool"], session, token)


def generating_servers(servers: list[RolloutClient], lease: PoolLease | None, turns: Turns | None) -> list:
    """The servers as the pipeline asks them to generate: with launcher=pool inside a slice of
    the shared pool (rlctl/plex/gates.py), colocated once the servers hold the devices
    (rlctl/control/colocate.py), else as they are."""
    if lease is not None:
        from rlctl.launchers.pool.client import pooled_servers

        return pooled_servers(lease, lease.job, servers)
    return [ColocatedRollout(s, turns) for s in servers] if turns else servers


def compose_trainer(recipe: Recipe, plan: Topology, keys: RunKeys, client: TrainerClient, watch: ServerWatch,
                    emit: EventSink, clock: Clock, lease: PoolLease | None, turns: Turns | None = None) -> RunTrainer:
    """The trainer as the pipeline and the checkpointer call it, from the inside out: the HTTP
    client of trainer rank 0; failover (each sync goes to the servers the run has now, the weight
    group formed anew when they changed: rlctl/control/failover.py); with pipeline.check_weights, every
    sync's checksums compared on every server; with launcher=pool, every call inside a slice of
    the shared pool (rlctl/plex/gates.py); with colocate.enabled, every call once its side holds
    the devices (rlctl/control/colocate.py). Each is a TrainerLayer around the one before."""
    failover = FailoverTrainer(client, watch, weight_group_former(client, recipe, plan, keys))
    checked = (CheckedTrainer(failover, failover.synced, emit, clock, watch.lose_silent)
               if recipe.pipeline.check_weights else failover)
    if turns is not None:
        turns.watch = watch
        return ColocatedTrainer(checked, turns)
    if lease is None:
        return checked
    from rlctl.launchers.pool.client import server_names
    from rlctl.plex.gates import PooledTrainer

    return PooledTrainer(checked, lease, lease.job, "trainer", server_names(watch.clients))


class CheckedTrainer(TrainerLayer):
    """pipeline.check_weights: after every weight sync, the sha256 of every tensor on each server
    must equal the trainer's (built-in servers; slow, for tests and debugging)."""

    def __init__(self, inner: RunTrainer, clients: Callable[[], list[RolloutClient]], emit: EventSink, clock: Clock,
                 lose_silent: Callable[[list[str]], Awaitable[None]] | None = None) -> None:
        super().__init__(inner)
        self.clients, self.emit, self.clock = clients, emit, clock
        """clients(): the servers the syncs now go to (failover takes lost ones out)."""
        self.lose_silent = lose_silent
        """Loses those of the named servers that no longer answer /health (ServerWatch.lose_silent)."""

    async def sync_weights(self, version: int, pause_mode: str = "abort") -> dict[str, Any]:
        import aiohttp

        stats = await self.inner.sync_weights(version, pause_mode)
        want = (await self.inner.weight_checksums())["checksums"]
        clients, checked = self.clients(), 0
        for c in clients:
            try:
                got = await c.weight_checksums()
            except (aiohttp.ClientError, OSError) as e:
                # Gone since the sync (killed, crashed): it is lost like any dead server, and the
                # sync that brings it back checks it. One that still answers /health but not this
                # is a failed check.
                if self.lose_silent is not None:
                    await self.lose_silent([c.name])
                if c.name in [s.name for s in self.clients()]:
                    raise RunError(f"{c.url} did not answer the weight check after the sync to version {version}: {e}") from None
                continue
            for rank, sums in enumerate([got["checksums"], *got.get("tp_ranks", [])]):
                wrong = [n for n, h in want.items() if sums.get(n) != h]
                if wrong:
                    raise RunError(f"after the sync to version {version}, {c.url} (TP rank {rank}) differs from the "
                                   f"trainer in {len(wrong)} of {len(want)} tensors (first: {wrong[0]})")
            checked += 1
        self.emit("weights_checked", self.clock.now(), version=version, tensors=len(want), servers=checked)
        return stats


async def send_initial_weights(trainer: RunTrainer, emit: EventSink, clock: Clock,
                               version: int = 0) -> None:
    """Version 0 (a resumed run: the checkpoint's version) reaches every server before the first
    step. What a server loaded from the model path is not necessarily the trainer's weights
    (another dtype, a trainer that starts elsewhere, a checkpoint), and until its first update
    SGLang stamps its generations with its --weight-version ("default"), which is no version of
    the run."""
    start = clock.now()
    stats = await trainer.sync_weights(version)
    emit("initial_sync", clock.now(), start=start, **{k: v for k, v in stats.items() if k not in ("version", "success")})


def _asked_to_stop(preempt: asyncio.Event) -> Callable[[], None]:
    def handler() -> None:
        log.info("SIGUSR1: a checkpoint at the end of this step, then stop (the job requeues itself)")
        preempt.set()
    return handler


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


def _run_token(rd: RunDir) -> str:
    """The run's token (rlctl/process/auth.py): every server of the run, and the trainer, ask for it."""
    from rlctl.process.auth import read_token

    try:
        return read_token(rd.path)
    except ValueError as e:
        raise RunError(str(e)) from None


class RunKeys:
    """What the controller sends each process of the run: that process's own key (rlctl/process/auth.py
    role_key), from the run's token and the key_id its newest start recorded in run.json."""

    def __init__(self, rd: RunDir, token: str) -> None:
        self.rd, self.token = rd, token

    def key(self, role: str) -> str:
        return key_of(self.token, self.rd.read().get("processes", {}), role)

    def servers(self, clients: list[RolloutClient]) -> list[dict[str, str]]:
        """The servers as the trainer is told of them: URL, role and key_id (it derives their keys
        itself), each client given its current key on the way."""
        processes = self.rd.read().get("processes", {})
        named = []
        for c in clients:
            c.set_key(key_of(self.token, processes, c.name))
            named.append({"url": c.url, "role": c.name, "key_id": processes[c.name]["key_id"]})
        return named


async def connect_servers(recipe: Recipe, plan: Topology, session: aiohttp.ClientSession,
                          keys: RunKeys) -> list[RolloutClient]:
    """A client per rollout server, named by its role, once every server answers /health (which
    asks for no key); each then gets the key its start recorded, and its engine checks it."""
    clients = [rollout_client(recipe.rollout.protocol, url, session, None, name=role.name)
               for role, url in zip(plan.rollout, plan.server_urls)]
    for c in clients:
        await c.wait_healthy(READY_TIMEOUT_S)
    keys.servers(clients)  # each gets the key its start recorded
    await rollout_adapter(recipe.rollout.engine).check(recipe.rollout, clients)
    return clients


async def connect_trainer(recipe: Recipe, plan: Topology, session: aiohttp.ClientSession, keys: RunKeys,
                          servers: list[RolloutClient]) -> TrainerClient:
    """The trainer service, once it answers /health and has formed the weight-sync group."""
    trainer = TrainerClient(plan.trainer_url, session, timer=CallTimer(recipe.run.stall_timeout_s))
    await trainer.wait_healthy(READY_TIMEOUT_S)
    trainer.set_key(keys.key(plan.trainers[0].name))
    named, backend = keys.servers(servers), sync_backend(recipe)
    await trainer.init_weight_sync(named, plan.trainers[0].host, plan.weight_sync_port, backend=backend,
                                   bucket_mb=recipe.train.sync_bucket_mb,
                                   from_ranks=rank_sources(recipe, plan, named, backend), **sync_target(recipe))
    return trainer


def sync_target(recipe: Recipe) -> dict[str, Any]:
    """What the trainer needs to know of the servers it syncs: the protocol they speak and what
    their engine cannot tell it (rlctl/engines/rollout/adapter.py sync_target)."""
    return rollout_adapter(recipe.rollout.engine).sync_target(recipe)


def weight_group_former(trainer: TrainerClient, recipe: Recipe, plan: Topology, keys: RunKeys):
    """connect(clients): the trainer forms the weight-sync group anew with these servers, on a
    port it finds free on its host (port 0: the controller need not run there, as in a pool on
    Slurm). A server back from the dead has a new key: every client gets its current one."""
    async def connect(clients: list[RolloutClient]) -> dict[str, str]:
        named, backend = keys.servers(clients), sync_backend(recipe)
        await trainer.init_weight_sync(named, plan.trainers[0].host, 0, backend=backend,
                                       bucket_mb=recipe.train.sync_bucket_mb,
                                       from_ranks=rank_sources(recipe, plan, named, backend), **sync_target(recipe))
        return {s["role"]: s["key_id"] for s in named}
    return connect


def sync_backend(recipe: Recipe) -> SyncBackend:
    """How weights reach the servers: train.sync_backend, or with `auto` the one the engine needs
    (colocated on a GPU, and built-in servers on trainer rank 0's GPU: IPC; vLLM's workers receive
    over NCCL only),
    else NCCL when trainer and servers are on GPUs of different hosts (a Slurm run), gloo
    otherwise: NCCL refuses two ranks on one GPU, which a one-machine run may well have."""
    if recipe.train.sync_backend is not SyncBackend.AUTO:
        return recipe.train.sync_backend
    if recipe.colocate.enabled and recipe.train.device is Device.CUDA:  # the server on the trainer's GPU
        return SyncBackend.IPC
    needed = rollout_adapter(recipe.rollout.engine).sync_backend(recipe)
    if needed is not None:
        return needed
    on_gpus = recipe.train.device is Device.CUDA and recipe.rollout.on_gpus
    return SyncBackend.NCCL if on_gpus and recipe.launcher is Launcher.SLURM else SyncBackend.GLOO


def _log_step(m: dict[str, Any] | None) -> None:
    if m is not None:
        log.info("step %d: reward %.3f, step time %.2f s (rollout %.2f, train %.2f, sync %.2f)",
                 m["step"], m["reward_mean"], m["step_time"], m["rollout_time"], m["train_time"], m["sync_time"])
