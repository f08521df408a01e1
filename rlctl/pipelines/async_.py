"""`pipeline.mode: async`: rollout never stops.

The producer keeps generating groups with whatever weights the servers have; every sample
records the version(s) it was generated with. The trainer takes complete groups in completion
order; a group whose oldest sample lags the trainer by more than `max_staleness` versions is
dropped, never trained. After every `sync_every` optimizer steps the weights are broadcast. A
step here is one such interval. Requests in flight at a broadcast either finish on the old
weights (`finish`: new requests wait until the update is done) or are aborted and resumed on
the new weights from where they stopped (`abort_resume`: partial rollout).
An evaluation (eval section) due after a step runs with rollout paused from that step's
broadcast until it ends; the one before the first step runs beside rollout, both at version 0.
"""

from __future__ import annotations

import asyncio

from rlctl.pipelines.admission import Admission
from rlctl.pipelines.base import Pipeline
from rlctl.recipe import InflightAtUpdate


class AsyncPipeline(Pipeline):
    def __init__(self, *args, admission: Admission, max_staleness: int, sync_every: int,
                 inflight_at_update: InflightAtUpdate, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.admission = admission
        self.max_staleness = max_staleness
        self.sync_every = sync_every
        self.inflight_at_update = inflight_at_update

    async def run(self, steps: int, start: int = 0) -> None:
        stop = asyncio.Event()
        self.producer.step = start
        # Enough open groups to fill the train batches of the next max_staleness + 1 broadcasts:
        # anything generated further ahead would go stale before it could be trained.
        limit = self.groups_per_batch * self.sync_every * (self.max_staleness + 1)
        producing = asyncio.ensure_future(self.producer.run_stream(limit, stop))
        try:
            await super().run(steps, start)
        finally:
            stop.set()
            await asyncio.gather(producing, return_exceptions=True)
            self.producer.drop_ready("unused")
        producing.result()

    async def step(self, step: int) -> None:
        self.producer.step = step
        for _ in range(self.sync_every):
            groups = []
            while len(groups) < self.groups_per_batch:
                g = await self.producer.get()
                lag = self.version - g.weight_version
                if lag > self.max_staleness:
                    self.emit("group_dropped", self.clock.now(), step=step, group=g.id, reason="stale", lag=lag)
                    continue
                groups.append(g)
            await self.train(step, groups)
        self.admission.close()
        if self.inflight_at_update is InflightAtUpdate.FINISH:
            await self.admission.drained()
        try:
            await self.sync_weights(step, pause_mode="abort")
        finally:
            if not self.eval_due(step + 1):
                self.admission.open()

    async def evaluate_between(self, step: int) -> None:
        """An evaluation due after this step runs with rollout still paused from the broadcast (no
        request admitted; those in flight were aborted by it, or finished before it), so every
        sample it generates is of the version just broadcast; rollout resumes after it."""
        try:
            await super().evaluate_between(step)
        finally:
            self.admission.open()
