"""What a run.json must hold before anything reads it: the keys and types that `rlctl status`,
`compare`, `cancel`, `trace` and the launchers rely on (rlctl/run/dir.py's `RunDir.read()` checks
every run.json it reads with `info_problem`).

The check covers only what readers use; keys it does not know are left alone, so a newer writer
can add keys without older readers calling its runs unreadable. A value that fails it would
otherwise become a KeyError or TypeError deep in one command, and one damaged run directory would
stop `rlctl status` for every run.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Collection
from typing import Any

# key -> (the JSON types it may have, whether it must be there). None is allowed where not required.
_FIELDS: dict[str, tuple[tuple[type, ...], bool]] = {
    "id": ((str,), True),
    "name": ((str,), True),
    "state": ((str,), True),
    "created": ((str,), True),
    "ended": ((str,), False),
    "exit_reason": ((str,), False),
    "processes": ((dict,), False),
    "launcher": ((str,), False),
    "mode": ((str,), False),
    "colocated": ((bool,), False),
    "steps_total": ((int,), False),
    "slurm": ((dict,), False),
    "tracking": ((dict,), False),
    "code": ((dict,), False),
}
_JSON_NAMES = {dict: "an object", list: "a list", str: "a string", int: "a number", float: "a number",
               bool: "a boolean", type(None): "null"}


def one_line(text: str, limit: int = 80) -> str:
    """`text` on one line (control characters escaped) and at most `limit` characters, cut with "..."."""
    if len(text) <= limit and text.isprintable():
        return text
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[: limit * 4])
    return text if len(text) <= limit else text[: limit - 3] + "..."


def json_kind(value: Any) -> str:
    return _JSON_NAMES.get(type(value), type(value).__name__)


def _typed(value: Any, types: tuple[type, ...]) -> bool:
    return isinstance(value, types) and not (isinstance(value, bool) and bool not in types)


def info_problem(data: Any, states: Collection[str]) -> str | None:
    """What is wrong with a parsed run.json, in a few words, or None when readers can trust it."""
    if not isinstance(data, dict):
        return f"run.json holds {json_kind(data)}, not an object"
    for key, (types, required) in _FIELDS.items():
        if key not in data or (data[key] is None and not required):
            if required:
                return f"run.json has no '{key}'"
            continue
        if not _typed(data[key], types):
            want = " or ".join(_JSON_NAMES[t] for t in types)
            return f"run.json '{key}' is {json_kind(data[key])} ({one_line(json.dumps(data[key]), 40)}), not {want}"
    if data["state"] not in states:
        return f"run.json 'state' is '{one_line(data['state'], 40)}', not one of {', '.join(states)}"
    for key in ("created", "ended"):
        problem = _time_problem(key, data.get(key))
        if problem:
            return problem
    return _processes_problem(data.get("processes") or {}) or _nested_problem(data)


def _time_problem(key: str, value: str | None) -> str | None:
    if value is None:
        return None
    try:
        when = dt.datetime.fromisoformat(value)
    except ValueError:
        return f"run.json '{key}' is not an ISO time: '{one_line(value, 40)}'"
    return None if when.tzinfo is not None else f"run.json '{key}' has no time zone: '{one_line(value, 40)}'"


def _processes_problem(processes: dict[str, Any]) -> str | None:
    for role, p in processes.items():
        if not isinstance(p, dict):
            return f"run.json process '{one_line(role, 40)}' is {json_kind(p)}, not an object"
        pid = p.get("pid")
        if pid is not None and not _typed(pid, (int,)):
            return f"run.json process '{one_line(role, 40)}' has pid {one_line(json.dumps(pid), 40)}, not a number"
    return None


def _nested_problem(data: dict[str, Any]) -> str | None:
    """The objects inside run.json that status reads: slurm.job_id and slurm.last, tracking.wandb."""
    for outer, inner, types in (("slurm", "job_id", (str,)), ("slurm", "last", (dict,)), ("tracking", "wandb", (dict,))):
        value = (data.get(outer) or {}).get(inner)
        if value is not None and not _typed(value, types):
            return f"run.json '{outer}.{inner}' is {json_kind(value)}, not {_JSON_NAMES[types[0]]}"
    return None
