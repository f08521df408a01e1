"""The end of a file that may be large and still growing: a role's log, metrics.jsonl.

Only the last bytes are read, so `rlctl status` over hundreds of runs and the supervisor's
failure message stay cheap however long a run has been going.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def tail_lines(path: Path, max_bytes: int) -> list[str] | None:
    """The lines in the last `max_bytes` of a file (the first may be cut); None if it cannot be read."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            return f.read().decode(errors="replace").splitlines()
    except OSError:
        return None


def last_log_line(path: Path, limit: int = 300) -> str | None:
    """The last non-empty line of a log: usually what a crashed process said last."""
    lines = [ln.strip() for ln in tail_lines(path, 8192) or [] if ln.strip()]
    return lines[-1][:limit] if lines else None


def last_jsonl_records(path: Path, n: int, max_bytes: int = 65536) -> list[dict[str, Any]]:
    """Up to the last `n` complete records of a JSONL file, oldest first, from its last
    `max_bytes` (a line cut at the window's start or being appended right now is skipped)."""
    records: list[dict[str, Any]] = []
    for line in reversed(tail_lines(path, max_bytes) or []):
        if len(records) == n:
            break
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records[::-1]


def last_jsonl_record(path: Path) -> dict[str, Any] | None:
    """The last complete record of a JSONL file (a line being appended right now is skipped)."""
    last = last_jsonl_records(path, 1)
    return last[0] if last else None
