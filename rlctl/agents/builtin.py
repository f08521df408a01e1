"""The built-in environments by name, and the one way a run's environment is made from its
recipe (rollout.multi_turn.environment): a built-in, or the user's class found like a reward
function. The python tool is refused in one line where no sandbox can run."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlctl.agents.calculator import CalculatorEnv
from rlctl.agents.sandbox import PythonEnv, unavailable
from rlctl.recipe import FieldError, MultiTurnConfig

BUILTIN: dict[str, Callable[[], Any]] = {"calculator": CalculatorEnv, "python": PythonEnv}


def environment_factory(cfg: MultiTurnConfig) -> Callable[[], Any]:
    """What makes one trajectory's environment; FieldError (key `environment`) naming the fix."""
    if cfg.environment == "python":
        why = unavailable()
        if why:
            raise FieldError("environment", why)
    if cfg.environment in BUILTIN:
        return BUILTIN[cfg.environment]
    return cfg.load_environment()
