"""Verifiers: score a response against the reference answer, returning a reward in [0, 1].

Built by name from the recipe (`reward.verifier`): exact match, numeric match, math equivalence
via math-verify (imported only when chosen), or a user function given by import path.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

from rlctl.errors import RunError
from rlctl.recipe import FieldError, RewardConfig, Verifier

VerifyFn = Callable[[str, str], float]

_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def exact_match(response: str, answer: str) -> float:
    return 1.0 if response.strip() == answer.strip() else 0.0


def numeric_match(response: str, answer: str) -> float:
    """The last number in the response equals the answer (as floats, to 1e-6 relative)."""
    found = _NUMBER.findall(response.replace(",", ""))
    if not found:
        return 0.0
    try:
        got, want = float(found[-1]), float(answer.replace(",", ""))
    except ValueError:
        return 0.0
    return 1.0 if abs(got - want) <= 1e-6 * max(1.0, abs(want)) else 0.0


def math_equivalent(response: str, answer: str) -> float:
    from math_verify import parse, verify

    gold = parse(answer)
    pred = parse(response)
    return 1.0 if gold and pred and verify(gold, pred) else 0.0


def load_user_function(cfg: RewardConfig) -> VerifyFn:
    """reward.function, imported and checked as the recipe's check does (RewardConfig.load_function)."""
    try:
        return cfg.load_function()
    except FieldError as e:
        raise RunError(f"reward.function: {e.message}") from None


def make_verifier(cfg: RewardConfig) -> VerifyFn:
    if cfg.verifier is Verifier.EXACT:
        return exact_match
    if cfg.verifier is Verifier.NUMERIC:
        return numeric_match
    if cfg.verifier is Verifier.MATH:
        return math_equivalent
    user = load_user_function(cfg)

    def checked(response: str, answer: str) -> float:
        value = user(response, answer)
        try:
            reward = float(value)
        except (TypeError, ValueError):
            raise TypeError(f"{cfg.function} returned {value!r:.80}, not a number; return a float in [0, 1]") from None
        if math.isnan(reward):
            raise ValueError(f"{cfg.function} returned nan; return a float in [0, 1]")
        return min(1.0, max(0.0, reward))

    return checked
