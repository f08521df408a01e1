"""`pipeline.mode: sync` (how Slime works): generate the whole rollout batch with weight version
k, then run its train batches one after another, then broadcast the new weights.

The trainer idles while the rollout batch is generated, and the servers idle while it trains;
the metrics make both visible, and rolloutpipe/async remove them.
"""

from __future__ import annotations

from rlctl.pipelines.base import Pipeline


class SyncPipeline(Pipeline):
    async def step(self, step: int) -> None:
        await self.producer.run_batch(step, self.batch_size, self.over_provision)
        groups = sorted([await self.producer.get() for _ in range(self.batch_size)], key=lambda g: g.id)
        for b in range(0, len(groups), self.groups_per_batch):
            await self.train(step, groups[b : b + self.groups_per_batch])
        await self.sync_weights(step)
