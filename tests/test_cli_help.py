"""The command line's own conventions: flags shown as flags in every --help, shell completion, and a
start that imports nothing heavy before a command needs it."""

from __future__ import annotations

import ast
import sys

import pytest

from conftest import REPO, rlctl, rlctl_here

HEAVY = ("omegaconf", "yaml", "torch", "transformers", "wandb", "numpy", "pydantic", "markdown_it", "pygments")
"""What `rlctl --help` and `rlctl status` must not import: the recipe's parsers, the engines, and
what Typer would bring for its Markdown help and its value conversion (rlctl/cli.py)."""

COMMANDS = ["launch", "status", "cancel", "logs", "simulate", "trace", "compare", "resume", "export",
            "pool up", "pool down", "pool status"]


@pytest.mark.parametrize("command", ["", *COMMANDS])
def test_help_shows_flags_as_flags(tmp_path, monkeypatch, command):
    monkeypatch.setenv("COLUMNS", "120")
    res = rlctl_here(*command.split(), "--help", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "--help" in res.stdout and "<bool>" not in res.stdout  # a flag takes no value
    if command == "launch":
        assert "--detach" in res.stdout and "<path>" in res.stdout  # options that take one still say what


@pytest.mark.process
def test_shell_completion_completes_commands_and_flags(tmp_path):
    script = rlctl("--show-completion", "bash", cwd=tmp_path)
    assert script.returncode == 0 and "_rlctl_completion" in script.stdout and "complete " in script.stdout
    words = rlctl(cwd=tmp_path, env={"_RLCTL_COMPLETE": "complete_bash", "COMP_WORDS": "rlctl la", "COMP_CWORD": "1"})
    assert words.stdout.split() == ["launch"]
    flags = rlctl(cwd=tmp_path, env={"_RLCTL_COMPLETE": "complete_bash", "COMP_WORDS": "rlctl launch --d",
                                     "COMP_CWORD": "2"})
    assert set(flags.stdout.split()) == {"--detach", "--dry-run"}


def test_status_json_has_the_keys_the_readme_lists(tmp_path):
    """The README names every key of `status --json` and `status RUN --json`: both are read from it."""
    import json
    import re

    from conftest import REPO
    from test_status import fake_run

    readme = (REPO / "README.md").read_text()
    said = re.search(r"`rlctl status --json` gives a list of runs with the keys (.*?); `rlctl status RUN --json`\s+"
                     r"adds (.*?); `rlctl status SWEEP", readme, re.S)
    assert said, "the README no longer says what status --json holds"
    listed = {k.strip() for k in re.split(r",|\band\b", said[1].replace("\n", " ")) if k.strip()}
    added = {k.strip() for k in re.split(r",|\band\b", said[2].replace("\n", " ")) if k.strip()}
    fake_run(tmp_path / "runs", "quickstart-20260101-000000-aaaa", "completed", 3, [])
    rows = json.loads(rlctl_here("status", "--json", "--runs-dir", str(tmp_path / "runs"), cwd=tmp_path).stdout)
    assert set(rows[0]) == listed
    detail = json.loads(rlctl_here("status", "quickstart-20260101-000000-aaaa", "--json", "--runs-dir",
                                   str(tmp_path / "runs"), cwd=tmp_path).stdout)
    assert set(detail) == listed | added


def test_pool_status_json_of_no_pool_and_of_a_pool_that_is_down(tmp_path):
    import json

    assert json.loads(rlctl_here("pool", "status", "--json", cwd=tmp_path).stdout) == []
    (tmp_path / "pools" / "p1").mkdir(parents=True)
    (tmp_path / "pools" / "p1" / "pool.json").write_text('{"state": "down"}')
    listed = json.loads(rlctl_here("pool", "status", "--json", cwd=tmp_path).stdout)
    assert listed == [{"name": "p1", "state": "down", "path": "pools/p1"}]
    one = json.loads(rlctl_here("pool", "status", "p1", "--json", cwd=tmp_path).stdout)
    assert one == {"name": "p1", "state": "down", "path": "pools/p1", "events": 0}


def _module_file(module: str) -> str | None:
    """The source of an rlctl module (a package's __init__.py), or None when `module` is a name."""
    base = REPO.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return str(path)
    return None


def _top_level_imports(module: str) -> set[str]:
    """What importing `module` imports by itself: its import statements outside functions and
    `if TYPE_CHECKING:` blocks (class bodies and top-level if/try blocks run on import)."""
    tree = ast.parse(open(_module_file(module)).read())
    package = module if _module_file(module).endswith("__init__.py") else module.rpartition(".")[0]
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], *filter(None, [base])])
                found.add(base)
                found.update(f"{base}.{alias.name}" for alias in node.names if _module_file(f"{base}.{alias.name}"))
            elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                visit([n for h in node.handlers for n in h.body])
            elif isinstance(node, ast.ClassDef):
                visit(node.body)
    visit(tree.body)
    return found


def test_the_cli_imports_nothing_heavy_before_a_command_needs_it():
    """Read, not run (the test process has imported everything already): every module that
    `import rlctl.cli` loads, followed through the package's own imports, and what they import
    from outside it. The commands import the recipe, the engines and the rest inside themselves."""
    seen: set[str] = set()
    outside: dict[str, str] = {}
    todo = ["rlctl.cli"]
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        parents = [".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)]
        todo.extend(p for p in parents if _module_file(p))  # importing a.b.c runs a and a.b first
        for name in _top_level_imports(module):
            if name.split(".")[0] == "rlctl":
                todo.extend([name] if _module_file(name) else [])
            else:
                outside.setdefault(name.split(".")[0], module)
    heavy = {name: by for name, by in outside.items() if name in HEAVY}
    assert not heavy, f"imported when the CLI starts (module: imported by): {heavy}"
    assert {"rlctl.commands.status", "rlctl.commands.plan"} <= seen and "typer" in outside  # it did follow


def _imported_by_a_fresh_rlctl(tmp_path, *args: str) -> list[str]:
    code = ("import sys\nfrom rlctl.cli import main\n"
            f"sys.argv = ['rlctl', *{list(args)!r}]\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            f"print('HEAVY:' + ','.join(m for m in {HEAVY!r} if m in sys.modules), file=sys.stderr)")
    import subprocess

    err = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True).stderr
    marks = [line.removeprefix("HEAVY:") for line in err.splitlines() if line.startswith("HEAVY:")]
    assert marks, err
    return [m for m in marks[-1].split(",") if m]


@pytest.mark.process
def test_help_and_status_import_nothing_heavy(tmp_path):
    """What the modules read above cannot show: what Typer and rich import as they run. Only a
    fresh interpreter says (the test process has them all loaded)."""
    from test_status import fake_run

    fake_run(tmp_path / "runs", "quickstart-20260101-000000-aaaa", "completed", 3, [0.5])
    assert _imported_by_a_fresh_rlctl(tmp_path, "--help") == []
    assert _imported_by_a_fresh_rlctl(tmp_path, "status", "--runs-dir", str(tmp_path / "runs")) == []
    assert _imported_by_a_fresh_rlctl(tmp_path, "status", "quickstart", "--runs-dir", str(tmp_path / "runs")) == []


def test_recipes_load_onto_one_schema_config_that_no_load_changes():
    """load_recipe builds OmegaConf's config of the schema once per process (rlctl/recipe/load.py)
    and merges each recipe onto a copy: one load's values never leak into the next."""
    from rlctl.recipe import load_recipe
    from rlctl.recipe.load import _schema_config
    from rlctl.recipe.schema import Recipe

    cached = _schema_config(Recipe)
    first = load_recipe(REPO / "recipes" / "quickstart.yaml", ["run.steps=7", "train.lr=0.5"], check_paths=False)
    second = load_recipe(REPO / "recipes" / "quickstart.yaml", check_paths=False)
    assert _schema_config(Recipe) is cached and (first.run.steps, first.train.lr) == (7, 0.5)
    assert (second.run.steps, second.train.lr) != (7, 0.5) and cached.run.steps == Recipe().run.steps
    first.run.steps = 9  # a caller changing what it got changes nothing shared either
    assert load_recipe(REPO / "recipes" / "quickstart.yaml", check_paths=False).run.steps == second.run.steps


def test_plans_gpu_choices_are_sim_gpus(tmp_path):
    """`rlctl plan --help` lists --gpu's choices without importing the recipe schema: the list it
    shows is sim.gpu's, and a GPU kind outside it is one line, exit 2."""
    from rlctl.commands.plan import GPU_KINDS
    from rlctl.recipe import GpuKind

    assert GPU_KINDS.split("|") == [g.value for g in GpuKind]
    res = rlctl_here("plan", str(REPO / "recipes" / "quickstart.yaml"), "--gpus", "4", "--gpu", "tpu", cwd=tmp_path)
    assert res.returncode == 2 and res.stderr == "error: --gpu 'tpu': not a GPU kind the cost model knows; one of " \
                                                 "h200, h100, a100, cpu\n"


def test_the_help_renderers_stand_ins_make_the_real_things():
    """Typer's help renderer is imported with stand-ins for rich.markdown and rich.traceback
    (rlctl/cli.py): what it makes of them, when it ever does, is rich's own."""
    import rich.markdown
    from rich.text import Text
    from rich.traceback import Traceback

    from rlctl.cli import _stand_in

    markdown, traceback = _stand_in("rich.markdown", {"Markdown"}), _stand_in("rich.traceback", {"Traceback"})
    assert isinstance(markdown.Markdown("# a title"), rich.markdown.Markdown) and markdown.Markdown | Text
    e = ZeroDivisionError("a failure to show")
    assert isinstance(traceback.Traceback.from_exception(type(e), e, None), Traceback)
    assert markdown.Heading is rich.markdown.Heading  # any other name: the real module's
