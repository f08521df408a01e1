"""The end of a file that may be large and still growing: a role's log, metrics.jsonl.

Only the last bytes are read, so `rlctl status` over hundreds of runs and the supervisor's
failure message stay cheap however long a run has been going.

Every file is opened with `open_regular`: a FIFO, a directory or a device where a run's file
should be is refused at once (never waited on), so one damaged run directory cannot hang or
crash a command that reads many.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from collections.abc import Iterator
from typing import Any, BinaryIO

TAIL_CAP = 16 << 20
"""The widest window a JSONL tail grows to when the lines at the end are longer than asked for."""


def _regular_fd(path: Path) -> tuple[int, os.stat_result]:
    """open_regular's descriptor, and the file's stat."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = ("a directory" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode) else
                    "a socket" if stat.S_ISSOCK(st.st_mode) else "a device")
            raise OSError(0, f"is {kind}, not a file", str(path))
        return fd, st
    except BaseException:
        os.close(fd)
        raise


def open_regular(path: Path) -> BinaryIO:
    """`path` opened for reading, if it is a regular file (a symlink to one is followed). Raises
    OSError: FileNotFoundError if it is missing (or a dangling symlink), else one whose strerror
    says what it is instead ("a FIFO", "a directory"). A FIFO is opened without blocking."""
    fd, _ = _regular_fd(path)
    try:
        return os.fdopen(fd, "rb")  # O_NONBLOCK does nothing to a regular file's reads
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: Path, cap: int) -> bytes | None:
    """What a regular file holds (open_regular's checks and errors), or None if that is more
    than `cap` bytes: one open, one stat, one read (`rlctl status` reads thousands of run.json)."""
    fd, st = _regular_fd(path)
    try:
        data = os.pread(fd, min(st.st_size, cap) + 1, 0)
    finally:
        os.close(fd)
    return data if len(data) <= cap else None


def read_capped(f: BinaryIO, cap: int) -> bytes | None:
    """The rest of an open regular file, or None if it holds more than `cap` bytes. Reads what
    the file holds (never allocates `cap` bytes for a small file)."""
    size = os.fstat(f.fileno()).st_size - f.tell()
    data = f.read(min(max(size, 0), cap) + 1)
    return data if len(data) <= cap else None


def describe_open_error(name: str, path: Path, e: OSError) -> str:
    """Why a run's file cannot be read, in a few words: "no run.json", "run.json is a FIFO, not
    a file", "run.json is a dangling symlink", "cannot read run.json (Permission denied)"."""
    if isinstance(e, FileNotFoundError):
        return f"{name} is a dangling symlink" if os.path.islink(path) else f"no {name}"
    if isinstance(e, NotADirectoryError):
        return "the run directory is not a directory"
    if e.errno == 0:
        return f"{name} {e.strerror}"
    return f"cannot read {name} ({e.strerror})"


def _tail_bytes(path: Path, max_bytes: int) -> tuple[bytes, bool]:
    """The last `max_bytes` of a file, and whether they start inside it (the first line may be cut)."""
    fd, st = _regular_fd(path)
    try:
        start = max(0, st.st_size - max_bytes)
        return os.pread(fd, st.st_size - start, start), start > 0
    finally:
        os.close(fd)


def tail_lines(path: Path, max_bytes: int) -> list[str] | None:
    """The lines in the last `max_bytes` of a file (the first may be cut); None if it cannot be read."""
    try:
        data, _ = _tail_bytes(path, max_bytes)
    except OSError:
        return None
    return data.decode(errors="replace").splitlines()


def last_log_line(path: Path, limit: int = 300) -> str | None:
    """The last non-empty line of a log: usually what a crashed process said last."""
    lines = [ln.strip() for ln in tail_lines(path, 8192) or [] if ln.strip()]
    return lines[-1][:limit] if lines else None


def parse_record(line: bytes) -> dict[str, Any] | None:
    """One JSONL line as a record, or None: not UTF-8, not JSON (NUL bytes, a cut line), nested
    too deep, or JSON that is not an object."""
    try:
        record = json.loads(line.decode())  # decoded first: json.loads would take bytes for UTF-16 too
    except (ValueError, RecursionError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return None
    return record if isinstance(record, dict) else None


def read_jsonl_counted(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The records of a JSONL file, and how many of its lines are not JSON objects (bad bytes,
    NUL bytes, a cut line, a list). Its last line, when it has no newline yet, is being written
    and is skipped without being counted. A missing file has no records; a file that cannot be
    read (a FIFO, a directory) raises OSError (see rlctl/run/tail.py's open_regular)."""
    try:
        with open_regular(path) as f:
            data = f.read()
    except FileNotFoundError:
        return [], 0
    lines = data.split(b"\n")
    last = lines.pop()
    out, bad = [], 0
    for line in lines:
        record = parse_record(line)
        if record is not None:
            out.append(record)
        elif line.strip():
            bad += 1
    record = parse_record(last) if last.strip() else None
    return out + ([record] if record is not None else []), bad


def stream_jsonl(path: Path, max_line: int, chunk: int = 1 << 16) -> Iterator[dict[str, Any] | None]:
    """Each line of a JSONL file in order, read a chunk at a time: its record, or None for a line
    that is not a JSON object or is longer than `max_line` bytes (skipped as it is read, never
    held whole: memory stays under max_line + chunk, whatever the file's size). Blank lines are
    passed over; the last line, when it has no newline yet, is being written and is given only if
    it is a record (as read_jsonl_counted). A missing file has no lines; one that cannot be read
    (a FIFO, a directory) raises OSError."""
    try:
        f = open_regular(path)
    except FileNotFoundError:
        return
    with f:
        line, too_long = bytearray(), False
        while data := f.read(chunk):
            start = 0
            while (end := data.find(b"\n", start)) >= 0:
                if too_long or len(line) + end - start > max_line:
                    yield None
                else:
                    line += data[start:end]
                    if line.strip():
                        yield parse_record(bytes(line))
                line, too_long, start = bytearray(), False, end + 1
            if not too_long:
                line += data[start:]
                if len(line) > max_line:
                    line, too_long = bytearray(), True
        record = parse_record(bytes(line)) if line.strip() and not too_long else None
        if record is not None:
            yield record


def jsonl_tail(path: Path, n: int, max_bytes: int = 65536) -> tuple[list[dict[str, Any]], list[str]]:
    """Up to the last `n` complete records of a JSONL file, oldest first, and what is wrong with
    the file, if anything ("metrics.jsonl: 2 lines are not JSON objects", "events.jsonl is a
    FIFO, not a file"). Read from its last `max_bytes`; a window that holds no record at all
    while the file goes on before it (one very long line) doubles, up to TAIL_CAP. A line cut at
    the window's start, or being appended right now (no newline yet), is skipped and not counted."""
    while True:
        try:
            data, cut = _tail_bytes(path, max_bytes)
        except FileNotFoundError:
            return [], []
        except OSError as e:
            return [], [describe_open_error(path.name, path, e)]
        records, bad = _records_from_end(data, cut, n)
        if records or not cut or max_bytes >= TAIL_CAP:
            break
        max_bytes = min(TAIL_CAP, max_bytes * 2)
    what = "lines are not JSON objects" if bad > 1 else "line is not a JSON object"
    problems = [f"{path.name}: {bad} {what}"] if bad else []
    return records[::-1], problems


def _records_from_end(data: bytes, cut: bool, n: int) -> tuple[list[dict[str, Any]], int]:
    """Up to `n` records from the end of `data`, newest first, and the number of bad lines seen."""
    lines = data.split(b"\n")[1:] if cut else data.split(b"\n")
    last = lines.pop() if lines else b""  # after the last newline: nothing, or a line being written
    first = parse_record(last) if last.strip() else None
    records = [first] if first is not None else []
    bad = 0
    for line in reversed(lines):
        if len(records) >= n:
            break
        record = parse_record(line)
        if record is not None:
            records.append(record)
        elif line.strip():
            bad += 1
    return records, bad


def last_jsonl_records(path: Path, n: int, max_bytes: int = 65536) -> list[dict[str, Any]]:
    """Up to the last `n` complete records of a JSONL file, oldest first (see jsonl_tail)."""
    return jsonl_tail(path, n, max_bytes)[0]


def last_jsonl_record(path: Path) -> dict[str, Any] | None:
    """The last complete record of a JSONL file (a line being appended right now is skipped)."""
    last = last_jsonl_records(path, 1)
    return last[0] if last else None
