"""What the three pipeline modes share: training one batch and broadcasting weights, with events."""

from __future__ import annotations

from collections.abc import Callable

from rlctl.pipelines.core import Clock, EventSink, Group, GroupProducer, Trainer


class Pipeline:
    def __init__(self, producer: GroupProducer, trainer: Trainer, *, batch_size: int, groups_per_batch: int,
                 clock: Clock, emit: EventSink, on_step_end: Callable[[int], None] = lambda step: None,
                 over_provision: float = 0.0) -> None:
        self.producer = producer
        self.over_provision = over_provision
        self.trainer = trainer
        self.batch_size = batch_size
        self.groups_per_batch = groups_per_batch
        self.clock = clock
        self.emit = emit
        self.on_step_end = on_step_end
        self.version = 0
        """The trainer's weight version: optimizer steps taken."""
        self.batches = 0

    async def run(self, steps: int) -> None:
        for step in range(steps):
            self.emit("step_start", self.clock.now(), step=step, version=self.version)
            await self.step(step)
            self.emit("step_end", self.clock.now(), step=step, version=self.version)
            self.on_step_end(step)

    async def step(self, step: int) -> None:
        raise NotImplementedError

    async def train(self, step: int, groups: list[Group]) -> None:
        samples = [row for g in groups for row in g.train_samples()]
        batch = self.batches
        self.batches += 1
        self.emit("train_start", self.clock.now(), step=step, batch=batch, groups=[g.id for g in groups],
                  versions=sorted({s["weight_version"] for s in samples}),
                  staleness=[self.version - s["weight_version"] for s in samples])
        stats = await self.trainer.train(samples)
        self.version = int(stats["version"])
        self.emit("train_end", self.clock.now(), step=step, batch=batch, groups=[g.id for g in groups],
                  **{k: v for k, v in stats.items() if k != "version"}, version=self.version)

    async def sync_weights(self, step: int, pause_mode: str = "abort") -> None:
        self.emit("sync_start", self.clock.now(), step=step, version=self.version)
        stats = await self.trainer.sync_weights(self.version, pause_mode)
        self.emit("sync_end", self.clock.now(), step=step, version=self.version,
                  bytes=stats.get("bytes", 0), seconds=stats.get("seconds", 0.0))
