"""colocate.enabled: the rollout servers and the trainer take turns on the same devices.

One step, as the pipeline's calls drive it:

    the servers generate                              (the trainer's `trainer_release` is off the device)
    train():  no new generation starts; those in flight are aborted (async: they resume later
              from where they stopped); the servers give back `server_release`, the trainer
              takes its memory back and trains. The turn is the trainer's until the sync.
    sync_weights(): the trainer gives back its optimizer state (when released), the servers take
              their weights back, the weights go over (in place: CUDA IPC on a GPU), the servers
              take the rest back and continue, the trainer gives back its weights (when released)
    generate(): runs once the servers hold the devices

`Turns` keeps who holds the devices and moves the memory, one move at a time. Generations pass
through its gate (ColocatedRollout): while the trainer holds the devices they wait, and a move to
the trainer waits until none is out. A turn the trainer takes for a checkpoint, the final policy
or a weight check (no training) lasts that call: the next generation hands the devices back.
`ColocatedTrainer` and `ColocatedRollout` are the layers the pipeline calls through. Every move
is an event (`colocate_turn`: to whom, when it began, seconds, bytes moved by the trainer, the
servers' tags, and `phases`: the seconds of each part of the move, e.g. `trainer_resume` or
`servers_release`), so the trace and the benchmarks see what taking turns costs and where.

sync mode: a step's samples all come from the step's weights, as without colocation (nothing
generates between the turn to the trainer and the sync). async mode (with
pipeline.inflight_at_update=abort_resume): generation stops for each trainer turn; a request cut
by it resumes after the sync from where it stopped, its samples recording each segment's
version, and the staleness bound applies as without colocation.

Weights the servers gave back come back by the next sync; a turn back that is not a sync resumes
the servers' weights as they were (the built-in server keeps them; SGLang with
--enable-weights-cpu-backup; vLLM's sleep level 1).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import TYPE_CHECKING, Any

from rlctl.errors import RunError
from rlctl.pipelines.interfaces import RunTrainer, TrainerLayer

if TYPE_CHECKING:
    from rlctl.control.failover import ServerWatch
    from rlctl.engines.rollout.client import RolloutClient
    from rlctl.engines.rollout.protocol import GenerateOutput, SamplingRequest
    from rlctl.engines.train.client import TrainerClient
    from rlctl.pipelines.core import Clock, EventSink
    from rlctl.process.topology import Topology
    from rlctl.recipe import ColocateConfig, Recipe

SERVERS, TRAINER, BOTH = "servers", "trainer", "both"
DRAIN_POLL_S = 0.5


def rank_sources(recipe: Recipe, plan: Topology, servers: list[dict[str, str]], backend: str) -> list[list[int]] | None:
    """Which trainer ranks hand each server (`servers`: their roles, as RunKeys.servers names
    them) its weights: colocated over ipc with one trainer rank per server TP rank, the ranks on
    the server's own devices (trainer rank s * tp + j shares TP rank j of server s's device:
    rlctl/process/devices.py); else None, and rank 0 hands over all (one GPU, or the CPU's shared
    memory, which every process of the host opens)."""
    tp, ranks = recipe.rollout.server_tp, recipe.train.ranks
    if not recipe.colocate.enabled or backend != "ipc" or ranks == 1 or recipe.rollout.servers * tp != ranks:
        return None
    index = {role.name: role.index for role in plan.rollout}
    return [[index[s["role"]] * tp + j for j in range(tp)] for s in servers]


class Count:
    """How many calls of a kind are out, and `none`, an event set while none is."""

    def __init__(self) -> None:
        self.n = 0
        self.none = asyncio.Event()
        self.none.set()

    @contextmanager
    def held(self) -> Iterator[None]:
        self.n += 1
        self.none.clear()
        try:
            yield
        finally:
            self.n -= 1
            if not self.n:
                self.none.set()


class Phases:
    """The seconds each named part of one move took (a part run twice adds up)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.monotonic()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.monotonic() - start

    def rounded(self) -> dict[str, float]:
        return {name: round(s, 4) for name, s in self.seconds.items()}


class Turns:
    """Who holds the devices: `holder` is BOTH at the start (each process has loaded what it
    holds), then SERVERS or TRAINER. `servers` and `trainer` are the HTTP clients of the servers
    and of trainer rank 0 (whose memory calls every rank follows). `drain_s`: how long the
    generations out may take to come back once aborted (rollout.stall_timeout_s)."""

    def __init__(self, cfg: ColocateConfig, servers: list[RolloutClient], trainer: TrainerClient, emit: EventSink,
                 clock: Clock, drain_s: float = 60.0) -> None:
        self.cfg, self.servers, self.trainer = cfg, list(servers), trainer
        self.emit, self.clock, self.drain_s = emit, clock, drain_s
        self.watch: ServerWatch | None = None
        """The run's watch (set once it exists): it asks paused servers a route that does not generate."""
        self.holder = BOTH
        self.lock = asyncio.Lock()
        self.released: list[str] = []
        """The server tags now off the device."""
        self.began = 0.0
        self.training = False
        """The trainer's turn lasts until the sync (a train call took it), not just one call."""
        self.open = asyncio.Event()
        """Set while generations may start (the servers hold the devices, no move under way)."""
        self.open.set()
        self.out = Count()
        """Generations out."""
        self.calls = Count()
        """Trainer calls under way in the trainer's turn: the devices are not handed back meanwhile."""

    def _live(self) -> list[RolloutClient]:
        lost = self.watch.server_set.lost if self.watch else set()
        return [c for c in self.servers if c.name not in lost]

    async def _servers(self, call: str, *args: Any) -> None:
        await asyncio.gather(*(getattr(c, call)(*args) for c in self._live()))

    def _moved(self, to: str, start: float, replies: list[dict[str, Any]], server_tags: list[str],
               phases: Phases) -> None:
        """The move's event: to whom, when it began (`start`, the run's clock) and its seconds (a
        sync's own time left out: sync_end has it), the bytes the trainer moved, the tags the
        servers released or resumed, and the seconds of each part."""
        trainer_bytes = sum(int(r.get("bytes") or 0) for r in replies if isinstance(r, dict))
        self.emit("colocate_turn", self.clock.now(), to=to, start=self.began, seconds=round(time.monotonic() - start, 4),
                  trainer_bytes=trainer_bytes, server_tags=server_tags, phases=phases.rounded())

    @asynccontextmanager
    async def generating(self) -> AsyncIterator[None]:
        """One generation: it starts once the servers hold the devices (handing them back first
        after a turn the trainer took for one call only) and counts as out until it returns."""
        while not self.open.is_set() or self.holder == TRAINER:
            if self.holder == TRAINER and not self.training:
                await self.calls.none.wait()
                await self.to_servers()
            else:
                await self.open.wait()
        with self.out.held():
            yield

    @asynccontextmanager
    async def trainer_call(self, training: bool = False) -> AsyncIterator[None]:
        """One trainer call, in the trainer's turn (taken first where the servers hold it);
        `training`: the turn lasts until the sync."""
        await self.to_trainer(training)
        with self.calls.held():  # no await since the move: nothing hands the devices back in between
            yield

    async def to_trainer(self, training: bool = False) -> None:
        """No generation starts from here; those out are aborted and come back; the servers
        give back server_release, and the trainer takes everything back."""
        async with self.lock:
            self.training = self.training or training
            if self.holder == TRAINER:
                return
            start, self.began, phase = time.monotonic(), self.clock.now(), Phases()
            self.open.clear()
            replies = []
            if self.holder == SERVERS:
                names = [c.name for c in self._live()]
                if self.watch:
                    self.watch.pause(names)  # paused servers are asked a route that does not generate
                with phase("drain"):
                    await self._drain()
                    await self._servers("pause_generation", "abort")
                if self.cfg.server_release:
                    with phase("servers_release"):
                        await self._servers("release_memory_occupation", list(self.cfg.server_release))
                    self.released = list(self.cfg.server_release)
                if self.cfg.trainer_release:
                    with phase("trainer_resume"):
                        replies.append(await self.trainer.resume_memory_occupation(list(self.cfg.trainer_release)))
            self.holder = TRAINER
            self._moved(TRAINER, start, replies, list(self.released), phase)

    async def _drain(self) -> None:
        """Abort what is out until none is: a generation that passed the gate just before it
        closed may reach its server after an abort (and a paused vLLM server would make it wait,
        not return), so the servers are asked to abort everything again every DRAIN_POLL_S."""
        deadline = time.monotonic() + self.drain_s
        while self.out.n:
            if time.monotonic() > deadline:
                raise RunError(f"{self.out.n} generations did not come back within {self.drain_s:.0f} s of their "
                               "abort (rollout.stall_timeout_s); see the servers' logs")
            await asyncio.gather(*(c.abort("", abort_all=True) for c in self._live()))
            try:
                await asyncio.wait_for(self.out.none.wait(), DRAIN_POLL_S)
            except TimeoutError:
                pass

    async def to_servers(self, sync: Any = None) -> Any:
        """The trainer gives back what it does not need for the sync; with `sync` (an awaitable
        factory) the servers take their weights back and the sync runs; then the servers take
        the rest back and continue, and the trainer gives back its weights (when released)."""
        async with self.lock:
            if sync is None and (self.holder != TRAINER or self.training or self.calls.n):
                return None  # the servers hold the devices, or the trainer's turn is not over
            start, self.began, phase = time.monotonic(), self.clock.now(), Phases()
            replies, result, resumed = [], None, list(self.released)
            optimizer = [t for t in self.cfg.trainer_release if t != "weights"]
            if optimizer and self.holder == TRAINER:
                with phase("trainer_release"):
                    replies.append(await self.trainer.release_memory_occupation(optimizer))
            if "weights" in self.released:
                with phase("servers_resume"):
                    await self._servers("resume_memory_occupation", ["weights"])
                self.released.remove("weights")
            if sync is not None:
                synced = time.monotonic()
                result = await sync()
                start += time.monotonic() - synced
            if self.released:
                with phase("servers_resume"):
                    await self._servers("resume_memory_occupation", list(self.released))
                self.released = []
            if self.holder == TRAINER or sync is not None:
                await self._servers("continue_generation")
                if self.watch:
                    self.watch.unpause([c.name for c in self.servers])
            if "weights" in self.cfg.trainer_release:
                with phase("trainer_release"):
                    replies.append(await self.trainer.release_memory_occupation(["weights"]))
            self.holder, self.training = SERVERS, False
            self.open.set()
            self._moved(SERVERS, start, replies, resumed, phase)
            return result


class ColocatedTrainer(TrainerLayer):
    """The trainer's calls, each in the trainer's turn; a sync hands the devices back."""

    def __init__(self, inner: RunTrainer, turns: Turns) -> None:
        super().__init__(inner)
        self.turns = turns

    async def accumulate(self, samples: list[dict[str, Any]]) -> dict[str, float]:
        async with self.turns.trainer_call(training=True):
            return await self.inner.accumulate(samples)

    async def train(self, samples: list[dict[str, Any]]) -> dict[str, float]:
        async with self.turns.trainer_call(training=True):
            return await self.inner.train(samples)

    async def sync_weights(self, version: int, pause_mode: str = "abort") -> dict[str, Any]:
        await self.turns.to_trainer()
        return await self.turns.to_servers(lambda: self.inner.sync_weights(version, pause_mode))

    async def save_checkpoint(self, path: str) -> dict[str, Any]:
        async with self.turns.trainer_call():
            return await self.inner.save_checkpoint(path)

    async def save_policy(self, path: str) -> dict[str, Any]:
        async with self.turns.trainer_call():
            return await self.inner.save_policy(path)

    async def load_checkpoint(self, path: str) -> dict[str, Any]:
        async with self.turns.trainer_call():
            return await self.inner.load_checkpoint(path)

    async def weight_checksums(self) -> dict[str, Any]:
        async with self.turns.trainer_call():
            return await self.inner.weight_checksums()


class ColocatedRollout:
    """One server: a generation once the servers hold the devices."""

    def __init__(self, inner: RolloutClient, turns: Turns) -> None:
        self.inner, self.turns = inner, turns
        self.name = inner.name

    async def generate(self, input_ids: list[int], sampling: SamplingRequest, rid: str,
                       return_logprob: bool = True) -> GenerateOutput:
        async with self.turns.generating():
            return await self.inner.generate(input_ids, sampling, rid, return_logprob)

    async def abort(self, rid: str) -> None:
        await self.inner.abort(rid)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
