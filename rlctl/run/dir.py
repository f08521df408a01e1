"""The run directory, the single source of truth of a run.

    runs/<run-id>/
      recipe.yaml     the resolved recipe (every default filled in)
      run.json        id, state, processes (role, pid, host, port, log), created/ended, exit reason
      events.jsonl    append-only timeline; `t` is seconds since the epoch on the writer's RunClock
      metrics.jsonl   one line per step
      samples.jsonl   prompts, responses, answers and rewards of a few groups a step (run.sample_groups)
      logs/<role>.log one log per process

Writes are atomic (temp file + rename) or appends of whole lines. run.json is read-modify-written
under an flock, because the supervisor and the workers each record their own part of it.

Several processes on several hosts write events.jsonl: the controller (the pipeline's events),
the local supervisor, the Slurm batch script's helpers on a compute node, and `rlctl launch` and
`rlctl status` on a login node. They all stamp `t` on one time base, the wall clock (hosts agree to
within NTP's precision), read through a RunClock so that durations within one process stay
monotonic; events other than the controller's name their `host` (run_start names the
controller's).

Nothing here imports torch: `rlctl status` reads hundreds of runs through this module.
"""

from __future__ import annotations

import datetime as _dt
import enum
import fcntl
import json
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Callable, Iterator

from rlctl.errors import RunError
from rlctl.run.check import info_problem, one_line
from rlctl.run.ids import RUN_ID, make_run_path, new_run_id  # noqa: F401 - new_run_id: rlctl launch --dry-run
from rlctl.run.tail import describe_open_error, read_jsonl_counted, read_regular

SCHEMA_VERSION = 1


class RunState(enum.StrEnum):
    STARTING = "starting"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    DRY_RUN = "dry-run"
    """Left by an older `rlctl launch --dry-run` (nothing submitted); a dry run now writes nothing."""

    @property
    def finished(self) -> bool:
        return self in (RunState.COMPLETED, RunState.FAILED, RunState.CANCELLED, RunState.DRY_RUN)


_STATES = tuple(s.value for s in RunState)


def now_iso() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _jsonl_line(record: dict[str, Any]) -> bytes:
    return (json.dumps(record, separators=(",", ":")) + "\n").encode()


def _append(path: Path, data: bytes) -> None:
    # One write() of whole lines with O_APPEND: concurrent appenders never interleave within a line.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    _append(path, _jsonl_line(record))


class RunClock:
    """Seconds since the epoch that never go backwards: the wall clock read once, at creation,
    plus the monotonic time elapsed since. Events from different processes and hosts so share one
    time base, while a process's own durations are immune to wall-clock steps (NTP, DST)."""

    def __init__(self) -> None:
        self._wall0 = time.time()
        self._mono0 = time.monotonic()

    def now(self) -> float:
        return self._wall0 + (time.monotonic() - self._mono0)


PROCESS_CLOCK = RunClock()
"""The clock of every event this process writes through RunDir.event."""
HOST = os.uname().nodename  # what socket.gethostname() says, without importing socket


class EventLog:
    """events.jsonl written in batches by a process that emits many events (the controller, a
    simulation): lines are buffered and appended with one write() at each `flush()`, and at a
    `write()` that finds `max_bytes` waiting or the oldest waiting line `max_delay_s` old (the
    recorder flushes at every step end, so nothing waits longer than a step). Lines from other
    writers never land inside one of ours, since a batch holds whole lines."""

    def __init__(self, path: Path, max_bytes: int = 1 << 20, max_delay_s: float = 1.0) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.max_delay_s = max_delay_s
        self._lines: list[bytes] = []
        self._size = 0
        self._since = 0.0

    def write(self, event: dict[str, Any]) -> None:
        line = _jsonl_line(event)
        if not self._lines:
            self._since = time.monotonic()
        self._lines.append(line)
        self._size += len(line)
        if self._size >= self.max_bytes or time.monotonic() - self._since >= self.max_delay_s:
            self.flush()

    def flush(self) -> None:
        if self._lines:
            _append(self.path, b"".join(self._lines))
            self._lines.clear()
            self._size = 0


class UnreadableRun(RunError):
    """A run directory that cannot be read: run.json (or the file a command needs) is missing,
    not a file, not JSON or not what a run.json holds. A command naming the run prints one line
    and exits 1; `rlctl status` and `rlctl compare` show the run as `unreadable: why` and go on."""

    def __init__(self, run_id: str, why: str) -> None:
        self.run_id, self.why = run_id, why
        super().__init__(f"{one_line(run_id, 120)}: unreadable: {why}")


MAX_RUN_JSON = 16 << 20
"""A run.json larger than this (16 MiB; a real one is a few KiB) is not read."""
SIMULATION_PREFIX = "sim-"
"""Before the name of a simulation's run (`rlctl simulate`): sim-quickstart-... is listed with the
runs, but `rlctl status quickstart` (a name, or the start of an id) finds only the real runs."""


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSONL file; lines that are not JSON objects are skipped (read_jsonl_counted)."""
    return read_jsonl_counted(path)[0]


def pid_alive(pid: int | None, expect_in_cmdline: str | None = None) -> bool:
    """True if pid runs and is not a zombie (and, if given, its command line mentions the run)."""
    if not pid:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    if stat.rsplit(")", 1)[-1].split()[0] == "Z":
        return False
    if expect_in_cmdline is not None:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            return False
        return expect_in_cmdline in cmdline
    return True


@dataclass
class RunDir:
    path: Path

    @property
    def id(self) -> str:
        return self.path.name

    @property
    def run_json(self) -> Path:
        return self.path / "run.json"

    @property
    def events_path(self) -> Path:
        return self.path / "events.jsonl"

    @property
    def metrics_path(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def samples_path(self) -> Path:
        """Prompts, responses and rewards of run.sample_groups groups a step (rlctl/run/samples.py)."""
        return self.path / "samples.jsonl"

    @property
    def eval_path(self) -> Path:
        """One record per held-out set per evaluation (rlctl/control/evaluation.py); metrics.jsonl
        stays one record per step."""
        return self.path / "eval.jsonl"

    def evals(self) -> list[dict[str, Any]]:
        return self.jsonl(self.eval_path)[0] if self.eval_path.exists() else []

    @property
    def recipe_path(self) -> Path:
        return self.path / "recipe.yaml"

    @property
    def logs(self) -> Path:
        return self.path / "logs"

    def log_path(self, role: str) -> Path:
        """logs/<role>.log; a Slurm run keeps each attempt's logs in logs/attempt-<N>/,
        and the batch script's own output in logs/slurm-<job id>.out (role "job")."""
        local = self.logs / f"{role}.log"
        if local.exists():
            return local
        if role == "job":
            outs = sorted(self.logs.glob("slurm-*.out"), key=_mtime)
            return outs[-1] if outs else local
        attempts = sorted((p for p in self.logs.glob("attempt-*") if p.name[8:].isdigit()), key=lambda p: int(p.name[8:]))
        return attempts[-1] / f"{role}.log" if attempts else local

    def log_files(self) -> dict[str, Path]:
        """Every role's current log, by role."""
        found = {p.stem: p for p in self.logs.glob("*.log")}
        for role in {p.stem for p in self.logs.glob("attempt-*/*.log")} - found.keys():
            found[role] = self.log_path(role)
        if any(self.logs.glob("slurm-*.out")):
            found["job"] = self.log_path("job")
        return dict(sorted(found.items()))

    # -- run.json ------------------------------------------------------------------------------

    def read(self) -> dict[str, Any]:
        """run.json, checked (rlctl/run/check.py): it holds the keys and types readers rely on.
        Raises UnreadableRun saying why when it is missing, not a regular file (a directory, a
        FIFO, a dangling symlink: refused at once, never waited on), larger than MAX_RUN_JSON,
        not UTF-8 JSON, or not what a run.json holds."""
        try:
            raw = read_regular(self.run_json, MAX_RUN_JSON)
        except OSError as e:
            raise UnreadableRun(self.id, describe_open_error("run.json", self.run_json, e)) from None
        if raw is None:
            raise UnreadableRun(self.id, f"run.json is larger than {MAX_RUN_JSON >> 20} MiB")
        if not raw.strip():
            raise UnreadableRun(self.id, "run.json is empty")
        try:
            data = json.loads(raw.decode())  # decoded first: json.loads would take bytes for UTF-16 too
        except ValueError as e:  # not UTF-8, not JSON
            raise UnreadableRun(self.id, f"run.json is not UTF-8 JSON ({one_line(str(e), 80)})") from None
        except RecursionError:
            raise UnreadableRun(self.id, "run.json is nested too deep to be a run.json") from None
        problem = info_problem(data, _STATES)
        if problem:
            raise UnreadableRun(self.id, problem)
        return data

    @contextmanager
    def _locked(self) -> Iterator[None]:
        fd = os.open(self.path / ".run.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def update(self, fn: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        with self._locked():
            data = self.read()
            fn(data)
            write_atomic(self.run_json, json.dumps(data, indent=2) + "\n")
            return data

    def set_state(self, state: RunState, reason: str | None = None) -> None:
        def apply(d: dict[str, Any]) -> None:
            if RunState(d["state"]).finished:
                return  # the first final state wins: a failure is not overwritten by the cleanup after it
            d["state"] = state.value
            if state.finished:
                d["ended"] = now_iso()
                d["exit_reason"] = reason
        self.update(apply)

    def record_process(self, role: str, **info: Any) -> None:
        info.setdefault("host", HOST)

        def apply(d: dict[str, Any]) -> None:
            d["processes"].setdefault(role, {}).update(info)
        self.update(apply)

    # -- events and metrics --------------------------------------------------------------------

    def event(self, kind: str, **fields: Any) -> None:
        """Append one event, stamped now on this process's RunClock and with this host's name."""
        append_jsonl(self.events_path, {"t": PROCESS_CLOCK.now(), "event": kind, "host": HOST, **fields})

    def jsonl(self, path: Path) -> tuple[list[dict[str, Any]], int]:
        """A JSONL file of the run: its records, and how many lines are not JSON objects (skipped).
        Raises UnreadableRun when the file cannot be read at all (a FIFO, a directory)."""
        try:
            return read_jsonl_counted(path)
        except OSError as e:
            raise UnreadableRun(self.id, describe_open_error(path.name, path, e)) from None

    def events(self) -> list[dict[str, Any]]:
        return self.jsonl(self.events_path)[0]

    def metrics(self) -> list[dict[str, Any]]:
        return self.jsonl(self.metrics_path)[0]

    def append_metrics(self, record: dict[str, Any]) -> None:
        append_jsonl(self.metrics_path, record)

    def append_eval(self, record: dict[str, Any]) -> None:
        append_jsonl(self.eval_path, record)


def create_run_dir(output_dir: Path, name: str, recipe_yaml: str, info: dict[str, Any], *,
                   shared_group: bool = False) -> RunDir:
    """Make runs/<id>/ with recipe.yaml, run.json (state starting) and the run's token (0600).
    The directory is its owner's alone (0700), or readable by its group too (0750,
    `run.shared_group`): the token file stays 0600 either way."""
    from rlctl.process.auth import create_token

    output_dir.mkdir(parents=True, exist_ok=True)
    run_id, path = make_run_path(output_dir, name)  # rlctl/run/ids.py: never another run's directory
    path.chmod(0o750 if shared_group else 0o700)  # exactly, whatever the umask
    create_token(path)
    (path / "logs").mkdir()
    rd = RunDir(path)
    write_atomic(rd.recipe_path, recipe_yaml)
    data = {
        "schema": SCHEMA_VERSION,
        "id": run_id,
        "name": name,
        "state": RunState.STARTING.value,
        "created": now_iso(),
        "ended": None,
        "exit_reason": None,
        "processes": {},
        **info,
    }
    write_atomic(rd.run_json, json.dumps(data, indent=2) + "\n")
    rd.events_path.touch()
    rd.metrics_path.touch()
    return rd


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:  # a dangling symlink
        return 0.0
