"""The recipe reference: every key of the schema with its type, default, choices and meaning,
read from the section dataclasses themselves and written as Markdown.

    python -m rlctl.recipe.reference > docs/recipe.md

A key's meaning is its field's attribute docstring (the string under the field), a section's
introduction its class docstring, and a choice's meaning its enum member's docstring, so the
reference cannot say what the code does not. tests/test_recipe_reference.py fails when a key has
no docstring or when docs/recipe.md differs from this module's output. It parses the source of
the schema's modules with ast and imports nothing beyond the schema.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import functools
import inspect
import sys
import textwrap
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass

from rlctl.recipe.pool import PoolFile
from rlctl.recipe.schema import Recipe

REGENERATE = "python -m rlctl.recipe.reference > docs/recipe.md"


@dataclass(frozen=True)
class Key:
    """One leaf of the schema: a value a recipe sets."""

    key: str
    """Dotted, from the top of the file (`rollout.sampling.top_p`)."""
    type: str
    """As the field is annotated (`int`, `list[str]`, `str | None`), or the enum's name."""
    default: str
    """As a recipe would write it."""
    doc: str
    """The field's docstring, on one line; empty when the field has none."""
    choices: tuple[tuple[str, str], ...] = ()
    """For an enum: each value and its member's docstring (empty when it has none)."""


@dataclass(frozen=True)
class Part:
    """One section of the schema and the leaves directly in it."""

    key: str
    """Dotted prefix of its keys; empty for the top level."""
    doc: str
    """The section's class docstring (empty when it has none)."""
    keys: tuple[Key, ...]


def _one_line(text: str) -> str:
    return " ".join(text.split())


@functools.cache
def _class_node(cls: type) -> ast.ClassDef:
    node = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    assert isinstance(node, ast.ClassDef), cls
    return node


def class_doc(cls: type) -> str:
    """The docstring written in the class body (not the one dataclass makes up)."""
    return inspect.cleandoc(ast.get_docstring(_class_node(cls)) or "")


@functools.cache
def attribute_docs(cls: type) -> dict[str, str]:
    """Name -> the string literal right under its assignment in the class body."""
    docs = {}
    body = _class_node(cls).body
    for stmt, after in zip(body, body[1:]):
        target = stmt.target if isinstance(stmt, ast.AnnAssign) else (
            stmt.targets[0] if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 else None)
        if (isinstance(target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[target.id] = inspect.cleandoc(after.value.value)
    return docs


def _section(hint: object) -> type | None:
    """The dataclass a field holds (`X` or `X | None`), else None."""
    union = isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
    args = typing.get_args(hint) if union else ()
    for candidate in (hint, *args):
        if isinstance(candidate, type) and dataclasses.is_dataclass(candidate):
            return candidate
    return None


def _listed_section(hint: object) -> type | None:
    """The dataclass of a `list[X]` field, else None."""
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint)
        return item if isinstance(item, type) and dataclasses.is_dataclass(item) else None
    return None


def _value(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value or '""'
    if isinstance(value, float):
        text = repr(value)
        return f"{value:g}" if "e" not in text and len(text) > 10 else text
    if isinstance(value, list):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_value(v)}" for k, v in value.items()) + "}"
    return str(value)


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return _value(f.default)
    if f.default_factory is not dataclasses.MISSING:
        return _value(f.default_factory())
    return "(required)"


def _choices(hint: object) -> tuple[tuple[str, str], ...]:
    if not (isinstance(hint, type) and issubclass(hint, enum.Enum)):
        return ()
    docs = attribute_docs(hint)
    return tuple((str(m.value), _one_line(docs.get(m.name, ""))) for m in hint)


def parts(cls: type = Recipe, prefix: str = "") -> Iterator[Part]:
    """The sections of a schema, depth first, each with its own leaves."""
    hints = typing.get_type_hints(cls)
    docs = attribute_docs(cls)
    keys, nested = [], []
    for f in dataclasses.fields(cls):
        hint, key = hints[f.name], f"{prefix}{f.name}"
        if (section := _section(hint)) is not None:
            nested.append((section, f"{key}."))
        elif (section := _listed_section(hint)) is not None:
            nested.append((section, f"{key}[]."))
        else:
            type_name = hint.__name__ if isinstance(hint, type) and issubclass(hint, enum.Enum) else str(f.type)
            keys.append(Key(key, type_name, _default(f), _one_line(docs.get(f.name, "")), _choices(hint)))
    yield Part(prefix.rstrip("."), class_doc(cls), tuple(keys))
    for section, sub in nested:
        yield from parts(section, sub)


def undocumented(cls: type = Recipe) -> list[str]:
    """The keys whose field has no docstring."""
    return [k.key for p in parts(cls) for k in p.keys if not k.doc]


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _sentence(text: str) -> str:
    return text if text.endswith((".", ")")) else f"{text}."


def _row(key: Key) -> str:
    type_name, meaning = key.type, key.doc
    if key.choices:
        type_name = "one of " + ", ".join(f"`{value}`" for value, _ in key.choices)
        meaning = " ".join([meaning, *(f"`{value}`: {_sentence(doc)}" for value, doc in key.choices if doc)]).strip()
    return f"| `{key.key}` | {_cell(type_name)} | `{_cell(key.default)}` | {_cell(meaning)} |"


def _render_parts(cls: type, top: str) -> list[str]:
    lines = []
    for part in parts(cls):
        if not part.keys:
            continue
        lines += ["", f"### {part.key or top}", ""]
        if part.doc:
            lines += [line for paragraph in part.doc.split("\n\n") for line in (_one_line(paragraph), "")]
        lines += ["| key | type | default | meaning |", "|---|---|---|---|"]
        lines += [_row(k) for k in part.keys]
    return lines


HEADER = f"""# Recipe reference

Every key a recipe (and a pool file) can set: its type, its default and what it means. This page
is generated from the docstrings of the recipe's dataclasses in rlctl/recipe/; edit those, then
run `{REGENERATE}` (tests/test_recipe_reference.py fails while this page is stale).

A recipe is YAML; `rlctl launch RECIPE key=value ...` overrides any key by its dotted name
(`rollout.servers=4`, `slurm.setup='["module load cuda"]'`). A key not listed here is refused with
the valid keys of its section, and a key given twice in one mapping with the line it is given
again on; a value of the wrong type or out of its bounds (every number has one, a range no real
run leaves) is refused with one line naming the file, the key and the range, and so is a string
holding a control character (a newline, a carriage return, an escape: every string is one line).
`model.path` and `data.path` are relative to the recipe file."""


def render() -> str:
    """docs/recipe.md, whole."""
    lines = [HEADER, "", "## Recipe", *_render_parts(Recipe, "top level"), "",
             "## Pool file", "",
             "`rlctl pool up POOL.yaml` and `rlctl simulate POOL.yaml` read a pool file "
             "(docs/pool.md); a run attaches with `launcher: pool` and its own `pool:` section above.",
             *_render_parts(PoolFile, "top level")]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv:
        print(f"usage: {REGENERATE}", file=sys.stderr)
        return 2
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
