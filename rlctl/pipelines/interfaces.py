"""What the scheduler sees of the world: a rollout server, a trainer, a clock and where events go.

Small protocols (and the one way to wrap a trainer), so that every piece of rlctl.pipelines (the pool, the
group runner, the pipeline modes) can name them without importing one another. Real runs plug in
HTTP clients (rlctl/engines), the run's clock and event log; a simulation plugs in cost-model
engines (rlctl/sim/engines.py) and virtual time.
"""

from __future__ import annotations

from typing import Any, Protocol

from rlctl.engines.rollout.protocol import GenerateOutput, SamplingRequest


class Clock(Protocol):
    def now(self) -> float: ...


class Rollout(Protocol):
    """One rollout server, as the scheduler sees it."""

    name: str

    async def generate(self, input_ids: list[int], sampling: SamplingRequest, rid: str,
                       return_logprob: bool = True) -> GenerateOutput: ...

    async def abort(self, rid: str) -> None: ...


class Trainer(Protocol):
    async def accumulate(self, samples: list[dict[str, Any]]) -> dict[str, float]:
        """Forward and backward on part of a train batch; no optimizer step."""

    async def train(self, samples: list[dict[str, Any]]) -> dict[str, float]:
        """One optimizer step on these samples plus all accumulated since the last step."""

    async def sync_weights(self, version: int, pause_mode: str = "abort") -> dict[str, Any]: ...


class RunTrainer(Trainer, Protocol):
    """The trainer as a run's controller drives it: the pipeline's calls, checkpoints, and the
    checksums a weight check compares."""

    async def save_checkpoint(self, path: str) -> dict[str, Any]: ...

    async def save_policy(self, path: str) -> dict[str, Any]: ...

    async def load_checkpoint(self, path: str) -> dict[str, Any]: ...

    async def weight_checksums(self) -> dict[str, Any]: ...


class TrainerLayer:
    """A layer around a trainer: it passes every call of RunTrainer on to `inner`, and a subclass
    changes the calls it is about. Every layer of a run's trainer (rlctl/control/controller.py
    compose_trainer) is one, so each says in its own code what it changes and nothing is
    forwarded unseen."""

    def __init__(self, inner: RunTrainer) -> None:
        self.inner = inner

    async def accumulate(self, samples: list[dict[str, Any]]) -> dict[str, float]:
        return await self.inner.accumulate(samples)

    async def train(self, samples: list[dict[str, Any]]) -> dict[str, float]:
        return await self.inner.train(samples)

    async def sync_weights(self, version: int, pause_mode: str = "abort") -> dict[str, Any]:
        return await self.inner.sync_weights(version, pause_mode)

    async def save_checkpoint(self, path: str) -> dict[str, Any]:
        return await self.inner.save_checkpoint(path)

    async def save_policy(self, path: str) -> dict[str, Any]:
        return await self.inner.save_policy(path)

    async def load_checkpoint(self, path: str) -> dict[str, Any]:
        return await self.inner.load_checkpoint(path)

    async def weight_checksums(self) -> dict[str, Any]:
        return await self.inner.weight_checksums()


class Evaluate(Protocol):
    """The run's held-out evaluations (rlctl/control/evaluation.py), as the pipeline calls them."""

    def due(self, steps_done: int, steps: int) -> bool:
        """Whether an evaluation runs once `steps_done` of the run's `steps` steps are trained."""

    async def __call__(self, steps_done: int, version: int) -> None:
        """Evaluate every set at the servers' weights (`version`)."""


class EventSink(Protocol):
    def __call__(self, kind: str, t: float, **fields: Any) -> None: ...
