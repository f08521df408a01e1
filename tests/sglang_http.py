"""SGLang's HTTP server read from its AST, for tests/sglang_source.py: which routes there are
(route_of), what a handler takes (struct_name) and what it can answer (ReplyReader).

A Reply is one (status, body) a handler's code can produce:

    Reply(200, "json", frozenset({"message", "status"}))

- status: an int where the code says which (200, HTTPStatus.BAD_REQUEST -> 400; a conditional
  `200 if success else HTTPStatus.BAD_REQUEST` gives one Reply for each); otherwise the status
  expression as written, e.g. "getattr(e, 'status_code', HTTPStatus.BAD_REQUEST)".
- kind: "json" (a JSON object the code builds: `keys` are the keys it can have), "text"
  (Response with content), "empty" (Response without), "stream" (StreamingResponse),
  "passthrough" (JSON of a value the handler did not build, e.g. the tokenizer manager's result),
  or "unknown" (a return this reader cannot classify; it never guesses).
- unresolved: where keys come from that the reader cannot list (a `**spread` or `.update()` of
  a value from elsewhere, such as the scheduler's info), and for "passthrough"/"unknown" the
  expression returned. An empty `unresolved` on a "json" Reply means `keys` is complete.

What it follows: `return` and `raise HTTPException(...)` in the handler (not in functions defined
inside it); the response classes below; variables assigned in the function (all their
assignments, plus `var["key"] = ...` and `var.update(...)`); calls to functions defined in the
module or imported into it with `from X import f` (three calls deep); the wrappers in
KEY_PRESERVING; and ServerArgs turned into a dict (SERVER_ARGS_DICTS) as ServerArgs' fields.
A key added only under a condition counts as a key it can have. A handler that falls off its end
(FastAPI then answers 200 with a JSON `null`) is not among its replies: falls_through() tells.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

JSON_RESPONSES = {"ORJSONResponse", "JSONResponse", "SGLangORJSONResponse", "orjson_response"}
TEXT_RESPONSES = {"Response", "PlainTextResponse"}
STREAM_RESPONSES = {"StreamingResponse"}
RESPONSES = JSON_RESPONSES | TEXT_RESPONSES | STREAM_RESPONSES
# Functions that return their argument with the same keys (converted or redacted values).
KEY_PRESERVING = {"msgspec_to_builtins", "redact_watermark_secrets"}
# Expressions that are ServerArgs as a dict of all its fields.
SERVER_ARGS_DICTS = {"dataclasses.asdict(server_args)", "server_args.resolved_dict()"}
MAX_DEPTH = 3
ROUTE_DECORATORS = {"get", "post", "put", "delete", "patch", "head", "options"}

Function = ast.FunctionDef | ast.AsyncFunctionDef


@dataclass(frozen=True)
class Reply:
    status: int | str
    kind: str
    keys: frozenset[str] = frozenset()
    unresolved: tuple[str, ...] = ()


@dataclass(frozen=True)
class Body:
    """A JSON value an expression can evaluate to."""

    kind: str
    keys: frozenset[str] = frozenset()
    unresolved: tuple[str, ...] = ()


@dataclass(frozen=True)
class Scope:
    """A function being read: its module, and what its parameters were called with."""

    rel: str
    func: Function
    depth: int = 0
    bindings: dict[str, str] = field(default_factory=dict, hash=False, compare=False)


def route_of(decorator: ast.expr) -> tuple[str, frozenset[str]] | None:
    """(path, methods) of an @app.<method>("/path") or @app.api_route("/path", methods=[...])."""
    if not (isinstance(decorator, ast.Call) and isinstance(decorator.func, ast.Attribute)
            and ast.unparse(decorator.func.value) == "app" and decorator.args):
        return None
    path, kind = decorator.args[0], decorator.func.attr
    if not (isinstance(path, ast.Constant) and isinstance(path.value, str)):
        return None
    if kind in ROUTE_DECORATORS:
        return path.value, frozenset({kind.upper()})
    if kind != "api_route":
        return None
    methods = next((kw.value for kw in decorator.keywords if kw.arg == "methods"), None)
    if methods is None:
        return path.value, frozenset({"GET"})  # FastAPI's default
    try:
        return path.value, frozenset(m.upper() for m in ast.literal_eval(methods))
    except ValueError:
        return None


def struct_name(annotation: ast.expr) -> str | None:
    if isinstance(annotation, ast.Subscript) and ast.unparse(annotation.value).split(".")[-1] in ("Annotated", "Optional"):
        inner = annotation.slice
        return struct_name(inner.elts[0] if isinstance(inner, ast.Tuple) else inner)
    return annotation.id if isinstance(annotation, ast.Name) else None


def falls_through(body: list[ast.stmt]) -> bool:
    """Can control reach the end of these statements? A `return` or `raise` ends a path; `if`
    and `try` fall through where any branch does (a `try` body may complete, or one of its
    handlers); a loop may end without its body returning."""
    for stmt in body:
        if isinstance(stmt, (ast.Return, ast.Raise)):
            return False
        if isinstance(stmt, ast.If) and not (falls_through(stmt.body) or falls_through(stmt.orelse)):
            return False
        if isinstance(stmt, (ast.With, ast.AsyncWith)) and not falls_through(stmt.body):
            return False
        if isinstance(stmt, ast.Try):
            if stmt.finalbody and not falls_through(stmt.finalbody):
                return False
            if not (falls_through(stmt.body + stmt.orelse) or any(falls_through(h.body) for h in stmt.handlers)):
                return False
    return True


def own_nodes(func: Function):
    """func's nodes in source order, leaving out those of functions and classes defined in it."""
    stack = list(reversed(func.body))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            stack.extend(reversed(list(ast.iter_child_nodes(node))))


def callee(call: ast.expr) -> str | None:
    if not isinstance(call, ast.Call):
        return None
    if isinstance(call.func, ast.Name):
        return call.func.id
    return call.func.attr if isinstance(call.func, ast.Attribute) else None


def argument(call: ast.Call, keyword: str, position: int) -> ast.expr | None:
    for kw in call.keywords:
        if kw.arg == keyword:
            return kw.value
    return call.args[position] if len(call.args) > position else None


def assigned(func: Function, name: str) -> list[ast.expr]:
    """The values `name = value` assigns in func, in source order."""
    values = []
    for node in own_nodes(func):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            values.append(node.value)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            if node.value is not None:
                values.append(node.value)
    return values


class ReplyReader:
    """Reads handlers of one source tree. `source` is a sglang_source.Source (its definition()
    and server_args() are what this uses)."""

    def __init__(self, source: Any) -> None:
        self.source = source

    def replies(self, rel: str, func: Function, depth: int = 0, bindings: dict[str, str] | None = None) -> list[Reply]:
        scope = Scope(rel, func, depth, bindings or {})
        found: list[Reply] = []
        for node in own_nodes(func):
            if isinstance(node, ast.Return) and node.value is not None:
                found += self.returned(node.value, scope)
            elif isinstance(node, ast.Raise) and callee(node.exc) == "HTTPException":
                status = argument(node.exc, "status_code", 0)
                found += [Reply(s, "json", frozenset({"detail"})) for s in self.statuses(status, scope)]
        return list(dict.fromkeys(found))

    def returned(self, expr: ast.expr, scope: Scope) -> list[Reply]:
        """The replies of `return expr`."""
        if isinstance(expr, ast.Await):
            return self.returned(expr.value, scope)
        if isinstance(expr, ast.IfExp):
            return self.returned(expr.body, scope) + self.returned(expr.orelse, scope)
        if isinstance(expr, ast.Name):
            values = assigned(scope.func, expr.id)
            if any(callee(v) in RESPONSES for v in values):
                return [r for v in values for r in self.returned(v, scope)]
        name = callee(expr)
        if name in RESPONSES:
            return self.response(expr, name, scope)
        if name not in KEY_PRESERVING and (called := self.called_function(expr, scope)):
            return self.replies(*called)
        return [Reply(200, b.kind, b.keys, b.unresolved) for b in self.values(expr, scope)]

    def response(self, call: ast.Call, name: str, scope: Scope) -> list[Reply]:
        statuses = self.statuses(argument(call, "status_code", 1), scope)
        if name in STREAM_RESPONSES:
            return [Reply(s, "stream") for s in statuses]
        content = argument(call, "content", 0)
        if name in JSON_RESPONSES:
            bodies = self.values(content, scope) if content is not None else [Body("unknown", unresolved=("None",))]
            return [Reply(s, b.kind, b.keys, b.unresolved) for s in statuses for b in bodies]
        media = argument(call, "media_type", 3)
        if media is not None and not (isinstance(media, ast.Constant) and str(media.value).startswith("text/")):
            return [Reply(s, "unknown", unresolved=(ast.unparse(call),)) for s in statuses]
        empty = content is None or (isinstance(content, ast.Constant) and content.value in (None, b"", ""))
        return [Reply(s, "empty" if empty else "text") for s in statuses]

    def statuses(self, expr: ast.expr | None, scope: Scope) -> list[int | str]:
        if expr is None:
            return [200]
        if isinstance(expr, ast.IfExp):
            return self.statuses(expr.body, scope) + self.statuses(expr.orelse, scope)
        if isinstance(expr, ast.Constant) and isinstance(expr.value, int):
            return [expr.value]
        if isinstance(expr, ast.Attribute) and ast.unparse(expr.value) in ("HTTPStatus", "http.HTTPStatus"):
            if expr.attr in HTTPStatus.__members__:
                return [HTTPStatus[expr.attr].value]
        if isinstance(expr, ast.Name) and (values := assigned(scope.func, expr.id)):
            return [s for v in values for s in self.statuses(v, scope)]
        return [ast.unparse(expr)]

    def values(self, expr: ast.expr, scope: Scope) -> list[Body]:
        """The JSON values expr can evaluate to."""
        if isinstance(expr, ast.Await):
            return self.values(expr.value, scope)
        if isinstance(expr, ast.IfExp):
            return self.values(expr.body, scope) + self.values(expr.orelse, scope)
        if isinstance(expr, ast.Dict):
            return [self.dict_body(expr, scope)]
        if isinstance(expr, ast.Name):
            return self.variable(expr.id, scope)
        if isinstance(expr, ast.Call):
            return self.call_values(expr, scope)
        return [Body("unknown", unresolved=(ast.unparse(expr),))]

    def call_values(self, call: ast.Call, scope: Scope) -> list[Body]:
        name, text = callee(call), ast.unparse(call)
        if name in KEY_PRESERVING and call.args:
            return self.values(call.args[0], scope)
        if text in SERVER_ARGS_DICTS:
            return [Body("json", frozenset(self.source.server_args()))]
        if called := self.called_function(call, scope):
            rel, func, depth, bindings = called
            inner = Scope(rel, func, depth, bindings)
            return [b for node in own_nodes(func) if isinstance(node, ast.Return) and node.value is not None
                    for b in self.values(node.value, inner)]
        if name and name.lower().endswith("response"):  # a response built somewhere this cannot see
            return [Body("unknown", unresolved=(text,))]
        return [Body("passthrough", unresolved=(text,))]

    def variable(self, name: str, scope: Scope) -> list[Body]:
        """A variable's values: each assignment's, plus the keys set on it afterwards."""
        values = assigned(scope.func, name)
        if not values:
            return [Body("passthrough", unresolved=(scope.bindings.get(name, name),))]
        extra = self.dict_additions(name, scope)
        bodies = [b for v in values for b in self.values(v, scope)]
        return [Body("json", b.keys | extra.keys, b.unresolved + extra.unresolved) if b.kind == "json" else b
                for b in bodies]

    def dict_additions(self, name: str, scope: Scope) -> Body:
        """The keys `name["key"] = ...` and `name.update(other)` add in the scope's function."""
        keys, unresolved = set(), []
        for node in own_nodes(scope.func):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Subscript) and ast.unparse(target.value) == name:
                        key = target.slice
                        if isinstance(key, ast.Constant) and isinstance(key.value, str):
                            keys.add(key.value)
                        else:
                            unresolved.append(f"{name}[{ast.unparse(key)}]")
            elif isinstance(node, ast.Call) and ast.unparse(node.func) == f"{name}.update" and node.args:
                for b in self.values(node.args[0], scope):
                    keys |= b.keys
                    unresolved += b.unresolved
        return Body("json", frozenset(keys), tuple(unresolved))

    def dict_body(self, d: ast.Dict, scope: Scope) -> Body:
        keys, unresolved = set(), []
        for key, value in zip(d.keys, d.values):
            if key is None:  # **spread
                for b in self.values(value, scope):
                    keys |= b.keys
                    unresolved += b.unresolved
            elif isinstance(key, ast.Constant) and isinstance(key.value, str):
                keys.add(key.value)
            else:
                unresolved.append(ast.unparse(key))
        return Body("json", frozenset(keys), tuple(unresolved))

    def called_function(self, call: ast.expr, scope: Scope) -> tuple[str, Function, int, dict[str, str]] | None:
        """The module and definition of a function called by plain name, with what its
        parameters are bound to; None where it is not found or the calls nest too deep."""
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)) or scope.depth >= MAX_DEPTH:
            return None
        found = self.source.definition(scope.rel, call.func.id)
        if found is None:
            return None
        rel, func = found
        params = [a.arg for a in func.args.posonlyargs + func.args.args]
        bindings = {p: ast.unparse(a) for p, a in zip(params, call.args)}
        bindings |= {kw.arg: ast.unparse(kw.value) for kw in call.keywords if kw.arg}
        return rel, func, scope.depth + 1, bindings
