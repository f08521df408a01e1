"""SGLang's own source, read from its wheel: the facts rlctl's SGLang contract is checked against.

SGLang needs CUDA and does not run here, but its wheel is a zip of Python files. This module takes
the files in FILES out of the wheel of a version and reads them with `ast`; nothing here imports
SGLang (flattened_tensor_bucket() alone runs one file of it, which imports only torch).

    src = source("0.5.23")                     # or Source(Path(dir)) for any sglang/ source tree
    src.routes()["/pause_generation"]          # frozenset({'POST'})
    src.reply_shapes("/pause_generation")      # [Reply(200, 'json', frozenset({'message', 'status'}))]
    src.struct_fields("UpdateWeightsFromDistributedReqInput")["group_name"]
                                               # Field(annotation='str', default="'weight_update_group'")
    src.server_args_default("weight_version")  # "'default'"  (ast.unparse: literal_eval it)

Each module-level function (routes(version), reply_shapes(version, path), ...) is the Source
method of the same name on source(version). Wheels: $RLCTL_SGLANG_WHEELS, else
~/.cache/rlctl/sglang-wheels, filled with `pip download --no-deps sglang==X -d DIR`. Files taken
out: $RLCTL_SGLANG_SRC, else ~/.cache/rlctl/sglang-src, one folder per wheel and FILES list.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

import wheels
from wheels import MissingWheel  # noqa: F401 - the tests catch it from here

from sglang_http import Function, Reply, ReplyReader, route_of, struct_name

SUPPORTED = ("0.5.15.post1", "0.5.21", "0.5.23")

# The wheel's files this reads (fnmatch patterns). A lookup that needs a file not taken out finds
# nothing: a function it cannot follow, a reply it cannot classify. Add the file's pattern then.
FILES = (
    "sglang/_version.py",
    "sglang/srt/constants.py",
    "sglang/srt/environ.py",
    "sglang/srt/entrypoints/http_server.py",
    "sglang/srt/managers/io_struct.py",
    "sglang/srt/managers/scheduler_components/weight_updater.py",
    "sglang/srt/sampling/sampling_params.py",
    "sglang/srt/server_args.py",
    "sglang/srt/arg_groups/fields/*.py",
    "sglang/srt/utils/*.py",
    "sglang/srt/weight_sync/tensor_bucket.py",
    "sglang/srt/model_executor/model_runner.py",
    "sglang/srt/model_executor/model_runner_components/weight_updater.py",
    "sglang/srt/function_call/hermes_detector.py",
    "sglang/srt/function_call/qwen25_detector.py",
    "sglang/srt/function_call/base_format_detector.py",
)
HTTP_SERVER = "sglang/srt/entrypoints/http_server.py"
IO_STRUCT = "sglang/srt/managers/io_struct.py"
SAMPLING_PARAMS = "sglang/srt/sampling/sampling_params.py"
SERVER_ARGS = "sglang/srt/server_args.py"
TENSOR_BUCKET = "sglang/srt/weight_sync/tensor_bucket.py"
SCHEDULER_WEIGHT_UPDATER = "sglang/srt/managers/scheduler_components/weight_updater.py"
# Where the model runner joins the weight-update group: its own component from 0.5.21 on.
RUNNER_WEIGHT_UPDATERS = ("sglang/srt/model_executor/model_runner_components/weight_updater.py",
                          "sglang/srt/model_executor/model_runner.py")
TENSOR_BUCKET_IMPORTS = {"torch", "dataclasses", "typing", "__future__"}


@dataclass(frozen=True)
class Field:
    annotation: str  # ast.unparse of the annotation
    default: str | None  # ast.unparse of the default; None: the field is required


@dataclass(frozen=True)
class SessionRefusal:
    """How the scheduler refuses update_weights_from_distributed outside begin/end_weight_update."""

    message: str
    before_receive: bool  # the refusal returns before the function receives any tensor


def wheel_dir() -> Path:
    return wheels.wheel_dir("sglang")


def src_dir() -> Path:
    return wheels.src_dir("sglang")


def wheel(version: str) -> Path:
    return wheels.wheel("sglang", version)


def extract(whl: Path) -> Path:
    return wheels.extract("sglang", whl, FILES)


@functools.cache
def source(version: str) -> Source:
    return Source(extract(wheel(version)))


class Source:
    """An SGLang source tree: `root` holds sglang/... (FILES, or any subset: a lookup needing a
    missing file raises LookupError or reports it cannot tell)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._modules: dict[str, ast.Module] = {}
        self._memo: dict[str, object] = {}

    # -- modules and definitions ----------------------------------------------------------------

    def has(self, rel: str) -> bool:
        return (self.root / rel).is_file()

    def module(self, rel: str) -> ast.Module:
        if rel not in self._modules:
            path = self.root / rel
            self._modules[rel] = ast.parse(path.read_text(), filename=str(path))
        return self._modules[rel]

    @property
    def version(self) -> str:
        """sglang/_version.py's __version__; "unknown" without it."""
        if not self.has("sglang/_version.py"):
            return "unknown"
        for node in self.module("sglang/_version.py").body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
                if any(isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets):
                    return str(node.value.value)
        return "unknown"

    def module_file(self, dotted: str) -> str | None:
        base = dotted.replace(".", "/")
        return next((rel for rel in (f"{base}.py", f"{base}/__init__.py") if self.has(rel)), None)

    def definition(self, rel: str, name: str, kind: type | tuple = (ast.FunctionDef, ast.AsyncFunctionDef),
                   hops: int = 3) -> tuple[str, ast.AST] | None:
        """(module, node) of `name` defined at the top level of module `rel`, or imported into it
        by `from X import name` or `from X import *` (followed `hops` modules deep, among the
        files there are)."""
        tree = self.module(rel)
        for node in tree.body:
            if isinstance(node, kind) and node.name == name:
                return rel, node
        for node in tree.body if hops > 0 else ():
            if not (isinstance(node, ast.ImportFrom) and node.module and node.level == 0):
                continue
            for alias in node.names:
                if alias.name == "*" or (alias.asname or alias.name) == name:
                    target = self.module_file(node.module)
                    original = name if alias.name == "*" else alias.name
                    found = target and self.definition(target, original, kind, hops - 1)
                    if found:
                        return found
        return None

    def class_fields(self, rel: str, name: str) -> dict[str, Field]:
        """A class's annotated fields (ClassVars left out), after those of its bases defined in
        the same module."""
        found = self.definition(rel, name, ast.ClassDef)
        if found is None:
            raise LookupError(f"{self.root}: no class {name} in {rel}")
        rel, cls = found
        fields: dict[str, Field] = {}
        for base in cls.bases:
            if isinstance(base, ast.Name) and self.definition(rel, base.id, ast.ClassDef, hops=0):
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
    def route_table(self) -> list[tuple[str, frozenset[str], Function]]:
        """(path, methods, handler) of every @app.<method>(path) and @app.api_route(path, methods=...)
        decorator in http_server.py whose path is a string literal."""
        table = []
        for node in ast.walk(self.module(HTTP_SERVER)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                table += [(*route, node) for route in map(route_of, node.decorator_list) if route]
        return table

    def routes(self) -> dict[str, frozenset[str]]:
        """HTTP path -> the methods it answers."""
        merged: dict[str, frozenset[str]] = {}
        for path, methods, _ in self.route_table:
            merged[path] = merged.get(path, frozenset()) | methods
        return merged

    def handler(self, path: str, method: str | None = None) -> Function:
        found = list({id(f): f for p, m, f in self.route_table if p == path and (method is None or method in m)}.values())
        if not found:
            raise KeyError(f"SGLang {self.version} has no route {path} {method or ''}".rstrip())
        if len(found) > 1:
            raise LookupError(f"SGLang {self.version}: {path} has {len(found)} handlers; name the method")
        return found[0]

    def route_request_struct(self, path: str) -> str | None:
        """The class the handler's `obj` parameter takes (`obj: X` or `obj: Annotated[X, Body()]`)."""
        func = self.handler(path)
        for arg in func.args.posonlyargs + func.args.args + func.args.kwonlyargs:
            if arg.arg == "obj" and arg.annotation is not None:
                return struct_name(arg.annotation)
        return None

    def reply_shapes(self, path: str, method: str | None = None) -> list[Reply]:
        """What the route's handler can answer (tests/sglang_http.py says how it is read)."""
        return ReplyReader(self).replies(HTTP_SERVER, self.handler(path, method))

    # -- request structs, sampling and server arguments -----------------------------------------

    def struct_fields(self, class_name: str) -> dict[str, Field]:
        """An io_struct class's fields, its io_struct base classes' included (BaseReq's rid)."""
        return self.class_fields(IO_STRUCT, class_name)

    def sampling_params(self) -> set[str]:
        """The keywords SamplingParams(...) takes: its __init__'s where it has one, else its fields
        (a dataclass or msgspec.Struct takes each field as a keyword)."""
        found = self.definition(SAMPLING_PARAMS, "SamplingParams", ast.ClassDef)
        if found is None:
            raise LookupError(f"{self.root}: no SamplingParams in {SAMPLING_PARAMS}")
        init = next((f for f in found[1].body if isinstance(f, ast.FunctionDef) and f.name == "__init__"), None)
        if init is None:
            return set(self.class_fields(found[0], "SamplingParams"))
        return {a.arg for a in init.args.args[1:] + init.args.kwonlyargs}

    def server_args(self) -> dict[str, Field]:
        """ServerArgs' fields: those in its own body (a dataclass up to 0.5.15) and those of the
        namespace classes server_args.py lists in _INPUT_NAMESPACES, which ServerArgs is
        assembled from in 0.5.21 on."""
        if "server_args" not in self._memo:
            fields: dict[str, Field] = {}
            for name in self.server_args_namespaces():
                fields |= self.class_fields(SERVER_ARGS, name)
            self._memo["server_args"] = fields | self.class_fields(SERVER_ARGS, "ServerArgs")
        return self._memo["server_args"]

    def server_args_namespaces(self) -> list[str]:
        for node in self.module(SERVER_ARGS).body:
            if isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["_INPUT_NAMESPACES"]:
                return [ast.unparse(e) for e in node.value.elts]
        return []

    def server_args_fields(self) -> set[str]:
        return set(self.server_args())

    def server_args_default(self, name: str) -> str | None:
        """ServerArgs.<name>'s default, unparsed ("'default'", "1"); None where it has none."""
        return self.server_args()[name].default

    # -- weight updates -------------------------------------------------------------------------

    def weight_update_rank(self) -> str:
        """The rank the model runner takes in the weight-update group: the value `rank = ...`
        assigns in its init_weights_update_group, unparsed."""
        for rel in filter(self.has, RUNNER_WEIGHT_UPDATERS):
            for func in functions(self.module(rel), "init_weights_update_group"):
                for node in ast.walk(func):
                    if isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["rank"]:
                        return ast.unparse(node.value)
        raise LookupError(f"{self.root}: no `rank = ...` in init_weights_update_group of {RUNNER_WEIGHT_UPDATERS}")

    def update_refused_outside_session(self) -> SessionRefusal | None:
        """The scheduler's update_weights_from_distributed refusing to run outside a
        begin/end_weight_update session (`if self._session is None: return ...(success=False,
        message=...)`); None where it has no such check (versions without sessions)."""
        found = list(functions(self.module(SCHEDULER_WEIGHT_UPDATER), "update_weights_from_distributed"))
        if len(found) != 1:
            raise LookupError(f"{self.root}: {len(found)} update_weights_from_distributed in {SCHEDULER_WEIGHT_UPDATER}")
        func = found[0]
        for stmt in func.body:
            if isinstance(stmt, ast.If) and ast.unparse(stmt.test) == "self._session is None":
                receives = [n.lineno for n in ast.walk(func)
                            if isinstance(n, ast.Call) and ast.unparse(n.func).endswith(".receive_weights_from_distributed")]
                if not receives:
                    raise LookupError(f"{self.root}: update_weights_from_distributed receives nothing itself")
                return SessionRefusal(refusal_message(stmt), stmt.end_lineno < min(receives))
        return None

    def flattened_tensor_bucket(self) -> type:
        """tensor_bucket.py's FlattenedTensorBucket, loaded from its file under a module name of
        its own (sglang is never put on sys.path). The file imports only torch, dataclasses and
        typing in 0.5.15.post1 to 0.5.23, so nothing is stubbed; an import of anything else raises
        ImportError here rather than load a half-working class."""
        path = self.root / TENSOR_BUCKET
        foreign = sorted(imported_roots(self.module(TENSOR_BUCKET)) - TENSOR_BUCKET_IMPORTS)
        if foreign:
            raise ImportError(f"{path} imports {foreign}: stub them before loading it")
        name = "sglang_source_tensor_bucket_" + hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
        if name not in sys.modules:
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module  # dataclasses look their module up by name
            spec.loader.exec_module(module)
        return sys.modules[name].FlattenedTensorBucket


def functions(tree: ast.AST, name: str):
    return (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name)


def refusal_message(check: ast.If) -> str:
    for node in ast.walk(check):
        if isinstance(node, ast.Return) and isinstance(node.value, ast.Call):
            keywords = {kw.arg: kw.value for kw in node.value.keywords}
            if ast.unparse(keywords.get("success", ast.Constant(None))) == "False" and "message" in keywords:
                message = keywords["message"]
                return message.value if isinstance(message, ast.Constant) else ast.unparse(message)
    raise LookupError(f"no `return ...(success=False, message=...)` under `if {ast.unparse(check.test)}`")


def imported_roots(tree: ast.Module) -> set[str]:
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            roots.add("." if node.level else node.module.split(".")[0])
    return roots


# -- the same, by version ---------------------------------------------------------------------


def routes(version: str) -> dict[str, frozenset[str]]:
    return source(version).routes()


def handler(version: str, path: str, method: str | None = None) -> Function:
    return source(version).handler(path, method)


def route_request_struct(version: str, path: str) -> str | None:
    return source(version).route_request_struct(path)


def reply_shapes(version: str, path: str, method: str | None = None) -> list[Reply]:
    return source(version).reply_shapes(path, method)


def struct_fields(version: str, class_name: str) -> dict[str, Field]:
    return source(version).struct_fields(class_name)


def sampling_params(version: str) -> set[str]:
    return source(version).sampling_params()


def server_args_fields(version: str) -> set[str]:
    return source(version).server_args_fields()


def server_args_default(version: str, name: str) -> str | None:
    return source(version).server_args_default(name)


def weight_update_rank(version: str) -> str:
    return source(version).weight_update_rank()


def update_refused_outside_session(version: str) -> SessionRefusal | None:
    return source(version).update_refused_outside_session()


def flattened_tensor_bucket(version: str) -> type:
    return source(version).flattened_tensor_bucket()
