"""What the recipe schema says about a dotted key (its type, the keys beside it), and the
errors of YAML and OmegaConf turned into one RecipeError naming the key and the fix."""

from __future__ import annotations

import enum
import types
import typing
from dataclasses import fields, is_dataclass
from typing import Any

from rlctl.errors import RecipeError
from rlctl.recipe.schema import Recipe


def yaml_where(e: Exception) -> str:
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    if mark is None:
        return "<yaml>"
    return f"line {mark.line + 1}, column {mark.column + 1}"


MOVED = {
    "train.clip_eps": "the clip moved to algo.clip_eps_low and algo.clip_eps_high",
    "train.kl_coef": "the KL penalty moved to algo.kl_coef (with algo.kl_estimator and algo.kl_in)",
}
"""Keys that an older recipe may hold, and where they went."""


def translate_omegaconf_error(e: Exception, file: str, schema: type) -> RecipeError:
    """OmegaConf's error as one line: `file` is where the failing text came from (the recipe or
    "<overrides>"); an unknown key gets the valid ones, a wrong type the expected one, a choice
    outside its enum the choices."""
    from omegaconf.errors import ConfigKeyError, ValidationError

    key = getattr(e, "full_key", None) or "<unknown>"
    msg = getattr(e, "msg", None) or str(e)
    if (isinstance(e, ConfigKeyError) or "not in" in msg) and key in MOVED:
        return RecipeError(file, key, f"unknown key; {MOVED[key]}")
    if isinstance(e, ConfigKeyError) or "not in" in msg:
        parent = key.rpartition(".")[0]
        valid = valid_keys(parent, schema)
        hint = f"valid keys{' under ' + parent if parent else ''}: {', '.join(valid)}" if valid else "remove it"
        return RecipeError(file, key, f"unknown key; {hint}")
    if isinstance(e, ValidationError):
        ftype = field_type(key, schema)
        if isinstance(ftype, type) and issubclass(ftype, enum.Enum):
            choices = ", ".join(m.value for m in ftype)
            return RecipeError(file, key, f"'{getattr(e, 'value', '?')}' is not one of {choices}")
        expected = (getattr(ftype, "__name__", None) or str(ftype).replace("typing.", "")) if ftype else None
        first = msg.splitlines()[0]
        return RecipeError(file, key, f"{first}; expected {expected}" if expected else first)
    return RecipeError(file, key, msg.splitlines()[0])


def unwrap_optional(ftype: Any) -> Any:
    """`X | None` -> X; anything else unchanged."""
    args = [a for a in typing.get_args(ftype) if a is not type(None)]
    return args[0] if typing.get_origin(ftype) in (typing.Union, types.UnionType) and args else ftype


def field_type(key: str, schema: type = Recipe) -> Any:
    """The declared type of the field at a dotted key, or None."""
    cls: Any = schema
    ftype: Any = None
    for part in key.split("."):
        if not is_dataclass(cls):
            return None
        hints = typing.get_type_hints(cls)
        if part not in hints:
            return None
        ftype = hints[part]
        cls = unwrap_optional(ftype)
    return ftype


def valid_keys(parent: str, schema: type = Recipe) -> list[str]:
    cls = unwrap_optional(schema if not parent else field_type(parent, schema))
    return [f.name for f in fields(cls)] if is_dataclass(cls) else []
