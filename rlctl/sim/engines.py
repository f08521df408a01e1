"""Simulated engines behind the scheduler's own interfaces (`Rollout`, `Trainer` in
rlctl/pipelines/interfaces.py): the pipeline code that drives real servers drives these unchanged.

Samples carry token counts, not token ids; rewards are Bernoulli(reward_rate), so dynamic
sampling drops groups at the rate the real task would.
"""

from __future__ import annotations

import asyncio
from typing import Any

from rlctl.engines.rollout.protocol import GenerateOutput, SamplingRequest
from rlctl.costs.model import CostModel
from rlctl.sim.server import SimServer


class SimRollout:
    """One simulated rollout server, serving the weight version the last broadcast set."""

    def __init__(self, name: str, cost: CostModel, max_running: int) -> None:
        self.name = name
        self.server = SimServer(name, cost, max_running)
        self.version = 0

    async def generate(self, input_ids: list[int], sampling: SamplingRequest, rid: str,
                       return_logprob: bool = True) -> GenerateOutput:
        version = self.version
        _, _, tokens = await self.server.generate(len(input_ids), sampling.max_new_tokens, key=rid)
        finish = {"type": "length", "length": tokens} if tokens >= sampling.max_new_tokens else {"type": "abort"}
        return GenerateOutput(rid=rid, output_ids=[], logprobs=[], finish_reason=finish, weight_version=str(version),
                              prompt_tokens=len(input_ids), completion_tokens=tokens)

    async def abort(self, rid: str) -> None:
        self.server.abort(rid)


class SimTrainer:
    """Trains in 6 * params * tokens / achieved FLOP/s and broadcasts in bytes / bandwidth."""

    def __init__(self, cost: CostModel, servers: list[SimRollout]) -> None:
        self.cost = cost
        self.servers = servers
        self.version = 0
        self.pending = {"tokens": 0.0, "samples": 0.0}

    async def accumulate(self, samples: list[dict[str, Any]]) -> dict[str, float]:
        return await self._compute(samples, step=False)

    async def train(self, samples: list[dict[str, Any]]) -> dict[str, float]:
        stats = await self._compute(samples, step=True)
        self.version += 1
        stats.update(self.pending)  # the whole batch's counts, pieces included
        self.pending = {"tokens": 0.0, "samples": 0.0}
        return {**stats, "version": float(self.version)}

    async def _compute(self, samples: list[dict[str, Any]], step: bool) -> dict[str, float]:
        response = sum(s["response_tokens"] for s in samples)
        seconds = self.cost.train_seconds(response + sum(len(s["prompt_ids"]) for s in samples), step=step,
                                          samples=len(samples))
        await asyncio.sleep(seconds)
        # "tokens" means response tokens, as the real trainer reports it.
        self.pending["tokens"] += response
        self.pending["samples"] += len(samples)
        return {"seconds": seconds, "tokens": float(response), "samples": float(len(samples))}

    async def sync_weights(self, version: int, pause_mode: str = "abort") -> dict[str, Any]:
        for s in self.servers:
            s.server.pause()
            if pause_mode == "abort":
                s.server.abort_all()
        seconds = self.cost.broadcast_seconds()
        await asyncio.sleep(seconds)
        for s in self.servers:
            s.version = version
            s.server.resume()
        return {"bytes": self.cost.model.weight_bytes, "seconds": seconds}
