"""The structure check: the size limits and the package's layering, in one place.

    python scripts/check_structure.py       # prints each violation; exit 1 if there is any

Over every .py file under rlctl/, scripts/ and tests/:
- no function over MAX_FUNCTION_LINES lines (from its `def` to its last line), except those in
  LONG_FUNCTIONS_ALLOWED;
- no file over MAX_FILE_LINES lines;
and inside the package rlctl/:
- no import from a higher layer than the importing module's own (LAYERS);
- no import cycle: no modules that import each other, directly or through others. A cycle
  keeps each of its modules from being read, tested or moved alone, and whichever one Python
  loads first sees the others half-initialised. Each group of modules tied in cycles is reported
  once, on the file of its first module, as `import cycle: rlctl.a -> rlctl.b -> rlctl.a`.
- no branch on an engine's kind (`RolloutEngine.X`, `TrainEngine.X`, a protocol or engine
  compared with a string) outside ENGINE_HOMES: each engine's adapter (rlctl/engines/rollout/
  adapter.py, rlctl/engines/train/adapter.py) answers for it, so a new engine touches its own
  package, its registry line and its recipe section, not the house.
Imports inside functions and under TYPE_CHECKING count for the two import rules. In the graph of imports,
an import is an edge to exactly the module it names: `import rlctl.x.y` and
`from rlctl.x.y import f` to rlctl.x.y only, `from rlctl.x import y` to rlctl.x.y when y is a
module, and only an import that names the package itself (`from rlctl.x import f`, f not a
module) to rlctl.x's __init__. Python does run rlctl.x's __init__ before rlctl.x.y, but counting
that would put every __init__ that re-exports its submodules in a cycle with each of them that
imports a sibling: a cycle that no line of either file shows and no move would break.

tests/test_structure.py runs the same check under pytest. It reads and parses files only: no
imports, no processes.
"""

from __future__ import annotations

import ast
import enum
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

MAX_FUNCTION_LINES = 60
MAX_FILE_LINES = 400
CHECKED_DIRS = ("rlctl", "scripts", "tests")
PACKAGE = "rlctl"
ENGINE_KINDS = ("RolloutEngine", "TrainEngine", "ServerProtocol")
ENGINE_HOMES = ("rlctl/recipe/", "rlctl/engines/rollout/adapter.py", "rlctl/engines/rollout/registry.py",
                "rlctl/engines/rollout/builtin/", "rlctl/engines/rollout/sglang/", "rlctl/engines/rollout/vllm/",
                "rlctl/engines/train/adapter.py")
"""The recipe's schema and the engines' adapters: the only places that may name an engine's kind."""

# (folder, function name): functions allowed to be long. The sbatch template reads best as the
# script it writes, top to bottom, rather than cut into pieces.
LONG_FUNCTIONS_ALLOWED = {("rlctl/launchers", "render_batch_script")}


class Layer(enum.IntEnum):
    """rlctl's layers, from the bottom (0) up. A module may import modules of its own layer and of
    the layers below it, never of a layer above.

    SCHEMA: the recipe schema (rlctl.recipe: its dataclasses, choices and checks) and the
      project's exceptions. Every other layer reads them, so they import nothing above: a recipe
      is checked without loading tasks, engines or the simulator.
    FOUNDATION: pure pieces and plain files, each usable alone: the run directory and what reads
      it (rlctl.run), what every process shares (rlctl.process: the token door, the topology,
      devices, lifetime, watchdogs), metrics over events, GRPO math, rewards and tasks, data, the
      tiny model, workloads. Any module of the package not placed elsewhere is foundation.
    ENGINES: the rollout and train engines, their HTTP clients and services, weight sync.
    SCHEDULING: the pipeline modes over the engines' interfaces (rlctl.pipelines), and the shared
    pool's placement and time slicing of several runs' calls (rlctl.plex).
    SIMULATION: the cost model (rlctl.costs: what a step costs in seconds and bytes), the same
      scheduler over simulated engines in virtual time on it (rlctl.sim), and the placement
      planner that prices steps on it (rlctl.planner). sim and planner import the cost model and
      never each other.
    ORCHESTRATION: what puts the pieces together into a running run and watches it: the
      launchers (local and Slurm) and the status of runs (rlctl.launchers.status, which asks the
      Slurm launcher about live jobs), the worker entry point of every process (rlctl.worker), and
      the controller (rlctl.control).
    INTERFACE: the command line: rlctl.cli and one module per command. Nothing imports it.
    """

    SCHEMA = 0
    FOUNDATION = 1
    ENGINES = 2
    SCHEDULING = 3
    SIMULATION = 4
    ORCHESTRATION = 5
    INTERFACE = 6


# Module prefix -> layer. The longest prefix that matches a module (whole dotted parts) gives its
# layer, so a new module lands in the layer of the package it is in.
LAYERS: dict[str, Layer] = {
    "rlctl.cli": Layer.INTERFACE,
    "rlctl.__main__": Layer.INTERFACE,
    "rlctl.commands": Layer.INTERFACE,
    "rlctl.launchers": Layer.ORCHESTRATION,
    "rlctl.worker": Layer.ORCHESTRATION,
    "rlctl.control": Layer.ORCHESTRATION,
    "rlctl.sim": Layer.SIMULATION,
    "rlctl.planner": Layer.SIMULATION,
    "rlctl.costs": Layer.SIMULATION,
    "rlctl.pipelines": Layer.SCHEDULING,
    "rlctl.plex": Layer.SCHEDULING,
    "rlctl.engines": Layer.ENGINES,
    "rlctl": Layer.FOUNDATION,
    "rlctl.recipe": Layer.SCHEMA,
    "rlctl.errors": Layer.SCHEMA,
}


@dataclass(frozen=True)
class Violation:
    path: str
    """Relative to the checked root, with / separators."""
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.message}"


def layer_of(module: str) -> Layer:
    """The layer of a module of the package, by the longest prefix in LAYERS."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        layer = LAYERS.get(".".join(parts[:n]))
        if layer is not None:
            return layer
    raise ValueError(f"{module} is not a module of {PACKAGE}")


def python_files(root: Path) -> Iterator[Path]:
    for folder in CHECKED_DIRS:
        yield from sorted(p for p in (root / folder).rglob("*.py") if "__pycache__" not in p.parts)


def module_name(root: Path, path: Path) -> str:
    """rlctl/engines/weightsync.py -> rlctl.engines.weightsync; a package's __init__ is the package."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def long_functions(root: Path, path: Path, tree: ast.AST) -> list[Violation]:
    rel = path.relative_to(root).as_posix()
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        lines = node.end_lineno - node.lineno + 1
        allowed = any(rel.startswith(folder + "/") and node.name == name for folder, name in LONG_FUNCTIONS_ALLOWED)
        if lines > MAX_FUNCTION_LINES and not allowed:
            out.append(Violation(rel, node.lineno, f"function {node.name} is {lines} lines (at most {MAX_FUNCTION_LINES})"))
    return out


def long_file(root: Path, path: Path, text: str) -> list[Violation]:
    lines = len(text.splitlines())
    if lines <= MAX_FILE_LINES:
        return []
    return [Violation(path.relative_to(root).as_posix(), 1, f"{lines} lines (at most {MAX_FILE_LINES})")]


def imported_modules(tree: ast.AST, module: str, is_package: bool, known: set[str]) -> Iterator[tuple[int, str]]:
    """(line, module) for every import of the package anywhere in the tree, functions included.

    `from a.b import c` imports a.b.c when that is a module (known), else a name of a.b."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base


def upward_imports(root: Path, path: Path, tree: ast.AST, known: set[str]) -> list[Violation]:
    module = module_name(root, path)
    if not (module == PACKAGE or module.startswith(PACKAGE + ".")):
        return []
    own = layer_of(module)
    out, seen = [], set()
    for line, target in imported_modules(tree, module, path.name == "__init__.py", known):
        if not (target == PACKAGE or target.startswith(PACKAGE + ".")) or target in seen:
            continue
        seen.add(target)
        theirs = layer_of(target)
        if theirs > own:
            out.append(Violation(path.relative_to(root).as_posix(), line,
                                 f"{module} -> {target} (layer {own.name.lower()} may not import layer "
                                 f"{theirs.name.lower()})"))
    return out


def package_imports(module: str, is_package: bool, tree: ast.AST, known: set[str]) -> dict[str, int]:
    """The modules of the package this module imports (other than itself), each with the line of
    its first import: the module's edges in the import graph."""
    edges: dict[str, int] = {}
    for line, target in imported_modules(tree, module, is_package, known):
        if target in known and target != module and (target == PACKAGE or target.startswith(PACKAGE + ".")):
            edges[target] = min(line, edges.get(target, line))
    return edges


def strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's strongly connected components of the graph, without recursion (an import chain
    may be deeper than Python's stack)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    work: list[tuple[str, Iterator[str]]] = []
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        work.append((node, iter(graph[node])))

    for start in graph:
        if start in index:
            continue
        visit(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    visit(child)
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while not component or component[-1] != node:
                        component.append(stack.pop())
                        on_stack.discard(component[-1])
                    components.append(component)
    return components


def shortest_cycle(graph: dict[str, dict[str, int]], start: str, members: set[str]) -> list[str]:
    """The shortest way from start back to start through members (breadth first, each module's
    imports in line order): the modules in order, start at both ends."""
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node], key=graph[node].get):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if child in members and child not in came_from:
                    came_from[child] = node
                    following.append(child)
        frontier = following
    raise ValueError(f"{start} is on no cycle")


def import_cycles(graph: dict[str, dict[str, int]], paths: dict[str, str]) -> list[Violation]:
    """One violation per group of modules tied in cycles (a strongly connected component), on the
    file of its first module in file order, at the line where that module imports the next one.
    A group larger than its shortest cycle through that module names the others too."""
    rank = {module: i for i, module in enumerate(graph)}
    found = []
    for component in strongly_connected(graph):
        if len(component) < 2:
            continue
        first = min(component, key=rank.get)
        cycle = shortest_cycle(graph, first, set(component))
        message = "import cycle: " + " -> ".join(cycle)
        others = sorted(set(component) - set(cycle))
        if others:
            message += f" (in the same cycles: {', '.join(others)})"
        found.append((rank[first], Violation(paths[first], graph[first][cycle[1]], message)))
    return [v for _, v in sorted(found, key=lambda f: f[0])]


def engine_branches(root: Path, path: Path, tree: ast.AST) -> list[Violation]:
    """Every place outside ENGINE_HOMES that names an engine kind's member or compares an
    `engine` or `protocol` attribute with a string."""
    rel = path.relative_to(root).as_posix()
    if not rel.startswith(PACKAGE + "/") or rel.startswith(ENGINE_HOMES):
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ENGINE_KINDS:
            out.append(Violation(rel, node.lineno, f"branch on {node.value.id}.{node.attr}: ask the engine's adapter"))
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            named = [s.attr for s in sides if isinstance(s, ast.Attribute) and s.attr in ("engine", "protocol")]
            if named and any(isinstance(s, ast.Constant) and isinstance(s.value, str) for s in sides):
                out.append(Violation(rel, node.lineno, f"branch on the {named[0]} by name: ask the engine's adapter"))
    return sorted(out, key=lambda v: v.line)


def check(root: Path) -> list[Violation]:
    """Every violation under root (a checkout of the repository), file by file, then the import
    cycles."""
    files = list(python_files(root))
    known = {module_name(root, p) for p in files}
    graph: dict[str, dict[str, int]] = {}
    paths: dict[str, str] = {}
    out: list[Violation] = []
    for path in files:
        text = path.read_text()
        tree = ast.parse(text, filename=str(path))
        out += long_file(root, path, text)
        out += long_functions(root, path, tree)
        out += upward_imports(root, path, tree, known)
        out += engine_branches(root, path, tree)
        module = module_name(root, path)
        if module == PACKAGE or module.startswith(PACKAGE + "."):
            graph[module] = package_imports(module, path.name == "__init__.py", tree, known)
            paths[module] = path.relative_to(root).as_posix()
    return out + import_cycles(graph, paths)


def main() -> int:
    violations = check(Path(__file__).resolve().parents[1])
    for v in violations:
        print(v)
    if violations:
        print(f"{len(violations)} structure violation(s)", file=sys.stderr)
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
