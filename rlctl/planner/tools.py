"""What tool calls add to a step (rollout.multi_turn), priced from the same tool model `rlctl
simulate` draws from (sim.tools): each model turn but the last calls a tool with chance p, a call
takes a lognormal number of seconds (capped at the tool timeout) and adds result tokens.

- More requests: a trajectory makes E[turns] = 1 + p + ... + p^(T-1) model turns, each a request
  of the rollout's length distribution. The first prefills the prompt, a later one only the tools'
  results: the engine's prefix cache holds what came before.
- More depth: a step ends with its last trajectory, which waits on its tools between its turns.
  The exposed wait is the tool time of the slowest of the step's N trajectories: the 1 - 1/N
  quantile of a trajectory's total tool seconds, read off TRAJECTORIES trajectories drawn with a
  fixed seed (deterministic, like the rest of the plan).
- In async: tools overlap the rollout, but a step finishes k = groups_per_batch x sync_every
  groups while at most k x (max_staleness + 1) are open, so (Little's law) it lasts at least a
  group's latency over max_staleness + 1 (group_latency; rlctl/planner/schedule.py adds the
  difference where the rollout is shorter).
Known to be wrong: the slowest trajectory's turns are not the longest ones, and tool calls that
queue for a tool worker (rollout.multi_turn.tool_workers) wait longer than this counts; the
async floor counts no queueing either, so slow tools come out low in async.
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass

from rlctl.costs.lengths import Lengths
from rlctl.recipe import Recipe

TRAJECTORIES = 4096


@dataclass(frozen=True)
class ToolTime:
    turns: float
    """Expected model turns per trajectory."""
    calls: float
    """Expected tool calls per trajectory."""
    call_s: float
    """Expected seconds of one call."""
    result_tokens: int

    @classmethod
    def of(cls, recipe: Recipe) -> ToolTime | None:
        mt, tools = recipe.rollout.multi_turn, recipe.sim.tools
        if not mt.enabled:
            return None
        p, turns = tools.call_prob, mt.max_turns
        calls = sum(p**k for k in range(1, turns))
        mean = tools.latency_median_s * math.exp(tools.latency_sigma**2 / 2) if tools.latency_median_s > 0 else 0.0
        return cls(1.0 + calls, calls, min(mean, mt.tool_timeout_s), tools.result_tokens)

    def group_latency(self, recipe: Recipe, lengths: Lengths, pace: float) -> float:
        """Seconds from a group's admission to its last trajectory's end: the group's longest
        trajectory in turns, each turn a request of mean length but its last the group's longest,
        at `pace` seconds a decode step, and the group's slowest tool wait."""
        mt, g, p = recipe.rollout.multi_turn, recipe.rollout.group_size, recipe.sim.tools.call_prob
        max_turns = 1.0 + sum(1.0 - (1.0 - p**k) ** g for k in range(1, mt.max_turns))
        steps = (max_turns - 1.0) * lengths.mean + lengths.expected_max(g)
        return steps * pace + self.slowest(recipe, g)

    @staticmethod
    def slowest(recipe: Recipe, trajectories: float) -> float:
        """Seconds the slowest of `trajectories` trajectories waits on its tools."""
        mt, tools = recipe.rollout.multi_turn, recipe.sim.tools
        return _slowest(mt.max_turns, tools.call_prob, tools.latency_median_s, tools.latency_sigma, mt.tool_timeout_s,
                        trajectories)


@functools.cache
def _slowest(max_turns: int, call_prob: float, median_s: float, sigma: float, timeout_s: float,
             trajectories: float) -> float:
    """ToolTime.slowest, drawn once per tool model: every placement of a plan asks the same."""
    if median_s <= 0 or call_prob <= 0:
        return 0.0
    rng = random.Random(0)
    mu = math.log(median_s)
    totals = []
    for _ in range(TRAJECTORIES):
        total, turn = 0.0, 1
        while turn < max_turns and rng.random() < call_prob:
            total += min(rng.lognormvariate(mu, sigma), timeout_s)
            turn += 1
        totals.append(total)
    totals.sort()
    q = 1.0 - 1.0 / max(trajectories, 1.0)
    return totals[min(len(totals) - 1, int(q * len(totals)))]
