"""Reading a recipe: YAML text and `key=value` overrides -> a checked `Recipe`.

YAML (safe loader) -> OmegaConf merge onto the structured schema (unknown keys, wrong types and
choices outside their enum fail here) -> dataclass instance -> every section's `check()`
(values that are well-typed but impossible). Every failure raises `RecipeError(file, key,
message)`, which the CLI prints as one line and exits 2.
"""

from __future__ import annotations

import enum
import os
import types
import typing
from collections.abc import Iterator, Sequence
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

from rlctl.errors import RecipeError
from rlctl.recipe.checks import FieldError, Section
from rlctl.recipe.choices import Launcher
from rlctl.recipe.schema import Recipe


def load_recipe(path: str | os.PathLike[str], overrides: Sequence[str] = (), check_paths: bool = True) -> Recipe:
    """Read a recipe file, apply `key=value` overrides, and return a checked Recipe.

    check_paths=False skips the checks that local files exist (model, data): a simulation of a
    cluster run needs neither. A launcher=slurm recipe names the cluster's paths, which this
    machine need not hold: the job checks them on its first node (rlctl/launchers/slurm_job.py)."""
    file = str(path)
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise RecipeError(file, "<file>", "no such file; check the path") from None
    except (OSError, UnicodeDecodeError) as e:
        raise RecipeError(file, "<file>", f"cannot read it ({e.__class__.__name__}: {e})") from None
    recipe = recipe_from_yaml(text, file, overrides)
    _resolve_relative_paths(recipe, Path(path).resolve().parent)
    check_recipe(recipe, file, check_paths and recipe.launcher is Launcher.LOCAL)
    return recipe


def check_recipe(recipe: Recipe, file: str, check_paths: bool = True) -> None:
    """Every section's own checks, top to bottom, then those spanning sections."""
    for key, section in _sections(recipe, ""):
        try:
            if section is not recipe:
                section.check()
            if check_paths:
                section.check_files()
        except FieldError as e:
            raise RecipeError(file, ".".join(k for k in (key, e.key) if k), e.message) from None
    try:
        recipe.check()
    except FieldError as e:
        raise RecipeError(file, e.key, e.message) from None


def _sections(obj: Section, key: str) -> Iterator[tuple[str, Section]]:
    yield key, obj
    for f in fields(obj):  # type: ignore[arg-type]
        value = getattr(obj, f.name)
        if isinstance(value, Section):
            yield from _sections(value, f"{key}.{f.name}" if key else f.name)


def recipe_from_yaml(text: str, file: str, overrides: Sequence[str] = ()) -> Recipe:
    """Parse and merge onto the schema; no value checks (see check_recipe)."""
    import yaml
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        data = yaml.safe_load(text)
    except yaml.constructor.ConstructorError as e:
        raise RecipeError(file, _yaml_where(e), f"unsafe or unknown YAML tag ({e.problem}); recipes are plain YAML") from None
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise RecipeError(file, _yaml_where(e), f"malformed YAML: {problem}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(file, "<top level>", f"a recipe is a mapping of sections, got {type(data).__name__}")

    current_file = file
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(Recipe), OmegaConf.create(data))
        current_file = "<overrides>"
        for item in overrides:
            if "=" not in item:
                raise RecipeError(current_file, item, "an override is KEY=VALUE, e.g. run.steps=10")
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([item]))
        obj = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as e:
        raise _translate_omegaconf_error(e, file, current_file) from None
    assert isinstance(obj, Recipe)
    return obj


def recipe_to_yaml(recipe: Recipe) -> str:
    """The resolved recipe as YAML, choices written as in a recipe (`mode: sync`), so that it
    loads back into an equal Recipe."""
    import yaml

    return yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False, allow_unicode=True, default_flow_style=False)


def recipe_to_dict(obj: Any) -> Any:
    """A recipe (or any section) as plain dicts, lists and scalars, choices as their strings:
    what a tracker's config or a JSON file takes."""
    if is_dataclass(obj):
        return {f.name: recipe_to_dict(getattr(obj, f.name)) for f in fields(obj)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, list):
        return [recipe_to_dict(x) for x in obj]
    return obj


def _resolve_relative_paths(recipe: Recipe, base: Path) -> None:
    """Paths in a recipe are relative to the recipe file, as users expect from config files."""
    for section in (recipe.model, recipe.data):
        if section.path and not os.path.isabs(os.path.expanduser(section.path)) and (base / section.path).exists():
            section.path = str(base / section.path)


def _yaml_where(e: Exception) -> str:
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    if mark is None:
        return "<yaml>"
    return f"line {mark.line + 1}, column {mark.column + 1}"


def _translate_omegaconf_error(e: Exception, recipe_file: str, file: str) -> RecipeError:
    """`file` is where the failing text came from (the recipe or "<overrides>"). A choice outside
    its enum is a value error, and names the recipe like every other value check does."""
    from omegaconf.errors import ConfigKeyError, ValidationError

    key = getattr(e, "full_key", None) or "<unknown>"
    msg = getattr(e, "msg", None) or str(e)
    if isinstance(e, ConfigKeyError) or "not in" in msg:
        parent = key.rpartition(".")[0]
        valid = _valid_keys(parent)
        hint = f"valid keys{' under ' + parent if parent else ''}: {', '.join(valid)}" if valid else "remove it"
        return RecipeError(file, key, f"unknown key; {hint}")
    if isinstance(e, ValidationError):
        ftype = _field_type(key)
        if isinstance(ftype, type) and issubclass(ftype, enum.Enum):
            choices = ", ".join(m.value for m in ftype)
            return RecipeError(recipe_file, key, f"'{getattr(e, 'value', '?')}' is not one of {choices}")
        expected = (getattr(ftype, "__name__", None) or str(ftype).replace("typing.", "")) if ftype else None
        first = msg.splitlines()[0]
        return RecipeError(file, key, f"{first}; expected {expected}" if expected else first)
    return RecipeError(file, key, msg.splitlines()[0])


def _unwrap_optional(ftype: Any) -> Any:
    """`X | None` -> X; anything else unchanged."""
    args = [a for a in typing.get_args(ftype) if a is not type(None)]
    return args[0] if typing.get_origin(ftype) in (typing.Union, types.UnionType) and args else ftype


def _field_type(key: str) -> Any:
    """The declared type of the field at a dotted key, or None."""
    cls: Any = Recipe
    ftype: Any = None
    for part in key.split("."):
        if not is_dataclass(cls):
            return None
        hints = typing.get_type_hints(cls)
        if part not in hints:
            return None
        ftype = hints[part]
        cls = _unwrap_optional(ftype)
    return ftype


def _valid_keys(parent: str) -> list[str]:
    cls = _unwrap_optional(Recipe if not parent else _field_type(parent))
    return [f.name for f in fields(cls)] if is_dataclass(cls) else []
