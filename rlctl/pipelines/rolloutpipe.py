"""`pipeline.mode: rolloutpipe`: sync's on-policy data, without sync's idle trainer.

Weights stay at version k for the whole rollout batch, exactly as in sync. But:
- complete-group pipelining: each complete trainable group goes to the trainer the moment it
  is materialized. With pipeline.stream_train (the default) the trainer runs forward and
  backward on it at once and takes the optimizer step when `groups_per_batch` groups are in;
  without it, a train batch starts as soon as `groups_per_batch` groups are there;
- frontier-group dispatch (pipeline.admission=frontier): the servers get the requests of the
  groups the next train batch needs first, with a bounded number in flight, so trainer-ready
  groups arrive early and steadily instead of all at the end.
The weights are broadcast after the rollout batch's last train batch.
"""

from __future__ import annotations

import asyncio

from rlctl.pipelines.base import Pipeline


class RolloutPipePipeline(Pipeline):
    def __init__(self, *args, stream_train: bool = True, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.stream_train = stream_train

    async def step(self, step: int) -> None:
        producing = asyncio.ensure_future(self.producer.run_batch(step, self.batch_size, self.over_provision))
        try:
            for _ in range(self.batch_size // self.groups_per_batch):
                if self.stream_train:
                    await self.train_streamed(step)
                else:
                    await self.train(step, [await self.producer.get() for _ in range(self.groups_per_batch)])
        except BaseException:
            producing.cancel()
            await asyncio.gather(producing, return_exceptions=True)
            raise
        # Every train batch is full, so the producer is ending by itself: it aborts the groups
        # still open (over-provisioning). Cancelling it here could cut those aborts short.
        await producing
        await self.sync_weights(step)
