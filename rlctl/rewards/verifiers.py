"""Verifiers: score a response against the reference answer, returning a reward in [0, 1].

Built by name from the recipe (`reward.verifier`): exact match, numeric match, math equivalence
via math-verify (imported only when chosen), or a user function given by import path.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable

from rlctl.errors import RunError
from rlctl.recipe import RewardConfig, Verifier

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


def load_user_function(path: str) -> VerifyFn:
    module_name, _, attr = path.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise RunError(f"reward.function: cannot load '{path}' ({e}); check the import path") from None
    if not callable(fn):
        raise RunError(f"reward.function: '{path}' is not callable")
    return fn


def make_verifier(cfg: RewardConfig) -> VerifyFn:
    if cfg.verifier is Verifier.EXACT:
        return exact_match
    if cfg.verifier is Verifier.NUMERIC:
        return numeric_match
    if cfg.verifier is Verifier.MATH:
        return math_equivalent
    assert cfg.function is not None
    user = load_user_function(cfg.function)

    def checked(response: str, answer: str) -> float:
        return min(1.0, max(0.0, float(user(response, answer))))

    return checked
