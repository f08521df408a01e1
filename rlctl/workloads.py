"""Benchmark workloads: request shapes that make pipeline differences visible.

The long-tail response-length distribution is used both by real runs
(`rollout.sampling.long_tail`, each request's max_new_tokens with ignore_eos) and by
`rlctl simulate`, so that a simulated step and a measured one see the same lengths.
"""

from __future__ import annotations

import hashlib
import math
import random
import statistics


class LengthDistribution:
    """Response lengths shaped like RLVR math: most responses near a typical length, and a few
    percent that run to the length limit and carry a large share of the tokens.

    Model: with probability `truncated_fraction` a response is truncated at `max_tokens` (the
    "clip ratio" RL runs report: runaway reasoning and repetition loops); otherwise its length is
    lognormal with median `median_fraction * max_tokens` and log-standard-deviation `sigma`,
    rounded and clipped to [min_tokens, max_tokens].

    Why the defaults (median_fraction 0.095, sigma 0.5, truncated_fraction 0.05): the target is a
    median about 1/10 of the p99 and the longest 5% of responses producing about a third of all
    tokens, the straggler-dominated shape that makes synchronous rollout wait on its tail.
    - p99/median: with more than 1% truncated, the p99 is max_tokens, so p99/median ~= 1 /
      median_fraction ~= 10.5, a little lower (~10.2) because the truncated 5% move the
      median up to the body's 52.6th percentile.
    - top-5% share: the longest 5% are the truncated responses, each max_tokens long, while the
      mean length is t + (1 - t) * f * exp(sigma^2 / 2) of max_tokens, so their share is
      t / (t + (1 - t) * f * exp(sigma^2 / 2)) = 0.05 / (0.05 + 0.95 * 0.095 * 1.133) ~= 0.33.
    A single lognormal cannot do both: a sigma wide enough for a one-third top-5% share (~1.2)
    puts the p99 at ~17x the median, and clipping at max_tokens caps the share near 0.25.
    sigma 0.5 keeps the body tight (its p95 is 2.3x its median), so the tail is the truncations.

    Prompts differ (`prompt_share`): in RLVR a hard problem gets long responses and runs into the
    cap more often, whichever sample it is. With prompt_share r > 0, each prompt has a difficulty
    u ~ N(0, 1), fixed by its text (the same prompt in a later epoch has the same u): its body is
    lognormal around exp(mu + sigma * sqrt(r) * u) with log-standard-deviation sigma * sqrt(1 - r)
    (the body's total log-variance stays sigma^2, r of it shared by a prompt's samples), and it
    is truncated with probability truncated_fraction * exp(sqrt(r) * u - r / 2) (capped at 1),
    whose mean over prompts is truncated_fraction. r = 0: every sample independent of its prompt.
    """

    def __init__(self, max_tokens: int, median_fraction: float = 0.095, sigma: float = 0.5,
                 min_tokens: int = 1, truncated_fraction: float = 0.05, prompt_share: float = 0.0) -> None:
        if not 1 <= min_tokens <= max_tokens:
            raise ValueError(f"need 1 <= min_tokens <= max_tokens, got {min_tokens} and {max_tokens}")
        if not 0 < median_fraction <= 1:
            raise ValueError(f"median_fraction must be in (0, 1], got {median_fraction}")
        if sigma < 0:
            raise ValueError(f"sigma must be >= 0, got {sigma}")
        if not 0 <= truncated_fraction < 1:
            raise ValueError(f"truncated_fraction must be in [0, 1), got {truncated_fraction}")
        if not 0 <= prompt_share < 1:
            raise ValueError(f"prompt_share must be in [0, 1), got {prompt_share}")
        self.max_tokens = max_tokens
        self.min_tokens = min_tokens
        self.median_fraction = median_fraction
        self.sigma = sigma
        self.truncated_fraction = truncated_fraction
        self.prompt_share = prompt_share
        self._mu = math.log(median_fraction * max_tokens)

    def sample(self, rng: random.Random, prompt: str = "") -> int:
        """One response length in tokens, for a sample of `prompt` (its text)."""
        mu, sigma, truncated = self._mu, self.sigma, self.truncated_fraction
        if self.prompt_share:
            u = difficulty(prompt)
            share = math.sqrt(self.prompt_share)
            mu += sigma * share * u
            sigma *= math.sqrt(1.0 - self.prompt_share)
            truncated = min(1.0, truncated * math.exp(share * u - self.prompt_share / 2))
        if rng.random() < truncated:
            return self.max_tokens
        return min(self.max_tokens, max(self.min_tokens, round(rng.lognormvariate(mu, sigma))))


def difficulty(prompt: str) -> float:
    """A prompt's difficulty u ~ N(0, 1), the same for the same text in every run and process."""
    digest = hashlib.blake2b(prompt.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    fraction = (int.from_bytes(digest, "big") + 0.5) / 2**64  # in (0, 1)
    return statistics.NormalDist().inv_cdf(fraction)
