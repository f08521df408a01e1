"""YAML that cannot keep rlctl busy: recipes and override values are parsed within bounds.

PyYAML expands aliases while it constructs Python objects, so nine lines of nested aliases (a
"billion laughs") become 10^9 values; a 10,000-deep nesting overflows Python's recursion (and
libyaml's C stack, deeper still); a file of 50 MB is read and parsed whole. Here the text is
checked in three steps before any object is built:

1. its size: at most `max_bytes` (the caller's: MAX_RECIPE_BYTES for a recipe file,
   MAX_OVERRIDE_BYTES for one `key=value` override);
2. its nesting and its number of values as written, from the parser's event stream (an
   iterative state machine, never recursive), stopping at the first collection deeper than
   MAX_DEPTH or the first value past MAX_NODES;
3. its size with every alias expanded, counted over the composed node graph (aliases are shared
   nodes there, so the count costs the unique nodes only), at most MAX_NODES; an alias that
   contains itself is refused; and no mapping gives a key twice (PyYAML would keep the last
   silently, so `run:` written twice would lose the first block without a word).

Only then are the objects constructed. The bounds are far above any recipe (the quickstart's
resolved recipe is about 3 KiB, 5 levels deep and 250 values).
"""

from __future__ import annotations

from typing import Any

import yaml

MAX_RECIPE_BYTES = 1 << 20
"""A recipe file (or a resolved recipe.yaml) is at most 1 MiB."""
MAX_OVERRIDE_BYTES = 64 << 10
"""One `key=value` override is at most 64 KiB."""
MAX_DEPTH = 32
"""Mappings and lists nest at most 32 levels deep."""
MAX_NODES = 10_000
"""At most 10,000 values (keys, scalars, lists and mappings) with every alias expanded."""

try:
    SAFE_LOADER: Any = yaml.CSafeLoader
except AttributeError:  # PyYAML built without libyaml
    SAFE_LOADER = yaml.SafeLoader


class YamlLimit(ValueError):
    """Text over one of the bounds; `mark` is where (a yaml Mark, or None)."""

    def __init__(self, message: str, mark: Any = None) -> None:
        super().__init__(message)
        self.message, self.problem_mark = message, mark


def parse_bounded(text: str, loader: Any = SAFE_LOADER, max_bytes: int = MAX_RECIPE_BYTES) -> Any:
    """The YAML document in `text`, as yaml.load(text, loader) gives it, or YamlLimit if the text
    is over a bound (yaml.YAMLError if it is not YAML)."""
    size = len(text.encode(errors="replace")) if len(text) <= max_bytes else len(text)
    if size > max_bytes:
        raise YamlLimit(f"{_size(size)}, more than the {_size(max_bytes)} allowed")
    try:
        _check_as_written(text, loader)
    except yaml.MarkedYAMLError as e:
        # PyYAML 6.0.4 (its libyaml) stops a nesting 1,000 deep itself, while it scans ahead and
        # before the events reach the count below: the same bound, said as rlctl says it.
        if "nesting depth" not in str(e.problem):
            raise
        raise YamlLimit(f"nested more than {MAX_DEPTH} levels deep", e.problem_mark) from None
    parser = loader(text)
    try:
        node = parser.get_single_node()
        if node is None:
            return None
        check_unique_keys(node)
        expanded = expanded_size(node)
        if expanded > MAX_NODES:
            raise YamlLimit(f"aliases expand it to more than {MAX_NODES:,} values (an alias bomb?); "
                            "write the values out", node.start_mark)
        try:
            return parser.construct_document(node)
        except ValueError as e:  # an int of more than 4300 digits, which int() refuses to read
            raise YamlLimit(f"a value cannot be read ({str(e)[:60]}...)", node.start_mark) from None
    finally:
        parser.dispose()


def _check_as_written(text: str, loader: Any) -> None:
    """YamlLimit at the first collection deeper than MAX_DEPTH or the first value past MAX_NODES,
    as written (aliases not expanded), from the parser's event stream."""
    depth = values = 0
    for event in yaml.parse(text, Loader=loader):
        if isinstance(event, yaml.NodeEvent):  # a scalar, an alias, or the start of a collection
            values += 1
            if values > MAX_NODES:
                raise YamlLimit(f"more than {MAX_NODES:,} values", event.start_mark)
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_DEPTH:
                raise YamlLimit(f"nested more than {MAX_DEPTH} levels deep", event.start_mark)
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1


class DuplicateKey(YamlLimit):
    """A mapping that gives one key twice: YAML forbids it, and PyYAML would keep the last silently."""


def check_unique_keys(root: yaml.Node) -> None:
    """DuplicateKey, marked where the key is given again, for the first mapping that gives a key
    twice (the keys of a `<<` merge aside: a merge is how YAML overrides keys on purpose).
    Iterative, and each node is looked at once however many aliases share it."""
    seen: set[int] = set()
    stack: list[tuple[yaml.Node, str]] = [(root, "")]
    while stack:
        node, where = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            first: dict[tuple[str, str], yaml.Node] = {}
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                    name = (key.tag, key.value)
                    if name in first:
                        dotted = f"{where}.{key.value}" if where else key.value
                        raise DuplicateKey(f"'{dotted}' is given twice (first on line {first[name].start_mark.line + 1}); "
                                           "keep one", key.start_mark)
                    first[name] = key
                    stack.append((value, f"{where}.{key.value}" if where else key.value))
                else:
                    stack.append((value, where))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend((item, where) for item in node.value)


def _size(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB" if n >= 1 << 20 else f"{n / 1024:.0f} KiB"


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def expanded_size(root: yaml.Node, cap: int = MAX_NODES) -> int:
    """How many nodes the document has with every alias expanded, counted up to just over `cap`.
    Iterative (a post-order walk with an explicit stack), and each shared node is counted once
    and its size reused: the cost is the number of unique nodes. YamlLimit for a node that
    contains itself through an alias."""
    size: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, finished = stack.pop()
        key = id(node)
        if finished:
            on_path.discard(key)
            size[key] = min(cap + 1, 1 + sum(size[id(c)] for c in _children(node)))
        elif key in on_path:
            raise YamlLimit("an alias refers to a value that contains it (a recursive structure)", node.start_mark)
        elif key not in size:
            on_path.add(key)
            stack.append((node, True))
            stack.extend((c, False) for c in _children(node))
    return size[id(root)]
