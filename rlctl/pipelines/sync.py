"""`pipeline.mode: sync` (how Slime works): generate the whole rollout batch with weight version
k, then run its train batches one after another, then broadcast the new weights.

The trainer idles while the rollout batch is generated, and the servers idle while it trains;
the metrics make both visible, and rolloutpipe/async remove them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

from rlctl.data import Prompt
from rlctl.pipelines.core import Clock, EventSink, Group, GroupRunner, Trainer


class SyncPipeline:
    def __init__(self, runner: GroupRunner, trainer: Trainer, prompts: Iterator[Prompt], *, batch_size: int,
                 groups_per_batch: int, clock: Clock, emit: EventSink,
                 on_step_end: Callable[[int], None] = lambda step: None) -> None:
        self.runner = runner
        self.trainer = trainer
        self.prompts = prompts
        self.batch_size = batch_size
        self.groups_per_batch = groups_per_batch
        self.clock = clock
        self.emit = emit
        self.on_step_end = on_step_end
        self.version = 0
        self.next_group = 0

    async def run(self, steps: int) -> None:
        for step in range(steps):
            await self.step(step)
            self.on_step_end(step)

    async def step(self, step: int) -> None:
        self.emit("step_start", self.clock.now(), step=step, version=self.version)
        groups = [self.runner.new_group(self.next_group + i, step, next(self.prompts)) for i in range(self.batch_size)]
        self.next_group += self.batch_size
        done: list[Group] = list(await asyncio.gather(*(self.runner.run(g) for g in groups)))
        for b in range(0, len(done), self.groups_per_batch):
            await self.train(step, b // self.groups_per_batch, done[b : b + self.groups_per_batch])
        self.emit("sync_start", self.clock.now(), step=step, version=self.version)
        stats = await self.trainer.sync_weights(self.version)
        self.emit("sync_end", self.clock.now(), step=step, version=self.version,
                  bytes=stats.get("bytes", 0), seconds=stats.get("seconds", 0.0))
        self.emit("step_end", self.clock.now(), step=step, version=self.version)

    async def train(self, step: int, batch: int, groups: list[Group]) -> None:
        samples = [row for g in groups for row in g.train_samples()]
        self.emit("train_start", self.clock.now(), step=step, batch=batch, groups=[g.id for g in groups],
                  versions=sorted({s.weight_version for g in groups for s in g.samples}))
        stats = await self.trainer.train(samples)
        self.version = int(stats["version"])
        self.emit("train_end", self.clock.now(), step=step, batch=batch, groups=[g.id for g in groups],
                  **{k: v for k, v in stats.items() if k != "version"}, version=self.version)
