"""What the scheduler sees of the world: a rollout server, a trainer, a clock and where events go.

Four small protocols and nothing else, so that every piece of rlctl.pipelines (the pool, the
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


class EventSink(Protocol):
    def __call__(self, kind: str, t: float, **fields: Any) -> None: ...
