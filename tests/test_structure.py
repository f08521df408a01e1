"""The structure check (scripts/check_structure.py) on the repository, and on small made-up trees
that show each rule catching what it should and nothing else."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from conftest import REPO

_spec = importlib.util.spec_from_file_location("check_structure", REPO / "scripts" / "check_structure.py")
structure = importlib.util.module_from_spec(_spec)
sys.modules["check_structure"] = structure  # dataclasses look their module up by name
_spec.loader.exec_module(structure)


def test_the_repository_keeps_its_structure():
    violations = structure.check(REPO)
    assert not violations, "\n".join(map(str, violations))


def write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def function(name: str, lines: int) -> str:
    """A function of exactly `lines` lines, def included."""
    return f"def {name}():\n" + "    x = 1\n" * (lines - 1)


def messages(root: Path) -> list[str]:
    return [v.message for v in structure.check(root)]


def test_long_functions_and_files_are_reported(tmp_path):
    write(tmp_path, {
        "rlctl/__init__.py": "",
        "rlctl/ok.py": function("fits", 60),
        "rlctl/long.py": function("too_long", 61),
        "scripts/big.py": "x = 1\n" * 401,
        "tests/test_nested.py": "class C:\n    " + function("method", 61).replace("\n", "\n    "),
    })
    assert sorted(messages(tmp_path)) == [
        "401 lines (at most 400)",
        "function method is 61 lines (at most 60)",
        "function too_long is 61 lines (at most 60)",
    ]


def test_only_the_batch_script_template_may_be_long(tmp_path):
    write(tmp_path, {
        "rlctl/launchers/slurm/script.py": function("render_batch_script", 140),
        "rlctl/commands/launch.py": function("render_batch_script", 61),
    })
    assert [str(v) for v in structure.check(tmp_path)] == [
        "rlctl/commands/launch.py:1: function render_batch_script is 61 lines (at most 60)"]


def test_an_upward_import_inside_a_function_is_reported(tmp_path):
    write(tmp_path, {
        "rlctl/recipe/__init__.py": "from rlctl.recipe.schema import Recipe\n",
        "rlctl/recipe/schema.py": "def validate():\n    from rlctl.sim.cost import estimate\n",
        "rlctl/sim/cost.py": "from rlctl.recipe import Recipe\nfrom rlctl.errors import RunError\n",
        "rlctl/errors.py": "",
    })
    assert [str(v) for v in structure.check(tmp_path)] == [
        "rlctl/recipe/schema.py:2: rlctl.recipe.schema -> rlctl.sim.cost (layer schema may not import layer simulation)"]


def test_from_package_import_module_is_an_import_of_that_module(tmp_path):
    write(tmp_path, {
        "rlctl/launchers/__init__.py": "",
        "rlctl/launchers/slurm.py": "",
        "rlctl/rundir.py": "from rlctl.launchers import slurm\n",
        "rlctl/worker.py": "from rlctl import rundir\n",
    })
    assert messages(tmp_path) == [
        "rlctl.rundir -> rlctl.launchers.slurm (layer foundation may not import layer orchestration)"]


def test_relative_imports_resolve_inside_the_package(tmp_path):
    write(tmp_path, {
        "rlctl/engines/__init__.py": "",
        "rlctl/engines/train/__init__.py": "",
        "rlctl/engines/train/engine.py": "from ..weightsync import send\nfrom ... import controller\n",
        "rlctl/engines/weightsync.py": "",
        "rlctl/controller.py": "",
    })
    assert messages(tmp_path) == [
        "rlctl.engines.train.engine -> rlctl.controller (layer engines may not import layer orchestration)"]


@pytest.mark.parametrize("module, layer", [
    ("rlctl.cli", "INTERFACE"),
    ("rlctl.commands.status", "INTERFACE"),
    ("rlctl.launchers.slurm.script", "ORCHESTRATION"),
    ("rlctl.launchers.some_new_helpers", "ORCHESTRATION"),
    ("rlctl.controller", "ORCHESTRATION"),
    ("rlctl.status", "ORCHESTRATION"),
    ("rlctl.sim.run", "SIMULATION"),
    ("rlctl.pipelines.core", "SCHEDULING"),
    ("rlctl.engines.train.client", "ENGINES"),
    ("rlctl.rundir", "FOUNDATION"),
    ("rlctl.metrics.step", "FOUNDATION"),
    ("rlctl.a_new_module", "FOUNDATION"),
    ("rlctl.recipe", "SCHEMA"),
    ("rlctl.recipe.schema", "SCHEMA"),
    ("rlctl.errors", "SCHEMA"),
])
def test_layers_go_by_the_longest_module_prefix(module, layer):
    assert structure.layer_of(module) is structure.Layer[layer]


def test_a_name_that_only_starts_like_a_layer_is_not_in_it():
    assert structure.layer_of("rlctl.recipes_helper") is structure.Layer.FOUNDATION
    assert structure.layer_of("rlctl.cli_extras") is structure.Layer.FOUNDATION
