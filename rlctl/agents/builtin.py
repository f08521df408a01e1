"""The built-in environments by name, and the one way a run's environment is made from its
recipe (rollout.multi_turn.environment): a built-in, or the user's class found like a reward
function. The python tool is refused in one line where no sandbox can run."""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any

from rlctl.agents.calculator import CalculatorEnv
from rlctl.agents.sandbox import Limits, PythonEnv, unavailable
from rlctl.recipe import FieldError, MultiTurnConfig

BUILTIN: dict[str, Callable[[MultiTurnConfig], Callable[[], Any]]] = {
    "calculator": lambda cfg: CalculatorEnv,
    # the sandbox is killed at the tool timeout, where the tool worker answers with an error
    "python": lambda cfg: partial(PythonEnv, Limits(seconds=cfg.tool_timeout_s,
                                                    cpu_seconds=max(1, math.ceil(cfg.tool_timeout_s)))),
}
"""Each built-in's factory, made for the recipe's multi_turn section."""


def environment_factory(cfg: MultiTurnConfig) -> Callable[[], Any]:
    """What makes one trajectory's environment; FieldError (key `environment`) naming the fix."""
    if cfg.environment == "python":
        why = unavailable()
        if why:
            raise FieldError("environment", why)
    if cfg.environment in BUILTIN:
        return BUILTIN[cfg.environment](cfg)
    return cfg.load_environment()
