"""Verifiers: score a response against the reference answer, returning a reward in [0, 1].

Built by name from the recipe (`reward.verifier`): exact match, numeric match, math equivalence
via math-verify (imported only when chosen), or a user function given by import path, called
with the row's fields by name (rlctl/recipe/reward_call.py) and returning a number or a dict of
named scores.
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rlctl.errors import RunError
from rlctl.recipe import FieldError, RewardConfig, Verifier
from rlctl.recipe.reward_call import RewardCall

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


def load_user_function(cfg: RewardConfig) -> Callable[..., Any]:
    """reward.function, imported and checked as the recipe's check does (RewardConfig.load_function)."""
    try:
        return cfg.load_function()
    except FieldError as e:
        raise RunError(f"reward.function: {e.message}") from None


@dataclass(frozen=True)
class Scored:
    """A verifier's verdict on one response."""

    reward: float
    """In [0, 1]."""
    scores: dict[str, float] = field(default_factory=dict)
    """The named scores a reward function returned as a dict (empty for a number)."""


Verify = Callable[[str, str, Any, Mapping[str, Any]], Scored]
"""(response text, answer, prompt, the row's fields) -> Scored. The built-in verifiers look at
the first two only."""


def scored_by(fn: VerifyFn) -> Verify:
    """A verifier of (response, answer) -> reward as a Verify that ignores the prompt and the row."""
    return lambda response, answer, prompt=None, row=None: Scored(fn(response, answer))


def make_verifier(cfg: RewardConfig) -> Verify:
    builtin: VerifyFn | None = {Verifier.EXACT: exact_match, Verifier.NUMERIC: numeric_match,
                                Verifier.MATH: math_equivalent}.get(cfg.verifier)
    if builtin is not None:
        return scored_by(builtin)
    user = load_user_function(cfg)
    call = RewardCall.of(inspect.signature(user))

    def checked(response: str, answer: str, prompt: Any = None, row: Mapping[str, Any] | None = None) -> Scored:
        try:
            args, kwargs = call.arguments(response, answer, prompt, row or {})
        except KeyError as e:
            raise KeyError(f"the row has no field {e}, which {cfg.function} takes; give every row that field or "
                           "the parameter a default") from None
        return scored(user(*args, **kwargs), cfg)

    return checked


def scored(value: Any, cfg: RewardConfig) -> Scored:
    """A reward function's return value as a Scored: a number, or a dict of named numbers whose
    sum (or reward.score_key's entry) is the reward, clipped to [0, 1]."""
    scores: dict[str, float] = {}
    if isinstance(value, Mapping):
        scores = {str(k): _number(v, f"{cfg.function} returned {{..., {k!r}: {v!r:.40}}}") for k, v in value.items()}
        if cfg.score_key is not None and cfg.score_key not in scores:
            raise KeyError(f"{cfg.function} returned a dict without '{cfg.score_key}' (reward.score_key): "
                           f"{sorted(scores)}")
        reward = scores[cfg.score_key] if cfg.score_key is not None else sum(scores.values())
    else:
        reward = _number(value, f"{cfg.function} returned {value!r:.80}")
    return Scored(min(1.0, max(0.0, reward)), scores)


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool):
        return float(value)
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{what}, not a number; return a float in [0, 1] or a dict of named floats") from None
    if math.isnan(number):
        raise ValueError(f"{what}: nan; return a float in [0, 1] or a dict of named floats")
    return number
