"""Tool calls in a simulation (rollout.multi_turn with sim.tools): a simulated server writes token
counts, not text, so whether a turn calls a tool is drawn at random, a call takes virtual
seconds from a lognormal, and its result is a number of tokens. The trajectories then run through
the same MultiTurn loop, admission and pipeline modes as a real run's (rlctl/pipelines/episode.py)."""

from __future__ import annotations

import asyncio
import math
import random
from typing import Any

from rlctl.agents.calls import ToolCall
from rlctl.agents.tools import ToolResult
from rlctl.pipelines.episode import MultiTurn
from rlctl.recipe import Recipe


class SimTools:
    """Each call sleeps its latency in virtual time; at most `workers` run at once."""

    def __init__(self, rng: random.Random, median_s: float, sigma: float, timeout_s: float, workers: int) -> None:
        self.rng = rng
        self.mu = math.log(median_s) if median_s > 0 else -math.inf
        self.sigma = sigma
        self.timeout_s = timeout_s
        self._slots = asyncio.Semaphore(workers)

    def latency(self) -> float:
        return 0.0 if self.mu == -math.inf else self.rng.lognormvariate(self.mu, self.sigma)

    async def __call__(self, env: Any, call: ToolCall) -> ToolResult:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        async with self._slots:
            t1 = loop.time()
            seconds = self.latency()
            timed_out = seconds > self.timeout_s
            await asyncio.sleep(min(seconds, self.timeout_s))
        return ToolResult("", ok=not timed_out, seconds=min(seconds, self.timeout_s), queued=t1 - t0,
                          timed_out=timed_out)


class SimTurns:
    def __init__(self, result_tokens: int) -> None:
        self.result_tokens = result_tokens

    def ids(self, results: list[str]) -> list[int]:
        return [0] * (self.result_tokens * len(results))


def sim_multi_turn(recipe: Recipe, rng: random.Random) -> MultiTurn | None:
    """The simulated trajectories of a recipe with rollout.multi_turn.enabled (else None)."""
    mt, tools = recipe.rollout.multi_turn, recipe.sim.tools
    if not mt.enabled:
        return None
    call = [ToolCall("tool")]
    return MultiTurn(lambda: None, lambda g: call if rng.random() < tools.call_prob else [], SimTurns(tools.result_tokens),
                     SimTools(rng, tools.latency_median_s, tools.latency_sigma, mt.tool_timeout_s, mt.tool_workers),
                     lambda ids: "", max_turns=mt.max_turns, max_tokens=mt.max_tokens)
