"""Megatron-core's own source, read from its wheel: what rlctl's Megatron trainer is held to where
Megatron cannot run (it needs CUDA and, from 0.17, Python 3.12). Nothing here imports Megatron.

    src = source("0.19.2")
    src.function("megatron/core/transformer/dot_product_attention.py", "DotProductAttention.forward")
    src.compiled("megatron/core/transformer/utils.py", "get_default_causal_mask", {"torch": torch})

`compiled` turns one of Megatron's functions (or classes) into a Python object from its source
text, with the globals the caller gives: its decorators and annotations dropped and every
`device=` argument removed, so that code written for CUDA runs the same arithmetic on the CPU.
The tests run Megatron's own attention math this way (tests/test_megatron_attention.py); what
the function calls outside the given globals fails with a NameError instead of being guessed.

Wheels: $RLCTL_MEGATRON_CORE_WHEELS, else ~/.cache/rlctl/megatron_core-wheels, filled with
`pip download --no-deps --only-binary=:all: --python-version 3.12 megatron-core==X -d DIR`.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import wheels
from wheels import MissingWheel  # noqa: F401 - the tests catch it from here

PACKAGE = "megatron_core"
SUPPORTED = ("0.19.2",)
FILES = (
    "megatron/core/transformer/attention.py",
    "megatron/core/transformer/dot_product_attention.py",
    "megatron/core/transformer/enums.py",
    "megatron/core/transformer/utils.py",
    "megatron/core/transformer/transformer_config.py",
    "megatron/core/transformer/transformer_layer.py",
    "megatron/core/transformer/spec_utils.py",
    "megatron/core/fusions/fused_softmax.py",
    "megatron/core/models/gpt/gpt_layer_specs.py",
    "megatron/core/recompute.py",
)


class _ForCpu(ast.NodeTransformer):
    """Decorators, annotations and `device=` arguments removed (see the module docstring)."""

    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.FunctionDef:
        node.decorator_list, node.returns = [], None
        for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs:
            a.annotation = None
        for a in (node.args.vararg, node.args.kwarg):
            if a is not None:
                a.annotation = None
        self.generic_visit(node)
        return node

    def visit_ClassDef(self, node: ast.ClassDef) -> ast.ClassDef:
        node.decorator_list = []
        self.generic_visit(node)
        return node

    def visit_Call(self, node: ast.Call) -> ast.Call:
        node.keywords = [k for k in node.keywords if k.arg != "device"]
        self.generic_visit(node)
        return node


class Source:
    def __init__(self, root: Path) -> None:
        self.root = root
        self._trees: dict[str, ast.Module] = {}

    def tree(self, path: str) -> ast.Module:
        if path not in self._trees:
            self._trees[path] = ast.parse((self.root / path).read_text(), path)
        return self._trees[path]

    def node(self, path: str, qualname: str) -> ast.FunctionDef | ast.ClassDef:
        """The def or class `qualname` ("Class.method" or "function") of the file at `path`."""
        scope: list[ast.stmt] = self.tree(path).body
        found = None
        for part in qualname.split("."):
            found = next((n for n in scope if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part), None)
            if found is None:
                raise LookupError(f"{path}: no {qualname}")
            scope = found.body
        return found

    def function(self, path: str, qualname: str) -> ast.FunctionDef:
        node = self.node(path, qualname)
        assert isinstance(node, ast.FunctionDef), qualname
        return node

    def compiled(self, path: str, qualname: str, namespace: dict[str, Any]) -> Any:
        """The def or class, built from its source with `namespace` as its globals."""
        node = _ForCpu().visit(ast.parse(ast.unparse(self.node(path, qualname))))
        ast.fix_missing_locations(node)
        scope = dict(namespace)
        exec(compile(node, f"{self.root / path}:{qualname}", "exec"), scope)  # noqa: S102 - Megatron's own source
        return scope[qualname.split(".")[-1]]

    def dataclass_fields(self, path: str, name: str) -> dict[str, str]:
        """Field name -> its annotation's source text, of a dataclass of the file."""
        cls = self.node(path, name)
        return {n.target.id: ast.unparse(n.annotation) for n in cls.body
                if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}

    def calls(self, path: str, where: str | None = None) -> list[ast.Call]:
        """Every call in the file, or in the def or class `where` of it."""
        tree = self.node(path, where) if where else self.tree(path)
        return [n for n in ast.walk(tree) if isinstance(n, ast.Call)]


def parameters(fn: ast.FunctionDef) -> list[str]:
    """A def's parameter names in order (positional-only, positional, keyword-only), without self."""
    names = [a.arg for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs]
    return names[1:] if names and names[0] == "self" else names


def literal_choices(annotation: str) -> set[str]:
    """The strings of a `Literal[...]` inside an annotation's text (Optional[Literal['a', 'b']])."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(annotation, mode="eval")):
        if isinstance(node, ast.Subscript) and ast.unparse(node.value).endswith("Literal"):
            elts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            out |= {e.value for e in elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
    return out


def source(version: str) -> Source:
    return Source(wheels.extract(PACKAGE, wheels.wheel(PACKAGE, version), FILES))
