"""colocate.enabled: the rollout servers and the trainer take turns on the same devices.

One step, as the pipeline's calls drive it (sync mode):

    the servers generate the rollout batch            (the trainer's `trainer_release` is off the device)
    train():  servers pause, give back `server_release`; the trainer takes its memory back
    sync_weights(): the trainer gives back its optimizer state (when released), the servers take
              their weights back, the weights go over (in place: CUDA IPC on a GPU), the servers
              take the rest back and continue, the trainer gives back its weights (when released)
    generate(): the servers hold the devices again

`Turns` keeps who holds the devices and moves the memory, one move at a time (a lock): the
pipeline never has a generation and a train call out at once in sync mode, so a move never waits
on work in flight. `ColocatedTrainer` and `ColocatedRollout` are the layers the pipeline calls
through; each call first asks Turns for the devices it needs. Every move is an event
(`colocate_turn`: to whom, seconds, bytes moved by the trainer), so the trace and the
benchmarks see the time taking turns costs.

Weights the servers gave back come back by the next sync; a turn to the servers that is not a
sync (a checkpoint after the sync, then the next step's generation) resumes the servers'
weights as they were, which the built-in server keeps (rlctl/engines/memory.py).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from rlctl.pipelines.interfaces import RunTrainer, TrainerLayer

if TYPE_CHECKING:
    from rlctl.control.failover import ServerWatch
    from rlctl.engines.rollout.client import RolloutClient
    from rlctl.engines.rollout.protocol import GenerateOutput, SamplingRequest
    from rlctl.engines.train.client import TrainerClient
    from rlctl.pipelines.core import Clock, EventSink
    from rlctl.recipe import ColocateConfig

SERVERS, TRAINER, BOTH = "servers", "trainer", "both"


class Turns:
    """Who holds the devices: `holder` is BOTH at the start (each process has loaded what it
    holds), then SERVERS or TRAINER. `servers` and `trainer` are the HTTP clients of the servers
    and of trainer rank 0 (whose memory calls every rank follows)."""

    def __init__(self, cfg: ColocateConfig, servers: list[RolloutClient], trainer: TrainerClient, emit: EventSink,
                 clock: Clock) -> None:
        self.cfg, self.servers, self.trainer = cfg, list(servers), trainer
        self.emit, self.clock = emit, clock
        self.watch: ServerWatch | None = None
        """The run's watch (set once it exists): it asks paused servers a route that does not generate."""
        self.holder = BOTH
        self.lock = asyncio.Lock()
        self.released: list[str] = []
        """The server tags now off the device."""
        self.began = 0.0

    def _live(self) -> list[RolloutClient]:
        lost = self.watch.server_set.lost if self.watch else set()
        return [c for c in self.servers if c.name not in lost]

    async def _servers(self, call: str, *args: Any) -> None:
        await asyncio.gather(*(getattr(c, call)(*args) for c in self._live()))

    def _moved(self, to: str, start: float, replies: list[dict[str, Any]], server_tags: list[str]) -> None:
        """The move's event: to whom, when it began (`start`, the run's clock) and its seconds (a
        sync's own time left out: sync_end has it),
        the bytes the trainer moved, the tags the servers released or resumed."""
        trainer_bytes = sum(int(r.get("bytes") or 0) for r in replies if isinstance(r, dict))
        self.emit("colocate_turn", self.clock.now(), to=to, start=self.began, seconds=round(time.monotonic() - start, 4),
                  trainer_bytes=trainer_bytes, server_tags=server_tags)

    async def to_trainer(self) -> None:
        """The servers pause and give back server_release; the trainer takes everything back."""
        async with self.lock:
            if self.holder == TRAINER:
                return
            start, self.began = time.monotonic(), self.clock.now()
            replies = []
            if self.holder == SERVERS:
                names = [c.name for c in self._live()]
                if self.watch:
                    self.watch.pause(names)  # paused servers are asked a route that does not generate
                await self._servers("pause_generation", "abort")  # sync mode: the batch is done, nothing to abort
                if self.cfg.server_release:
                    await self._servers("release_memory_occupation", list(self.cfg.server_release))
                    self.released = list(self.cfg.server_release)
                if self.cfg.trainer_release:
                    replies.append(await self.trainer.resume_memory_occupation(list(self.cfg.trainer_release)))
            self.holder = TRAINER
            self._moved(TRAINER, start, replies, list(self.released))

    async def to_servers(self, sync: Any = None) -> Any:
        """The trainer gives back what it does not need for the sync; with `sync` (an awaitable
        factory) the servers take their weights back and the sync runs; then the servers take
        the rest back and continue, and the trainer gives back its weights (when released)."""
        async with self.lock:
            if self.holder == SERVERS and sync is None:
                return None
            start, self.began = time.monotonic(), self.clock.now()
            replies, result, resumed = [], None, list(self.released)
            optimizer = [t for t in self.cfg.trainer_release if t != "weights"]
            if optimizer and self.holder != SERVERS:
                replies.append(await self.trainer.release_memory_occupation(optimizer))
            if "weights" in self.released:
                await self._servers("resume_memory_occupation", ["weights"])
                self.released.remove("weights")
            if sync is not None:
                synced = time.monotonic()
                result = await sync()
                start += time.monotonic() - synced
            if self.released:
                await self._servers("resume_memory_occupation", list(self.released))
                self.released = []
            if self.holder != SERVERS or sync is not None:
                await self._servers("continue_generation")
                if self.watch:
                    self.watch.unpause([c.name for c in self.servers])
            if "weights" in self.cfg.trainer_release:
                replies.append(await self.trainer.release_memory_occupation(["weights"]))
            self.holder = SERVERS
            self._moved(SERVERS, start, replies, resumed)
            return result


class ColocatedTrainer(TrainerLayer):
    """The trainer's calls, each once the trainer holds the devices; a sync hands them back."""

    def __init__(self, inner: RunTrainer, turns: Turns) -> None:
        super().__init__(inner)
        self.turns = turns

    async def accumulate(self, samples: list[dict[str, Any]]) -> dict[str, float]:
        await self.turns.to_trainer()
        return await self.inner.accumulate(samples)

    async def train(self, samples: list[dict[str, Any]]) -> dict[str, float]:
        await self.turns.to_trainer()
        return await self.inner.train(samples)

    async def sync_weights(self, version: int, pause_mode: str = "abort") -> dict[str, Any]:
        await self.turns.to_trainer()
        return await self.turns.to_servers(lambda: self.inner.sync_weights(version, pause_mode))

    async def save_checkpoint(self, path: str) -> dict[str, Any]:
        await self.turns.to_trainer()
        return await self.inner.save_checkpoint(path)

    async def save_policy(self, path: str) -> dict[str, Any]:
        await self.turns.to_trainer()
        return await self.inner.save_policy(path)

    async def load_checkpoint(self, path: str) -> dict[str, Any]:
        await self.turns.to_trainer()
        return await self.inner.load_checkpoint(path)

    async def weight_checksums(self) -> dict[str, Any]:
        await self.turns.to_trainer()
        return await self.inner.weight_checksums()


class ColocatedRollout:
    """One server: a generation once the servers hold the devices."""

    def __init__(self, inner: RolloutClient, turns: Turns) -> None:
        self.inner, self.turns = inner, turns
        self.name = inner.name

    async def generate(self, input_ids: list[int], sampling: SamplingRequest, rid: str,
                       return_logprob: bool = True) -> GenerateOutput:
        await self.turns.to_servers()
        return await self.inner.generate(input_ids, sampling, rid, return_logprob)

    async def abort(self, rid: str) -> None:
        await self.inner.abort(rid)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
