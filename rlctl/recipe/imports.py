"""`module:name` in a recipe (reward.function, rollout.multi_turn.environment): imported from the
Python path, then from the section's module_dir (the recipe's directory by default), with every
failure a FieldError naming the key and the fix."""

from __future__ import annotations

import importlib
import sys
from typing import Any

from rlctl.recipe.checks import FieldError


def check_spec(key: str, spec: str | None, example: str, noun: str = "name") -> None:
    module, _, attr = (spec or "").partition(":")
    if not module or not attr:
        raise FieldError(key, f"'{spec or ''}' is not of the form module:{noun} (e.g. {example})")


def import_object(key: str, spec: str, module_dir: str | None, what: str = "name") -> Any:
    """The object `spec` (module:name) names; module_dir is searched after the Python path, so a
    file beside the recipe never shadows a library."""
    module_name, _, attr = spec.partition(":")
    where = f"in {module_dir} or on the Python path" if module_dir else "on the Python path"
    file = module_name.replace(".", "/") + ".py"
    if module_dir and module_dir not in sys.path:
        sys.path.append(module_dir)
    importlib.invalidate_caches()
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and (module_name + ".").startswith(e.name + "."):
            raise FieldError(key, f"no module '{module_name}' {where}; fix the name, or put {file} "
                                  f"{'in ' + module_dir if module_dir else 'on the Python path'}") from None
        raise FieldError(key, f"importing '{module_name}' failed ({e}); install what it imports") from None
    except Exception as e:  # noqa: BLE001 - the user's module may raise anything at import
        raise FieldError(key, f"importing '{module_name}' raised {type(e).__name__}: {e}; fix the module") from None
    obj = getattr(module, attr, None)
    if obj is None:
        raise FieldError(key, f"module '{module_name}' ({getattr(module, '__file__', '?')}) has no '{attr}'; "
                              f"name a {what} defined in it")
    return obj
