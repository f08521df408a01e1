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
        "rlctl/recipe/schema.py": "def validate():\n    from rlctl.costs.model import estimate\n",
        "rlctl/costs/model.py": "from rlctl.recipe.choices import GpuKind\nfrom rlctl.errors import RunError\n",
        "rlctl/recipe/choices.py": "",
        "rlctl/errors.py": "",
    })
    assert [str(v) for v in structure.check(tmp_path)] == [
        "rlctl/recipe/schema.py:2: rlctl.recipe.schema -> rlctl.costs.model (layer schema may not import layer simulation)"]


def test_from_package_import_module_is_an_import_of_that_module(tmp_path):
    write(tmp_path, {
        "rlctl/launchers/__init__.py": "",
        "rlctl/launchers/slurm.py": "",
        "rlctl/run/dir.py": "from rlctl.launchers import slurm\n",
        "rlctl/worker.py": "from rlctl.run import dir\n",
    })
    assert messages(tmp_path) == [
        "rlctl.run.dir -> rlctl.launchers.slurm (layer foundation may not import layer orchestration)"]


def test_relative_imports_resolve_inside_the_package(tmp_path):
    write(tmp_path, {
        "rlctl/engines/__init__.py": "",
        "rlctl/engines/train/__init__.py": "",
        "rlctl/engines/train/engine.py": "from ..weightsync import send\nfrom ...control import controller\n",
        "rlctl/engines/weightsync.py": "",
        "rlctl/control/controller.py": "",
    })
    assert messages(tmp_path) == [
        "rlctl.engines.train.engine -> rlctl.control.controller (layer engines may not import layer orchestration)"]


@pytest.mark.parametrize("module, layer", [
    ("rlctl.cli", "INTERFACE"),
    ("rlctl.commands.status", "INTERFACE"),
    ("rlctl.launchers.slurm.script", "ORCHESTRATION"),
    ("rlctl.launchers.some_new_helpers", "ORCHESTRATION"),
    ("rlctl.control.controller", "ORCHESTRATION"),
    ("rlctl.launchers.status", "ORCHESTRATION"),
    ("rlctl.sim.run", "SIMULATION"),
    ("rlctl.pipelines.core", "SCHEDULING"),
    ("rlctl.engines.train.client", "ENGINES"),
    ("rlctl.run.dir", "FOUNDATION"),
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


def test_two_modules_that_import_each_other_are_a_cycle(tmp_path):
    write(tmp_path, {
        "rlctl/__init__.py": "",
        "rlctl/a.py": "import os\nfrom rlctl.b import g\n",
        "rlctl/b.py": "from rlctl import a\n",
    })
    assert [str(v) for v in structure.check(tmp_path)] == [
        "rlctl/a.py:2: import cycle: rlctl.a -> rlctl.b -> rlctl.a"]


def test_a_cycle_through_three_modules_is_reported_once_in_order(tmp_path):
    write(tmp_path, {
        "rlctl/pipelines/__init__.py": "",
        "rlctl/pipelines/core.py": "from rlctl.pipelines.servers import ServerSet\n",
        "rlctl/pipelines/servers.py": "from .protocols import Rollout\n",
        "rlctl/pipelines/protocols.py": "from rlctl.pipelines.core import Sample\n",
    })
    assert [str(v) for v in structure.check(tmp_path)] == [
        "rlctl/pipelines/core.py:1: import cycle: rlctl.pipelines.core -> rlctl.pipelines.servers"
        " -> rlctl.pipelines.protocols -> rlctl.pipelines.core"]


@pytest.mark.parametrize("closing", [
    "def schedule():\n    from rlctl.planner.estimate import Estimate\n",
    "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from rlctl.planner.estimate import Estimate\n",
])
def test_an_import_in_a_function_or_for_type_checking_closes_a_cycle(tmp_path, closing):
    write(tmp_path, {
        "rlctl/planner/estimate.py": "from rlctl.planner.schedule import schedule\n",
        "rlctl/planner/schedule.py": closing,
    })
    assert messages(tmp_path) == [
        "import cycle: rlctl.planner.estimate -> rlctl.planner.schedule -> rlctl.planner.estimate"]


def test_imports_that_only_point_one_way_are_no_cycle(tmp_path):
    """A package's __init__ re-exports its submodules and they import each other by full name:
    the package is imported first at run time, but no file names it, so there is no cycle."""
    write(tmp_path, {
        "rlctl/__init__.py": "",
        "rlctl/sim/__init__.py": "from rlctl.costs.model import CostModel\nfrom rlctl.sim.run import simulate\n",
        "rlctl/costs/model.py": "from rlctl.recipe import Recipe\n",
        "rlctl/sim/run.py": ("import rlctl.costs.model\nfrom rlctl.costs import model\n\n"
                             "def f():\n    from rlctl.costs.model import x\n"),
        "rlctl/costs/recipe.py": "from rlctl.sim import CostModel\nfrom rlctl.sim.run import simulate\n",
        "rlctl/recipe/__init__.py": "",
    })
    assert messages(tmp_path) == []


def test_a_submodule_that_imports_its_own_package_closes_a_cycle(tmp_path):
    write(tmp_path, {
        "rlctl/sim/__init__.py": "from rlctl.sim.run import simulate\n",
        "rlctl/sim/run.py": "from rlctl.costs.model import x\nfrom rlctl.sim import CostModel\n",
        "rlctl/costs/model.py": "",
    })
    assert [str(v) for v in structure.check(tmp_path)] == [
        "rlctl/sim/__init__.py:1: import cycle: rlctl.sim -> rlctl.sim.run -> rlctl.sim"]


def test_a_larger_group_of_cycles_names_every_module(tmp_path):
    write(tmp_path, {
        "rlctl/a.py": "from rlctl import b\n",
        "rlctl/b.py": "from rlctl import a, c\n",
        "rlctl/c.py": "from rlctl import b\n",
    })
    assert messages(tmp_path) == ["import cycle: rlctl.a -> rlctl.b -> rlctl.a (in the same cycles: rlctl.c)"]


def test_a_branch_on_an_engine_kind_outside_its_adapter_is_reported(tmp_path):
    branchy = ("from rlctl.recipe import RolloutEngine\n"
               "def f(recipe):\n"
               "    if recipe.rollout.engine is RolloutEngine.SGLANG:\n"
               "        return 1\n"
               "    return recipe.rollout.protocol == 'vllm'\n")
    root = write(tmp_path, {"rlctl/__init__.py": "", "rlctl/recipe/__init__.py": "", "rlctl/control/controller.py": branchy,
                            "rlctl/engines/rollout/sglang/adapter.py": branchy,
                            "rlctl/engines/rollout/registry.py": branchy, "tests/test_x.py": branchy})
    found = [str(v) for v in structure.check(root)]
    assert found == ["rlctl/control/controller.py:3: branch on RolloutEngine.SGLANG: ask the engine's adapter",
                     "rlctl/control/controller.py:5: branch on the protocol by name: ask the engine's adapter"]
