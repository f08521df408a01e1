"""Response lengths as the planner needs them: their mean, and the expected longest of n.

A rollout's depth is its longest sample's decode steps, so the planner needs order statistics of
the length distribution the recipe draws from (rollout.sampling): every response at
max_new_tokens, or rlctl.workloads.LengthDistribution's long tail (a lognormal body and a point
mass at the cap). With F the distribution function and n independent draws,

    E[max of n] = integral over [0, cap] of 1 - F(x)^n dx

and for a continuous batch that has run a while, a running request's remaining length R has
the equilibrium (length-biased) residual distribution of renewal theory,
F_R(r) = integral over [0, r] of (1 - F(x)) dx / E[L]. Both are integrated on a grid.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from functools import lru_cache
from statistics import NormalDist

from rlctl.recipe import Recipe

GRID = 400


class Lengths:
    """The recipe's response-length distribution, on a grid of GRID + 1 points over [0, cap]."""

    def __init__(self, cap: int, long_tail: bool, median_fraction: float = 0.095, sigma: float = 0.5,
                 truncated_fraction: float = 0.05) -> None:
        self.cap = cap
        self._memo: dict[tuple[int, float], float] = {}
        self.xs = [cap * i / GRID for i in range(GRID + 1)]
        if long_tail:
            mu = math.log(median_fraction * cap)
            body = [0.0 if x <= 0 else 0.5 * (1 + math.erf((math.log(x) - mu) / (sigma * math.sqrt(2)))) if sigma > 0
                    else float(x >= math.exp(mu)) for x in self.xs]
            self.cdf = [(1 - truncated_fraction) * b for b in body[:-1]] + [1.0]
        else:
            self.cdf = [0.0] * GRID + [1.0]  # every response runs to the cap
        self.fixed = not long_tail
        self.mean = float(cap) if self.fixed else self._integral([1 - f for f in self.cdf])
        second = self._integral([2 * x * (1 - f) for x, f in zip(self.xs, self.cdf, strict=True)])
        third = self._integral([3 * x * x * (1 - f) for x, f in zip(self.xs, self.cdf, strict=True)])
        self.std = 0.0 if self.fixed else math.sqrt(max(0.0, second - self.mean**2))
        central3 = third - 3 * self.mean * second + 2 * self.mean**3
        self.skew = central3 / self.std**3 if self.std > 0 else 0.0
        survival = [1 - f for f in self.cdf]
        acc, residual = 0.0, [0.0]
        for i in range(1, GRID + 1):
            acc += (survival[i - 1] + survival[i]) / 2 * (self.xs[i] - self.xs[i - 1])
            residual.append(min(1.0, acc / self.mean) if self.mean > 0 else 1.0)
        self.residual_cdf = residual
        self.residual_mean = self._integral([1 - f for f in residual])

    @classmethod
    def of(cls, recipe: Recipe) -> Lengths:
        sampling = recipe.rollout.sampling
        tail = sampling.long_tail
        return _cached(sampling.max_new_tokens, tail.enabled, tail.median_fraction, tail.sigma, tail.truncated_fraction)

    def _integral(self, ys: list[float]) -> float:
        step = self.cap / GRID
        return step * (sum(ys) - (ys[0] + ys[-1]) / 2)

    def busiest_tokens(self, n: float, servers: int) -> float:
        """E[most tokens any of `servers` servers gets], each drawing n responses: the mean plus
        the expected largest of `servers` standard normals (Blom's approximation), corrected for
        the sum's skew (Cornish-Fisher: a long tail makes the busiest server busier), times the
        sum's standard deviation. The slowest server, not the average one, ends a rollout."""
        if servers <= 1 or n <= 0:
            return n * self.mean
        z = NormalDist().inv_cdf((servers - 0.375) / (servers + 0.25))
        z += (z * z - 1) * self.skew / math.sqrt(n) / 6
        return n * self.mean + z * math.sqrt(n) * self.std

    def tokens_before(self, x: float) -> float:
        """E[min(L, x)]: the tokens a response has produced by decode step x (per request started
        at step 0), so n * tokens_before(x) / x is a one-wave batch's mean size until then."""
        i = min(GRID, max(0, int(x / self.cap * GRID)))
        return self.mean * self.residual_cdf[i]

    def quantile_max(self, q: float, g: int) -> float:
        """The step by which a share q of groups of g responses is complete: the q-quantile of
        the longest of g (F(x)^g = q)."""
        target = min(1.0, max(0.0, q)) ** (1 / g)
        return self.xs[min(GRID, bisect_left(self.cdf, target))]

    def expected_max(self, n: float) -> float:
        """E[longest of n responses]."""
        return self._max_of(self.cdf, n)

    def expected_max_residual(self, n: float) -> float:
        """E[longest remaining length among n requests running in a full continuous batch]."""
        return self._max_of(self.residual_cdf, n)

    def _max_of(self, cdf: list[float], n: float) -> float:
        if n <= 0:
            return 0.0
        if self.fixed and cdf is self.cdf:
            return float(self.cap)
        key = (id(cdf), n)
        if key not in self._memo:
            self._memo[key] = self._integral([1 - f**n if f < 1 else 0.0 for f in cdf])
        return self._memo[key]


@lru_cache(maxsize=64)
def _cached(cap: int, long_tail: bool, median_fraction: float, sigma: float, truncated_fraction: float) -> Lengths:
    return Lengths(cap, long_tail, median_fraction, sigma, truncated_fraction)
