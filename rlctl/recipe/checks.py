"""How a recipe section says a value is impossible.

A section's `check()` raises `FieldError` with the field's name relative to the section
(`"servers"`, `"sampling.top_p"`, `"extra_args[2]"`); the loader (rlctl/recipe/load.py) walks
the sections, prefixes the section's dotted path and names the file, so every message reaches
the user as `FILE: rollout.servers: must be > 0, got 0`. Sections stay plain dataclasses that
code can build directly (tests, engines) without any of this running.
"""

from __future__ import annotations

import enum
import functools
import math
import re
import typing
import unicodedata
from collections.abc import Iterator
from dataclasses import fields
from typing import Any


class FieldError(ValueError):
    """A well-typed value that cannot work. `key` is relative to the section that raised it
    ("" for the section as a whole)."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key, self.message = key, message


class Section:
    """A recipe section: dataclass fields, plus the checks of those fields' values.

    `check()` looks at the section's own fields (nested sections are checked on their own);
    `check_files()` at the local files it names, which the loader skips when the recipe is only
    simulated (rlctl simulate plans a cluster run whose files are not here).

    A choice given as its string when a section is built in code (`RewardConfig(verifier="math")`)
    becomes its enum member, so `is` comparisons hold however the section was made."""

    def __post_init__(self) -> None:
        for name, choices in _enum_fields(type(self)):
            value = getattr(self, name)
            if not isinstance(value, choices):
                setattr(self, name, choices(value))

    def check(self) -> None:
        """Raise FieldError for the first impossible value."""

    def check_files(self) -> None:
        """Raise FieldError if a local file the section names is missing."""


@functools.cache
def _enum_fields(cls: type) -> tuple[tuple[str, type[enum.Enum]], ...]:
    hints = typing.get_type_hints(cls)
    return tuple((name, t) for name, t in hints.items() if isinstance(t, type) and issubclass(t, enum.Enum))


INT64 = (-(1 << 63), (1 << 63) - 1)
"""Every int a recipe holds fits in 64 bits: it goes on to torch, numpy, Slurm and SGLang."""


def check_numbers(section: Section) -> None:
    """Every number of a section (and in its lists) usable at all: a float is finite (nan and inf
    pass every comparison-based check, and train.lr=inf trains nothing), an int fits in 64 bits.
    The loader runs this on every section before its own check(), so a new float key is covered
    without a word."""
    for f in fields(section):  # type: ignore[arg-type]
        value = getattr(section, f.name)
        items = [(f"{f.name}[{i}]", v) for i, v in enumerate(value)] if isinstance(value, list) else [(f.name, value)]
        for key, v in items:
            if isinstance(v, float) and not math.isfinite(v):
                raise FieldError(key, f"must be a finite number, got {v}")
            if isinstance(v, int) and not isinstance(v, bool) and not INT64[0] <= v <= INT64[1]:
                raise FieldError(key, f"must fit in 64 bits, got a number of {len(str(abs(v)))} digits")


def control_character(text: str) -> str | None:
    """The first character of `text` that breaks or hides a line, escaped ("\\n", "\\x1b"), or
    None: a control character (a tab aside: it is whitespace on the line) or a line or paragraph
    separator. A recipe string goes on into shell lines, #SBATCH directives and command lines,
    where such a character would start a line of its own."""
    for c in text:
        if c != "\t" and unicodedata.category(c) in ("Cc", "Zl", "Zp"):
            return repr(c)[1:-1]
    return None


def _strings(key: str, value: Any) -> Iterator[tuple[str, str]]:
    """(key, string) for a value and the strings in its lists and mappings (a mapping's keys too)."""
    if isinstance(value, str):
        yield key, value
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _strings(f"{key}[{i}]", item)
    elif isinstance(value, dict):
        for name, item in value.items():
            yield from _strings(key, name)
            yield from _strings(f"{key}.{name}", item)


def check_text(section: Section) -> None:
    """Every string of a section (and in its lists and mappings) is one line of text: no control
    character (control_character). The loader runs this on every section after its own check()
    (whose messages say more where a field has rules of its own), so a new string key is covered
    without a word."""
    for f in fields(section):  # type: ignore[arg-type]
        for key, text in _strings(f.name, getattr(section, f.name)):
            bad = control_character(text)
            if bad is not None:
                raise FieldError(key, f"holds a control character ({bad}); write it on one line, without one")


def at_most(key: str, value: float, high: float, what: str = "") -> None:
    """An upper bound that no real run reaches, there so that a typo (an extra three zeros) is an
    error instead of a machine brought down by the processes or memory it asks for."""
    if value > high:
        raise FieldError(key, f"must be <= {high:,}{' ' + what if what else ''}, got {value:,}")


_LONG_QUOTED = re.compile(r"(?<!\w)('[^']{81,}'|\"[^\"]{81,}\")(?!\w)")  # not from the ' of "run's"
_LONG_WORD = re.compile(r"\S{101,}")


def _printable(text: str) -> str:
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def clip(text: str, limit: int = 80) -> str:
    """`text` on one line (control characters escaped) and at most `limit` characters, cut with "..."."""
    text = _printable(text[: limit * 4])
    return text if len(text) <= limit else text[: limit - 3] + "..."


def clip_middle(text: str, limit: int = 80) -> str:
    """As clip, but its middle cut: a long path keeps both its root and its file name."""
    if len(text) > limit * 4:
        text = text[: limit * 2] + text[-limit * 2:]  # the middle goes anyway: escape no more than is kept
    text = _printable(text)
    if len(text) <= limit:
        return text
    head = (limit - 3) // 2
    return text[:head] + "..." + text[len(text) - (limit - 3 - head):]


def clip_message(message: str, limit: int = 400) -> str:
    """An error message on one line, every long value in it (quoted, or a run of 100 characters
    without a space, such as a path) cut to 80 characters, and the whole at most `limit`."""
    message = _LONG_QUOTED.sub(lambda m: m[0][0] + clip(m[0][1:-1]) + m[0][0], message)
    message = _LONG_WORD.sub(lambda m: clip_middle(m[0]), message)
    return clip(message, limit)


def positive(key: str, value: float, *, zero_ok: bool = False) -> None:
    if value < 0 or (value == 0 and not zero_ok):
        raise FieldError(key, f"must be {'>= 0' if zero_ok else '> 0'}, got {value}")


def within(key: str, value: float, low: float, high: float, *, open_low: bool = False, open_high: bool = False) -> None:
    """low <= value <= high, with either end open; the message writes the interval as math does."""
    above = value > low if open_low else value >= low
    below = value < high if open_high else value <= high
    if not (above and below):
        interval = f"{'(' if open_low else '['}{_bound(low)}, {_bound(high)}{')' if open_high else ']'}"
        raise FieldError(key, f"must be in {interval}, got {value}")


def _bound(x: float) -> str:
    """An end of an interval as people write it: 0, 0.5, 86,400, 10,000,000."""
    if isinstance(x, int) or (x.is_integer() and abs(x) < 1e16):
        return f"{int(x):,}"
    return f"{x:g}"


def divides(key: str, divisor: int, what: str, total: int, fix: str) -> None:
    if total % divisor:
        raise FieldError(key, f"{divisor} does not divide {what} ({total}); {fix}")
