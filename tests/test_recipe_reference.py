"""docs/recipe.md is generated from the recipe's own docstrings: every key has one, and the page
is what the generator writes today."""

from __future__ import annotations

from dataclasses import dataclass, field

from conftest import REPO
from rlctl.recipe import (DataConfig, EvalConfig, EvalSet, MixedSource, ModelConfig, ModelInit, Recipe, RewardConfig,
                          recipe_to_dict)
from rlctl.recipe.pool import PoolFile, PoolJob
from rlctl.recipe.reference import REGENERATE, main, parts, render, undocumented


def _leaves(tree: dict, prefix: str = "") -> list[str]:
    """Dotted keys of a recipe as YAML holds it; an empty mapping (slurm.env) is a leaf."""
    keys = []
    for name, value in tree.items():
        if isinstance(value, dict) and value:
            keys += _leaves(value, f"{prefix}{name}.")
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):  # eval.sets[]
            keys += _leaves(value[0], f"{prefix}{name}[].")
        else:
            keys.append(f"{prefix}{name}")
    return keys


def test_every_recipe_and_pool_file_key_has_a_docstring():
    assert undocumented(Recipe) == [], "add a docstring under each of these fields in rlctl/recipe/"
    assert undocumented(PoolFile) == [], "add a docstring under each of these fields in rlctl/recipe/pool.py"


def test_docs_recipe_md_is_what_the_generator_writes():
    page = (REPO / "docs" / "recipe.md").read_text()
    assert page == render(), f"docs/recipe.md is stale; regenerate it: {REGENERATE}"


def test_the_reference_lists_every_key_a_resolved_recipe_holds():
    recipe = Recipe(model=ModelConfig(init=ModelInit()),
                    data=DataConfig(sources=[MixedSource(path="a.jsonl", reward=RewardConfig())]),
                    eval=EvalConfig(sets=[EvalSet(path="heldout.jsonl", reward=RewardConfig())]))
    listed = {k.key for p in parts(Recipe) for k in p.keys}
    resolved = set(_leaves(recipe_to_dict(recipe)))
    assert resolved == listed
    for key in ("rollout.gpus", "train.gpus", "rollout.vllm.tp_size", "rollout.vllm.gpu_memory_utilization",
                "slurm.env", "pool.name", "pool.share", "reward.verifier"):
        assert key in listed


def test_enum_keys_list_their_choices_and_the_page_shows_them():
    keys = {k.key: k for p in parts(Recipe) for k in p.keys}
    assert [v for v, _ in keys["rollout.engine"].choices] == ["builtin", "sglang", "vllm"]
    assert [v for v, _ in keys["launcher"].choices] == ["local", "slurm", "pool"]
    page = render()
    assert "| `rollout.engine` | one of `builtin`, `sglang`, `vllm` | `builtin` |" in page
    assert "| `launcher` | one of `local`, `slurm`, `pool` | `local` |" in page
    assert "| `slurm.env` | dict[str, str] | `{}` |" in page


def test_pool_file_jobs_are_listed_as_items_of_a_list():
    keys = {k.key for p in parts(PoolFile) for k in p.keys}
    assert {f"jobs[].{name}" for name in PoolJob.__dataclass_fields__} <= keys
    assert "pool.devices.count" in keys and "sim.host_bytes_per_s" in keys


@dataclass(kw_only=True)
class _Section:
    documented: int = 1
    """It says what it is."""
    bare: list[int] = field(default_factory=list)


def test_a_field_without_a_docstring_is_named():
    assert undocumented(_Section) == ["bare"]


def test_the_command_takes_no_arguments(capsys):
    assert main(["--write"]) == 2
    assert REGENERATE in capsys.readouterr().err
