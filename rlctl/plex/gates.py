"""A run's engines as its pipeline sees them, with every call passing through the pool.

The pipeline keeps calling `Rollout.generate` and `Trainer.train`/`sync_weights` as it always
does; each wrapper asks the pool for a slice of the devices the call needs (its models), runs the
call inside it, and gives the slice back. Nothing else about the run changes: the same on-policy
invariants hold, because the pool only delays calls, never reorders a job's data.

`Lease` is the pool as one job sees it: the scheduler itself in a simulation
(rlctl/plex/scheduler.py), an HTTP client of the pool's service in a live pool.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

from rlctl.engines.rollout.protocol import GenerateOutput, SamplingRequest
from rlctl.pipelines.interfaces import RunTrainer, TrainerLayer
from rlctl.plex.scheduler import State

ACTIVE, WEIGHTS = State.ACTIVE, State.WEIGHTS


class Lease(Protocol):
    def slice(self, job: str, needs: list[tuple[str, State]], kind: str) -> AbstractAsyncContextManager[None]: ...


class PooledRollout:
    """One rollout server of `job`, model `model` in the pool."""

    def __init__(self, inner: Any, lease: Lease, job: str, model: str) -> None:
        self.inner = inner
        self.name = inner.name
        self.lease = lease
        self.job = job
        self.model = model

    async def generate(self, input_ids: list[int], sampling: SamplingRequest, rid: str,
                       return_logprob: bool = True) -> GenerateOutput:
        async with self.lease.slice(self.job, [(self.model, ACTIVE)], "generate"):
            return await self.inner.generate(input_ids, sampling, rid, return_logprob)

    async def abort(self, rid: str) -> None:
        await self.inner.abort(rid)  # frees a slot; runs on whatever holds the device

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class PooledTrainer(TrainerLayer):
    """The trainer of `job`: training and checkpoints need its trainer active; a weight sync needs
    the weights of the trainer and of every rollout server (they receive them), not the KV caches
    (a server drops its cache after an update anyway) nor the optimizer state."""

    def __init__(self, inner: RunTrainer, lease: Lease, job: str, trainer: str, rollouts: list[str]) -> None:
        super().__init__(inner)
        self.lease = lease
        self.job = job
        self.trainer = trainer
        self.rollouts = list(rollouts)

    async def accumulate(self, samples: list[dict[str, Any]]) -> dict[str, float]:
        async with self.lease.slice(self.job, [(self.trainer, ACTIVE)], "train"):
            return await self.inner.accumulate(samples)

    async def train(self, samples: list[dict[str, Any]]) -> dict[str, float]:
        async with self.lease.slice(self.job, [(self.trainer, ACTIVE)], "train"):
            return await self.inner.train(samples)

    async def sync_weights(self, version: int, pause_mode: str = "abort") -> dict[str, Any]:
        needs = [(self.trainer, WEIGHTS), *((r, WEIGHTS) for r in self.rollouts)]  # weights in, weights out
        async with self.lease.slice(self.job, needs, "sync"):
            return await self.inner.sync_weights(version, pause_mode)

    async def save_checkpoint(self, path: str) -> dict[str, Any]:
        async with self.lease.slice(self.job, [(self.trainer, ACTIVE)], "checkpoint"):
            return await self.inner.save_checkpoint(path)

    async def save_policy(self, path: str) -> dict[str, Any]:
        async with self.lease.slice(self.job, [(self.trainer, ACTIVE)], "checkpoint"):
            return await self.inner.save_policy(path)

    async def load_checkpoint(self, path: str) -> dict[str, Any]:
        async with self.lease.slice(self.job, [(self.trainer, ACTIVE)], "checkpoint"):
            return await self.inner.load_checkpoint(path)
