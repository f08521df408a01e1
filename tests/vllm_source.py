"""vLLM's own source, read from its wheel: the facts rlctl's vLLM contract is checked against.

vLLM needs CUDA and does not run here, but its wheel is a zip of Python files. This module takes
the files in FILES out of the wheel of a version and reads them with `ast`; nothing here imports
vLLM; worker_group_rank() evaluates one arithmetic expression of it.

    src = source("0.33.0")                  # or Source(Path(dir)) for any vllm/ source tree
    src.routes()["/pause"]                  # frozenset({'POST'})
    src.route("/pause", "POST").dev_only    # True: registered under VLLM_SERVER_DEV_MODE only
    src.reply_shapes("/is_paused", "GET")   # [Reply(500, 'json', {'error'}), Reply(200, 'json', {'is_paused'})]

How routes are found: from register_api_routers (REGISTER) every call is followed, through
`from X import f` (absolute or relative) and the module's own functions, to the
`app.include_router(router)` calls; a router's routes are the `@router.<method>("/path")`
decorators of its module. A route met only inside `if envs.VLLM_SERVER_DEV_MODE:` is dev_only;
every other condition is taken as true. Replies are read by tests/sglang_http.py's ReplyReader.

Wheels: $RLCTL_VLLM_WHEELS, else ~/.cache/rlctl/vllm-wheels, filled with
`pip download --no-deps --only-binary=:all: vllm==X -d DIR`. Files taken out: $RLCTL_VLLM_SRC,
else ~/.cache/rlctl/vllm-src, one folder per wheel and FILES list.
"""

from __future__ import annotations

import ast
import configparser
import functools
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path

import wheels
from wheels import MissingWheel  # noqa: F401 - the tests catch it from here

from sglang_http import ROUTE_DECORATORS, Function, Reply, ReplyReader
from sglang_source import Field

SUPPORTED = ("0.33.0", "0.34.0")

# The wheel's files this reads (fnmatch patterns; `*` matches across folders, so
# "vllm/entrypoints/*.py" is every module under entrypoints/). A lookup that needs a file not
# taken out finds nothing: add the file's pattern then.
FILES = (
    "vllm/_version.py",
    "vllm/envs.py",
    "vllm/outputs.py",
    "vllm/v1/engine/__init__.py",
    "vllm/v1/executor/abstract.py",
    "vllm/v1/engine/core.py",
    "vllm/v1/metrics/loggers.py",
    "vllm/engine/arg_utils.py",
    "vllm/config/*.py",
    "vllm/distributed/weight_transfer/*.py",
    "vllm/entrypoints/*.py",
    "vllm-*.dist-info/entry_points.txt",
)
REGISTER = ("vllm/entrypoints/launchers/api_server/routers.py", "register_api_routers")
DEV_MODE = "envs.VLLM_SERVER_DEV_MODE"
RL_ROUTER = "vllm/entrypoints/rl/online/api_router.py"
PROTOCOL = "vllm/entrypoints/openai/completion/protocol.py"
SERVING = "vllm/entrypoints/openai/completion/serving.py"
ARG_UTILS = "vllm/engine/arg_utils.py"
# Where FrontendArgs (--host, --port, --middleware, ...) is defined, the first that has it.
FRONTEND_ARGS = ("vllm/entrypoints/common/cli_args.py", "vllm/entrypoints/openai/cli_args.py")
MAX_HOPS = 5  # calls followed from REGISTER to an include_router


@dataclass(frozen=True)
class Route:
    path: str
    method: str
    rel: str  # the module of the handler
    handler: Function
    dev_only: bool  # registered only under `if envs.VLLM_SERVER_DEV_MODE:`


@dataclass(frozen=True)
class Param:
    """A handler parameter: `name: Annotated[T, Body(embed=True)]`, `name: T = Query(...)`, ..."""

    type: str  # T, unparsed
    where: str | None  # "Body", "Query", ... (FastAPI's marker); None for a plain parameter
    embed: bool  # Body(embed=True): the JSON body is {name: value}


def wheel_dir() -> Path:
    return wheels.wheel_dir("vllm")


def src_dir() -> Path:
    return wheels.src_dir("vllm")


def wheel(version: str) -> Path:
    return wheels.wheel("vllm", version)


def extract(whl: Path) -> Path:
    return wheels.extract("vllm", whl, FILES)


@functools.cache
def source(version: str) -> Source:
    return Source(extract(wheel(version)))


class Source:
    """A vLLM source tree: `root` holds vllm/... and the wheel's .dist-info (FILES, or a subset)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._modules: dict[str, ast.Module] = {}

    def has(self, rel: str) -> bool:
        return (self.root / rel).is_file()

    def module(self, rel: str) -> ast.Module:
        if rel not in self._modules:
            path = self.root / rel
            self._modules[rel] = ast.parse(path.read_text(), filename=str(path))
        return self._modules[rel]

    def module_file(self, dotted: str) -> str | None:
        base = dotted.replace(".", "/")
        return next((rel for rel in (f"{base}.py", f"{base}/__init__.py") if self.has(rel)), None)

    @property
    def version(self) -> str:
        """The `__version__ = '...'` of vllm/_version.py (vllm/version.py imports it); "unknown" without."""
        tree = self.module("vllm/_version.py") if self.has("vllm/_version.py") else ast.Module([], [])
        found = [n.value.value for n in tree.body
                 if isinstance(n, ast.Assign) and defines(n, "__version__") and isinstance(n.value, ast.Constant)]
        return str(found[0]) if found else "unknown"

    def entry_points(self, group: str = "console_scripts") -> dict[str, str]:
        """The wheel's entry points of `group`: name -> "module:function"."""
        parser = configparser.ConfigParser()
        for path in self.root.glob("vllm-*.dist-info/entry_points.txt"):
            parser.read(path)
        return dict(parser[group]) if parser.has_section(group) else {}

    def definition(self, rel: str, name: str, kind: type | tuple = (ast.FunctionDef, ast.AsyncFunctionDef),
                   hops: int = 3) -> tuple[str, ast.AST] | None:
        """(module, node) of `name` defined at the top level of module `rel`, or imported into it
        by `from X import name` (followed `hops` modules deep, among the files there are)."""
        tree = self.module(rel)
        for node in tree.body:
            if isinstance(node, kind) and defines(node, name):
                return rel, node
        for node in tree.body if hops > 0 else ():
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) == name and (target := self.module_file(absolute(rel, node))):
                        if found := self.definition(target, alias.name, kind, hops - 1):
                            return found
        return None

    def function(self, rel: str, name: str, cls: str | None = None) -> Function:
        """A function of module `rel`, anywhere in it (the one there is), or the method of class `cls`."""
        scope = self.module(rel) if cls is None else self.definition(rel, cls, ast.ClassDef, hops=0)[1]
        found = [n for n in ast.walk(scope) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name]
        if len(found) != 1:
            raise LookupError(f"vLLM {self.version}: {len(found)} functions {name} in {rel} {cls or ''}".rstrip())
        return found[0]

    def assignment(self, rel: str, name: str) -> ast.expr:
        """The value a top-level `name = ...` of module `rel` (or of one it imports it from) assigns."""
        found = self.definition(rel, name, (ast.Assign, ast.AnnAssign))
        if found is None:
            raise LookupError(f"vLLM {self.version}: no {name} = ... in {rel}")
        return found[1].value

    def class_fields(self, rel: str, name: str) -> dict[str, Field]:
        """A class's annotated fields (ClassVars left out), after those of its bases wherever
        they are defined among the files there are."""
        found = self.definition(rel, name, ast.ClassDef)
        if found is None:
            raise LookupError(f"vLLM {self.version}: no class {name} in {rel}")
        rel, cls = found
        fields: dict[str, Field] = {}
        for base in cls.bases:
            if isinstance(base, ast.Name) and self.definition(rel, base.id, ast.ClassDef):
                fields |= self.class_fields(rel, base.id)
        for stmt in cls.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                annotation = ast.unparse(stmt.annotation)
                if not annotation.replace("typing.", "").startswith("ClassVar"):
                    default = None if stmt.value is None else ast.unparse(stmt.value)
                    fields[stmt.target.id] = Field(annotation, default)
        return fields

    # -- HTTP routes ----------------------------------------------------------------------------

    @functools.cached_property
    def route_table(self) -> list[Route]:
        """Every route the API server registers; dev_only where every registration is dev-gated."""
        table: dict[tuple[str, str], Route] = {}
        for route in self._registered(*REGISTER, dev=False, hops=0):
            key = (route.path, route.method)
            if key not in table or not route.dev_only:
                table[key] = route
        return list(table.values())

    def _registered(self, rel: str, name: str, dev: bool, hops: int) -> Iterator[Route]:
        found = self.definition(rel, name)
        if found is not None and hops <= MAX_HOPS:
            yield from self._statements(found[0], found[1], found[1].body, dev, hops)

    def _statements(self, rel: str, func: Function, body: list[ast.stmt], dev: bool, hops: int) -> Iterator[Route]:
        for stmt in body:
            if isinstance(stmt, ast.If):
                yield from self._statements(rel, func, stmt.body, dev or ast.unparse(stmt.test) == DEV_MODE, hops)
                yield from self._statements(rel, func, stmt.orelse, dev, hops)
            elif isinstance(stmt, (ast.With, ast.AsyncWith, ast.For, ast.AsyncFor, ast.While, ast.Try)):
                blocks = [stmt.body, getattr(stmt, "orelse", []), getattr(stmt, "finalbody", [])]
                for block in blocks + [h.body for h in getattr(stmt, "handlers", [])]:
                    yield from self._statements(rel, func, block, dev, hops)
            elif isinstance(stmt, ast.Expr) and isinstance(call := stmt.value, ast.Call):
                if isinstance(call.func, ast.Attribute) and call.func.attr == "include_router" and call.args:
                    if (target := self.resolve(rel, func, ast.unparse(call.args[0]))) is not None:
                        yield from self.router_routes(*target, dev)
                elif isinstance(call.func, ast.Name) and (target := self.resolve(rel, func, call.func.id)):
                    yield from self._registered(*target, dev, hops + 1)

    def resolve(self, rel: str, func: Function, name: str) -> tuple[str, str] | None:
        """(module, name there) of a name used in func: imported inside it or at its module's top
        level, or defined in its module."""
        imports = [n for n in ast.walk(func) if isinstance(n, ast.ImportFrom)]
        imports += [n for n in self.module(rel).body if isinstance(n, ast.ImportFrom)]
        for node in imports:
            for alias in node.names:
                if (alias.asname or alias.name) == name and (target := self.module_file(absolute(rel, node))):
                    return target, alias.name
        return (rel, name) if any(defines(n, name) for n in self.module(rel).body) else None

    def router_routes(self, rel: str, name: str, dev: bool) -> Iterator[Route]:
        """The routes of the APIRouter `name` of module `rel`: its functions decorated with
        @name.<method>("/path") or @name.api_route("/path", methods=[...])."""
        found = self.definition(rel, name, (ast.Assign, ast.AnnAssign))
        for func in self.module(found[0]).body if found else ():
            if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for decorator in func.decorator_list:
                    for path, method in route_of(decorator, name):
                        yield Route(path, method, found[0], func, dev)

    def routes(self) -> dict[str, frozenset[str]]:
        """HTTP path -> the methods it answers."""
        return {p: frozenset(r.method for r in self.route_table if r.path == p) for p in {r.path for r in self.route_table}}

    def route(self, path: str, method: str) -> Route:
        for r in self.route_table:
            if (r.path, r.method) == (path, method):
                return r
        raise KeyError(f"vLLM {self.version} has no route {method} {path}")

    def params(self, path: str, method: str) -> dict[str, Param]:
        """The handler's parameters, with where FastAPI takes each from."""
        args = self.route(path, method).handler.args
        positional = args.posonlyargs + args.args
        defaults = [None] * (len(positional) - len(args.defaults)) + args.defaults + args.kw_defaults
        return {a.arg: param(a.annotation, d) for a, d in zip(positional + args.kwonlyargs, defaults)}

    def reply_shapes(self, path: str, method: str) -> list[Reply]:
        """What the route's handler can answer (tests/sglang_http.py says how it is read), with a
        status written HTTPStatus.X.value given as its number."""
        r = self.route(path, method)
        return [Reply(http_status(x.status), x.kind, x.keys, x.unresolved)
                for x in ReplyReader(self).replies(r.rel, r.handler)]

    # -- command line and weight transfer -------------------------------------------------------

    def frontend_args(self) -> str:
        """The module that defines FrontendArgs in this version."""
        for rel in filter(self.has, FRONTEND_ARGS):
            if self.definition(rel, "FrontendArgs", ast.ClassDef, hops=0):
                return rel
        raise LookupError(f"vLLM {self.version}: no FrontendArgs in {FRONTEND_ARGS}")

    def worker_group_rank(self) -> Callable[..., int]:
        """nccl_common.py's _worker_group_rank as rank(rank_offset, **parallel_config): its
        `local = parallel_config.attr` lines and its returned expression, evaluated as written."""
        func = self.function("vllm/distributed/weight_transfer/nccl_common.py", "_worker_group_rank")
        reads, returned = {}, None
        for stmt in func.body:
            if isinstance(stmt, ast.Assign) and ast.unparse(stmt.value).startswith("parallel_config."):
                reads[ast.unparse(stmt.targets[0])] = stmt.value.attr
            elif isinstance(stmt, ast.Return):
                returned = stmt.value
            elif not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)):  # not the docstring
                raise LookupError(f"_worker_group_rank: cannot read {ast.unparse(stmt)!r}")
        if returned is None or any(isinstance(n, ast.Call) for n in ast.walk(returned)):
            raise LookupError("_worker_group_rank: no plain returned expression")
        code = compile(ast.Expression(returned), "_worker_group_rank", "eval")

        def rank(rank_offset: int, **parallel_config: int) -> int:
            names = {local: parallel_config[attr] for local, attr in reads.items()}
            return eval(code, {"__builtins__": {}}, {"rank_offset": rank_offset, **names})
        return rank


def defines(node: ast.AST, name: str) -> bool:
    """Does this top-level statement define `name` (def, class, or assignment to it)?"""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return node.name == name
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
    return any(isinstance(t, ast.Name) and t.id == name for t in targets)


def absolute(rel: str, node: ast.ImportFrom) -> str:
    """The dotted module a `from X import ...` in module `rel` names (relative ones resolved)."""
    if not node.level:
        return node.module or ""
    package = rel.split("/")[:-1]
    package = package[:len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


def route_of(decorator: ast.expr, router: str) -> list[tuple[str, str]]:
    """(path, method) of each route an @<router>.<method>("/path") or @<router>.api_route("/path", methods=[...])
    declares (FastAPI's default method: GET)."""
    if not (isinstance(decorator, ast.Call) and isinstance(decorator.func, ast.Attribute)
            and ast.unparse(decorator.func.value) == router and decorator.args):
        return []
    path, kind = decorator.args[0], decorator.func.attr
    if not (isinstance(path, ast.Constant) and isinstance(path.value, str)) or kind not in ROUTE_DECORATORS | {"api_route"}:
        return []
    if kind in ROUTE_DECORATORS:
        return [(path.value, kind.upper())]
    methods = next((ast.literal_eval(kw.value) for kw in decorator.keywords if kw.arg == "methods"), ["GET"])
    return [(path.value, m.upper()) for m in methods]


def param(annotation: ast.expr | None, default: ast.expr | None) -> Param:
    """Where FastAPI takes a parameter from: the marker in Annotated[T, Marker(...)], else a
    Marker(...) default."""
    kind, marker = annotation, default
    if isinstance(annotation, ast.Subscript) and ast.unparse(annotation.value).endswith("Annotated"):
        kind, marker = annotation.slice.elts[0], annotation.slice.elts[1]
    if not isinstance(marker, ast.Call):
        return Param(ast.unparse(kind) if kind is not None else "", None, False)
    embed = any(kw.arg == "embed" and ast.unparse(kw.value) == "True" for kw in marker.keywords)
    return Param(ast.unparse(kind), ast.unparse(marker.func), embed)


def literal_values(expr: ast.expr | str) -> set[object]:
    """The values of every Literal[...] in a type expression ("Literal['a', 'b'] | str")."""
    tree = ast.parse(expr, mode="eval") if isinstance(expr, str) else expr
    return {e.value for n in ast.walk(tree) if isinstance(n, ast.Subscript) and ast.unparse(n.value).endswith("Literal")
            for e in (n.slice.elts if isinstance(n.slice, ast.Tuple) else [n.slice]) if isinstance(e, ast.Constant)}


def render(joined: ast.expr, values: dict[str, str]) -> str:
    """An f-string's value, each {expr} taken from values[ast.unparse(expr)] (KeyError if absent)."""
    if not isinstance(joined, ast.JoinedStr):
        raise TypeError(f"not an f-string: {ast.unparse(joined)}")
    return "".join(str(part.value) if isinstance(part, ast.Constant) else values[ast.unparse(part.value)]
                   for part in joined.values)


def http_status(status: int | str) -> int | str:
    """HTTPStatus.OK.value -> 200; anything else as it was."""
    m = re.fullmatch(r"HTTPStatus\.(\w+)\.value", str(status))
    return HTTPStatus[m[1]].value if m and m[1] in HTTPStatus.__members__ else status


def added_flags(func: Function) -> set[str]:
    """The "--flag" strings func passes to any add_argument(...) call."""
    return {a.value for call in ast.walk(func) if isinstance(call, ast.Call)
            and isinstance(call.func, ast.Attribute) and call.func.attr == "add_argument"
            for a in call.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")}
