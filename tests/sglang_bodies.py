"""Request bodies checked against SGLang's own request structs (tests/sglang_source.py reads them).

A body passes when every key is a field of the struct its route takes, every field without a
default is there, and every value has the field's annotated type. Annotations are read as SGLang
writes them (List[int], Optional[str], Literal['abort', ...], Union[...], X | None); one this
reader does not know fails the check instead of passing it.
"""

from __future__ import annotations

import ast
import base64
from typing import Any

from sglang_source import Source

SCALARS = {"str": str, "float": (int, float), "bytes": bytes}
ANY = {"Any", "Dict", "dict", "object"}


def _is(value: Any, node: ast.expr) -> bool:
    """Does value have the type the annotation node names?"""
    if isinstance(node, ast.Constant) and node.value is None:
        return value is None
    if isinstance(node, ast.Name):
        if node.id == "int":
            return isinstance(value, int) and not isinstance(value, bool)
        if node.id == "bool":
            return isinstance(value, bool)
        if node.id in SCALARS:
            return isinstance(value, SCALARS[node.id]) and not isinstance(value, bool)
        if node.id in ANY:
            return node.id not in ("Dict", "dict") or isinstance(value, dict)
        if node.id in ("List", "list"):
            return isinstance(value, list)
        raise AssertionError(f"annotation {node.id!r}: the body reader does not know it")
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _is(value, node.left) or _is(value, node.right)
    if isinstance(node, ast.Subscript):
        return _subscript(value, node)
    raise AssertionError(f"annotation {ast.unparse(node)!r}: the body reader does not know it")


def _from_base64(value: Any) -> Any:
    """What SGLang's Base64Bytes marker makes of a JSON value: each string base64-decoded (a
    string that is not base64 stays a string, and fails a bytes check)."""
    if isinstance(value, list):
        return [_from_base64(v) for v in value]
    if isinstance(value, str):
        try:
            return base64.b64decode(value, validate=True)
        except ValueError:
            return value
    return value


def _subscript(value: Any, node: ast.Subscript) -> bool:
    outer = ast.unparse(node.value)
    args = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
    if outer == "Annotated":  # Annotated[X, validator]: the value is an X
        if any(ast.unparse(a).startswith("Base64Bytes") for a in args[1:]):  # bytes, as base64 text in JSON
            return _is(_from_base64(value), args[0])
        return _is(value, args[0])
    if outer == "Optional":
        return value is None or _is(value, args[0])
    if outer == "Union":
        return any(_is(value, a) for a in args)
    if outer == "Literal":
        return value in [ast.literal_eval(a) for a in args]
    if outer in ("List", "list"):
        return isinstance(value, list) and all(_is(v, args[0]) for v in value)
    if outer in ("Dict", "dict"):
        return isinstance(value, dict)
    raise AssertionError(f"annotation {ast.unparse(node)!r}: the body reader does not know it")


def has_type(value: Any, annotation: str) -> bool:
    return _is(value, ast.parse(annotation, mode="eval").body)


def check_body(src: Source, path: str, body: Any) -> None:
    """AssertionError unless `body` is one that SGLang's handler for `path` takes as it is."""
    struct = src.route_request_struct(path)
    if struct is None:  # the handler reads no body (flush_cache): send none, or an empty one
        assert body in (None, {}), f"{path} takes no body, got {body!r}"
        return
    assert isinstance(body, dict), (path, body)
    fields = src.struct_fields(struct)
    assert set(body) <= set(fields), f"{path}: {sorted(set(body) - set(fields))} are not fields of {struct}"
    required = {n for n, f in fields.items() if f.default is None}  # no default: the body must carry it
    assert required <= set(body), f"{path}: {struct} requires {sorted(required - set(body))}"
    for name, value in body.items():
        assert has_type(value, fields[name].annotation), \
            f"{path}: {name}={value!r} is not a {fields[name].annotation} ({struct})"
    if isinstance(body.get("sampling_params"), dict):
        unknown = set(body["sampling_params"]) - src.sampling_params()
        assert not unknown, f"{path}: sampling_params {sorted(unknown)} are not SGLang's"
