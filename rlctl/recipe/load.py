"""Reading a recipe: YAML text and `key=value` overrides -> a checked `Recipe`.

YAML (safe loader) -> OmegaConf merge onto the structured schema (unknown keys, wrong types and
choices outside their enum fail here) -> dataclass instance -> every section's `check()`
(values that are well-typed but impossible). Every failure raises `RecipeError(file, key,
message)`, `file` being the recipe or, for a key set on the command line, "<overrides>". The
CLI prints it as one line and exits 2: the key and every long value in the message are cut to
80 characters (checks.clip_message), control characters escaped.

The YAML of the recipe and of each override's value is parsed within bounds first
(rlctl/recipe/bounded_yaml.py: size, nesting depth, values with aliases expanded), so that no
input keeps the command busy or fills the terminal: every refusal comes in well under a second.
"""

from __future__ import annotations

import enum
import functools
import os
import typing
from collections.abc import Callable, Iterator, Sequence
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

from rlctl.errors import RecipeError
from rlctl.recipe.bounded_yaml import MAX_OVERRIDE_BYTES, MAX_RECIPE_BYTES, SAFE_LOADER, YamlLimit, parse_bounded
from rlctl.recipe.checks import FieldError, Section, check_numbers, check_text, clip, clip_message
from rlctl.recipe.choices import Launcher
from rlctl.recipe.pool import PoolFile
from rlctl.recipe.schema import Recipe
from rlctl.recipe.schema_errors import field_type, translate_omegaconf_error, unwrap_optional, yaml_where


def _one_line_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """RecipeErrors leave `fn` on one line: the key cut to 80 characters, long values in the
    message cut (checks.clip_message), control characters escaped."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except RecipeError as e:
            file, key, message = clip(e.file, 300), clip(e.key, 80), clip_message(e.message)
            if (file, key, message) == (e.file, e.key, e.message):
                raise
            raise RecipeError(file, key, message) from None
    return wrapper


@_one_line_errors
def load_recipe(path: str | os.PathLike[str], overrides: Sequence[str] = (), check_paths: bool = True) -> Recipe:
    """Read a recipe file, apply `key=value` overrides, and return a checked Recipe.

    check_paths=False skips the checks that local files exist (model, data): a simulation of a
    cluster run needs neither. A launcher=slurm recipe names the cluster's paths, which this
    machine need not hold: the job checks them on its first node (rlctl/launchers/slurm/steps.py)."""
    file = str(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_RECIPE_BYTES + 1)  # never more: a recipe of 50 MB is refused unread
        if len(raw) > MAX_RECIPE_BYTES:
            raise RecipeError(file, "<file>", f"larger than {MAX_RECIPE_BYTES >> 20} MiB; a recipe is a few KiB")
        text = raw.decode()
    except FileNotFoundError:
        raise RecipeError(file, "<file>", "no such file; check the path") from None
    except (OSError, UnicodeDecodeError) as e:
        raise RecipeError(file, "<file>", f"cannot read it ({e.__class__.__name__}: {e})") from None
    try:
        recipe = recipe_from_yaml(text, file, model_on_the_command_line(overrides))
        _resolve_relative_paths(recipe, Path(path).resolve().parent)
        check_recipe(recipe, file, check_paths and recipe.launcher is Launcher.LOCAL)
    except RecipeError as e:
        raise blame_overrides(e, file, overrides) from None
    return recipe


def blame_overrides(error: RecipeError, file: str, overrides: Sequence[str]) -> RecipeError:
    """A value check names where the value came from: a key set on the command line (or inside a
    section set there, `eval={...}`) is "<overrides>", not the recipe file, which may not hold it."""
    keys = [item.partition("=")[0].strip() for item in overrides if "=" in item]
    if error.file == file and any(error.key == k or error.key.startswith((k + ".", k + "[")) for k in keys):
        return RecipeError("<overrides>", error.key, error.message)
    return error


def model_on_the_command_line(overrides: Sequence[str]) -> list[str]:
    """The one rule for a model named on the command line: `model.path=X` replaces the recipe's
    model.init (a recipe that builds the tiny model runs on X instead), unless the command line
    sets model.init too, which is then refused as a recipe that names both."""
    keys = [item.partition("=")[0].strip() for item in overrides]
    if "model.path" in keys and not any(k == "model.init" or k.startswith("model.init.") for k in keys):
        return ["model.init=null", *overrides]
    return list(overrides)


@_one_line_errors
def check_recipe(recipe: Recipe, file: str, check_paths: bool = True) -> None:
    """Every section's own checks, top to bottom (its numbers first: checks.check_numbers; its
    strings after: checks.check_text), then those spanning sections."""
    for key, section in _sections(recipe, ""):
        try:
            check_numbers(section)
            if section is not recipe:
                section.check()
            check_text(section)
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
        name = f"{key}.{f.name}" if key else f.name
        if isinstance(value, Section):
            yield from _sections(value, name)
        elif isinstance(value, list):  # a list of sections (eval.sets): each item, as name[i]
            for i, item in enumerate(value):
                if isinstance(item, Section):
                    yield from _sections(item, f"{name}[{i}]")


@_one_line_errors
def recipe_from_yaml(text: str, file: str, overrides: Sequence[str] = ()) -> Recipe:
    """Parse (within bounds) and merge onto the schema; no value checks (see check_recipe)."""
    data = _parse(text, file)
    overrides = _drop_retired_keys(data, overrides, file)
    obj = structured_from_data(Recipe, data, file, overrides)
    assert isinstance(obj, Recipe)
    return obj


def _parse(text: str, file: str) -> dict:
    import yaml

    try:
        data = parse_bounded(text, SAFE_LOADER, MAX_RECIPE_BYTES)
    except YamlLimit as e:
        raise RecipeError(file, yaml_where(e) if e.problem_mark else "<file>", e.message) from None
    except yaml.constructor.ConstructorError as e:
        raise RecipeError(file, yaml_where(e), f"unsafe or unknown YAML tag ({e.problem}); recipes are plain YAML") from None
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise RecipeError(file, yaml_where(e), f"malformed YAML: {problem}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(file, "<top level>", f"a recipe is a mapping of sections, got {type(data).__name__}")
    return data


@functools.cache
def _schema_config(schema: type) -> Any:
    """OmegaConf.structured(schema), built once per process: it takes about 50 ms for Recipe,
    which a sweep or `rlctl plan --simulate` would pay for every recipe it loads. Only ever
    passed to OmegaConf.merge, which merges into a copy of it: no load changes it."""
    from omegaconf import OmegaConf

    return OmegaConf.structured(schema)


def structured_from_data(schema: type, data: dict, file: str, overrides: Sequence[str] = ()) -> Any:
    """Parsed YAML merged onto a schema dataclass (Recipe, PoolFile), then the overrides; unknown
    keys, wrong types and choices outside their enum raise RecipeError. No value checks."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    current_file = file
    try:
        _check_list_items(schema, data, file, "")
        cfg = OmegaConf.merge(_schema_config(schema), OmegaConf.create(data))  # a copy of the cached config
        current_file = "<overrides>"
        for item in overrides:
            if "=" not in item:
                raise RecipeError(current_file, item, "an override is KEY=VALUE, e.g. run.steps=10")
            key = item.partition("=")[0].strip()
            if "[" in key or any(part.isdigit() for part in key.split(".")):
                raise RecipeError(current_file, key, "an item of a list is not set on its own: give the whole list, "
                                                     "e.g. eval.sets=[{path: test.parquet, limit: 16}]")
            _check_not_a_section(schema, key, item.partition("=")[2].strip(), current_file)
            override = _override(item)
            _check_list_items(schema, OmegaConf.to_container(override), current_file, "")
            cfg = OmegaConf.merge(cfg, override)
        return OmegaConf.to_object(cfg)
    except OmegaConfBaseException as e:
        raise translate_omegaconf_error(e, current_file, schema) from None


def _check_not_a_section(schema: type, key: str, value: str, file: str) -> None:
    """`colocate=true`: a section given a plain value (OmegaConf's own error names neither the
    key nor the fix). A mapping (`colocate={enabled: true}`) is a section's value, and null
    that of an optional one (OmegaConf checks that it is optional)."""
    section = unwrap_optional(field_type(key, schema))
    if is_dataclass(section) and not value.startswith("{") and value not in ("null", "~"):
        keys = ", ".join(f"{key}.{f.name}" for f in fields(section))
        raise RecipeError(file, key, f"is a section, not a value; set one of its keys ({keys}), "
                                     f"e.g. {key}.{fields(section)[0].name}=...")


def _check_list_items(schema: type, data: Any, file: str, prefix: str) -> None:
    """Each item of a list of sections (eval.sets, a pool file's jobs) merged onto its own
    schema first: OmegaConf names an item's bad key without the list's path (`bogus`, not
    `eval.sets[0].bogus`), so the error is raised here, with it."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if not is_dataclass(schema) or not isinstance(data, dict):
        return
    hints = typing.get_type_hints(schema)
    for name, value in data.items():
        ftype = unwrap_optional(hints.get(name)) if isinstance(name, str) else None
        key = f"{prefix}{name}"
        if typing.get_origin(ftype) is list and isinstance(value, list):
            (item_type,) = typing.get_args(ftype) or (None,)
            if not is_dataclass(item_type):
                continue
            for i, item in enumerate(value):
                try:
                    OmegaConf.to_object(OmegaConf.merge(_schema_config(item_type), OmegaConf.create(item)))
                except OmegaConfBaseException as e:
                    error = translate_omegaconf_error(e, file, item_type)
                    raise RecipeError(error.file, f"{key}[{i}].{error.key}", error.message) from None
        elif is_dataclass(ftype):
            _check_list_items(ftype, value, file, f"{key}.")


@_one_line_errors
def load_pool_file(path: str | os.PathLike[str], overrides: Sequence[str] = ()) -> PoolFile:
    """Read a pool file (rlctl/recipe/pool.py) like a recipe: bounded YAML, the strict schema, every
    section's checks; job recipes are resolved relative to the file (not loaded here)."""
    file = str(path)
    try:
        text = Path(path).read_bytes()[:MAX_RECIPE_BYTES + 1].decode()
    except FileNotFoundError:
        raise RecipeError(file, "<file>", "no such file; check the path") from None
    except (OSError, UnicodeDecodeError) as e:
        raise RecipeError(file, "<file>", f"cannot read it ({e.__class__.__name__}: {e})") from None
    if len(text) > MAX_RECIPE_BYTES:
        raise RecipeError(file, "<file>", f"larger than {MAX_RECIPE_BYTES >> 20} MiB; a pool file is a few KiB")
    try:
        spec = structured_from_data(PoolFile, _parse(text, file), file, overrides)
        for key, section in _sections(spec, ""):  # the jobs too, as jobs[i]
            try:
                check_numbers(section)
                section.check()
                check_text(section)
            except FieldError as e:
                raise RecipeError(file, ".".join(k for k in (key, e.key) if k), e.message) from None
    except RecipeError as e:
        raise blame_overrides(e, file, overrides) from None
    base = Path(path).resolve().parent
    for job in spec.jobs:
        if not os.path.isabs(os.path.expanduser(job.recipe)):
            job.recipe = str(base / job.recipe)
    return spec


def _drop_retired_keys(data: dict, overrides: Sequence[str], file: str) -> list[str]:
    """A retired key (RETIRED_KEYS) set to something is an error that says why; left empty (an
    older run's resolved recipe) it is dropped. Returns the overrides without those."""
    from rlctl.recipe.rollout import RETIRED_KEYS

    kept = []
    for item in overrides:
        key, _, value = item.partition("=")
        if key.strip() in RETIRED_KEYS:
            if value.strip() not in ("", "''", '""', "null"):
                raise RecipeError("<overrides>", key.strip(), RETIRED_KEYS[key.strip()])
            continue
        kept.append(item)
    for key, why in RETIRED_KEYS.items():
        *parents, leaf = key.split(".")
        section = data
        for part in parents:
            section = section.get(part) if isinstance(section, dict) else None
        if isinstance(section, dict) and leaf in section:
            if section.pop(leaf) not in (None, ""):
                raise RecipeError(file, key, why)
    return kept


def _override(item: str) -> Any:
    """One `key=value` as OmegaConf.from_dotlist makes it, the value parsed by OmegaConf's own
    YAML loader (so `1e-3` is a float, as before) but within bounds (bounded_yaml.py)."""
    import yaml
    from omegaconf import OmegaConf

    try:
        from omegaconf._yaml import get_yaml_loader
        loader = get_yaml_loader()
    except ImportError:  # another OmegaConf layout: the safe loader parses the same flow values
        loader = SAFE_LOADER
    key, _, value = item.partition("=")
    try:
        parsed = parse_bounded(value, loader, MAX_OVERRIDE_BYTES)
    except YamlLimit as e:
        raise RecipeError("<overrides>", key, f"the value: {e.message}") from None
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise RecipeError("<overrides>", key, f"malformed YAML value: {problem}") from None
    part = OmegaConf.create()
    OmegaConf.update(part, key, parsed)
    return part


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
    model = recipe.model
    if model.path and not os.path.isabs(os.path.expanduser(model.path)) and (base / model.path).exists():
        model.path = str(base / model.path)
    recipe.data.resolve(base)
    recipe.reward.resolve(base)
    recipe.rollout.multi_turn.resolve(base)
    for eval_set in recipe.eval.sets:
        eval_set.resolve(base)
