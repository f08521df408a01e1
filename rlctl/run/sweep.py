"""A sweep: one recipe over a grid of overrides and seeds, as runs under one sweep id.

    rlctl sweep recipes/quickstart.yaml train.lr=1e-4,3e-4 --seeds 2

The grid is the product of every `key=a,b,c` given (commas inside [..] or {..} belong to the
value) and, with --seeds N, run.seed = 0..N-1. Every point is checked as a recipe before any run
starts. The sweep's record is OUTPUT_DIR/.sweeps/SWEEP_ID.json (hidden, so that it is never taken
for a run; `rlctl status` lists the sweeps under the runs): the grid, and per point its overrides,
its values and its run id once started.

Local runs start at most `parallel` at a time and the driver waits for each (each run is several
processes; a 2-core machine takes one at a time). Under Slurm each point is its own heterogeneous
job, submitted at once (Slurm cannot make an array of heterogeneous jobs): Slurm's queue is the
bound. `rlctl status SWEEP` and `rlctl compare SWEEP --group-by KEY` read the record.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from rlctl.errors import RunError, UsageError
from rlctl.run.dir import RunDir, RunState

SWEEPS = ".sweeps"
MAX_RECORD = 16 << 20
"""A sweep's record larger than this (16 MiB; a 1,000-point grid's is about 200 KiB) is not read."""
MAX_POINTS = 1000
"""A grid larger than this is a typo (a value list pasted twice), not a sweep."""


def split_values(text: str) -> list[str]:
    """'1e-4,3e-4' -> ['1e-4', '3e-4']; '[0,1],[2,3]' -> ['[0,1]', '[2,3]']."""
    values, depth, current = [], 0, ""
    for ch in text:
        depth += ch in "[{"
        depth -= ch in "]}"
        if ch == "," and depth == 0:
            values.append(current)
            current = ""
        else:
            current += ch
    values.append(current)
    return [v.strip() for v in values]


def parse_grid(args: list[str], seeds: int) -> tuple[list[tuple[str, list[str]]], list[str]]:
    """The grid's dimensions in the order given, (dotted key, its values), run.seed last with
    --seeds; and the plain overrides (a key given one value), which every point shares."""
    grid: list[tuple[str, list[str]]] = []
    for arg in args:
        key, eq, raw = arg.partition("=")
        if not eq or not key or not raw:
            raise UsageError(f"sweep: '{arg}' is not KEY=VALUE[,VALUE...]")
        if any(key == k for k, _ in grid):
            raise UsageError(f"sweep: {key} is given twice; list its values once, comma-separated")
        values = split_values(raw)
        if any(not v for v in values):
            raise UsageError(f"sweep: {key} has an empty value in '{raw}'")
        grid.append((key, values))
    if seeds:
        if any(k == "run.seed" for k, _ in grid):
            raise UsageError("sweep: give run.seed values or --seeds, not both")
        grid.append(("run.seed", [str(s) for s in range(seeds)]))
    size = 1
    for _, values in grid:
        size *= len(values)
    if size > MAX_POINTS:
        raise UsageError(f"sweep: the grid has {size} points, more than {MAX_POINTS}")
    fixed = [f"{k}={v[0]}" for k, v in grid if len(v) == 1]
    return [(k, v) for k, v in grid if len(v) > 1], fixed


def points(grid: list[tuple[str, list[str]]]) -> list[dict[str, str]]:
    """Every combination, the first key varying slowest (one empty point for an empty grid)."""
    keys = [k for k, _ in grid]
    return [dict(zip(keys, combo)) for combo in itertools.product(*(v for _, v in grid))]


class UnreadableSweep(RunError):
    """A sweep whose record cannot be read: `rlctl status` lists it as unreadable and goes on; a
    command naming it prints one line and exits 1, as for an unreadable run."""


class Sweep:
    """The sweep's record, OUTPUT_DIR/.sweeps/ID.json, written whole each time (a rename)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.id = path.stem

    @property
    def output_dir(self) -> Path:
        return self.path.parent.parent

    @classmethod
    def create(cls, output_dir: Path, name: str, recipe: Path, grid: list[tuple[str, list[str]]],
               fixed: list[str], launcher: str) -> Sweep:
        import secrets

        (output_dir / SWEEPS).mkdir(parents=True, exist_ok=True)
        for _ in range(64):  # claimed with O_EXCL: two sweeps started in one second never share a record
            sweep_id = f"sweep-{name}-{datetime.now():%Y%m%d-%H%M%S}-{secrets.token_hex(4)}"
            sweep = cls(output_dir / SWEEPS / f"{sweep_id}.json")
            try:
                os.close(os.open(sweep.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
                break
            except FileExistsError:
                continue
        else:
            raise RunError(f"{output_dir / SWEEPS}: no new sweep record after 64 tries; check the directory")
        sweep.write({"id": sweep_id, "recipe": str(recipe), "launcher": launcher, "created": datetime.now().isoformat(),
                     "grid": {k: v for k, v in grid}, "fixed": fixed,
                     "points": [{"values": p, "run": None} for p in points(grid)]})
        return sweep

    def read(self) -> dict[str, Any]:
        """The record, checked to hold what the readers use (record_problem); UnreadableSweep saying
        why when it is missing, not a regular file, over MAX_RECORD bytes, not JSON (nested too
        deep, `null`) or not a sweep's record."""
        from rlctl.run.check import one_line
        from rlctl.run.tail import describe_open_error, read_regular

        try:
            raw = read_regular(self.path, MAX_RECORD)
            if raw is None:
                raise ValueError(f"larger than {MAX_RECORD >> 20} MiB")
            data = json.loads(raw.decode())
        except OSError as e:
            why = describe_open_error(self.path.name, self.path, e)
        except RecursionError:
            why = "nested too deep to be a sweep's record"
        except ValueError as e:  # not UTF-8, not JSON
            why = one_line(str(e), 80)
        else:
            why = record_problem(data)
            if why is None:
                return data
        raise UnreadableSweep(f"sweep {one_line(self.id, 120)}: {self.path} cannot be read ({why})")

    def write(self, data: dict[str, Any]) -> None:
        partial = self.path.with_suffix(f".partial-{os.getpid()}")
        partial.write_text(json.dumps(data, indent=1))
        os.replace(partial, self.path)

    def set_run(self, index: int, run_id: str) -> None:
        data = self.read()
        data["points"][index]["run"] = run_id
        self.write(data)

    def runs(self) -> list[RunDir]:
        return [RunDir(self.output_dir / p["run"]) for p in self.read()["points"] if p["run"]]


def record_problem(data: Any) -> str | None:
    """What a sweep's record lacks of what its readers use, or None: an object with its id and
    recipe (strings), the grid and fixed overrides, and points, each with its values and its run
    (a run id, or null before it starts)."""
    if not isinstance(data, dict):
        return "it is not a JSON object"
    for key, kind in (("id", str), ("recipe", str), ("grid", dict), ("fixed", list), ("points", list)):
        if not isinstance(data.get(key), kind):
            return f"no {key} ({kind.__name__})"
    for i, p in enumerate(data["points"]):
        run = p.get("run") if isinstance(p, dict) else None
        if not isinstance(p, dict) or not isinstance(p.get("values"), dict):
            return f"point {i} has no values"
        if run is not None and (not isinstance(run, str) or not run.strip(".") or "/" in run or "\0" in run):
            return f"point {i}'s run is not a run id"
    return None


def overrides_of(data: dict[str, Any], index: int) -> list[str]:
    """The overrides of point `index`: the sweep's fixed ones, then the point's values."""
    return [*data["fixed"], *(f"{k}={v}" for k, v in data["points"][index]["values"].items())]


def find_sweep(ref: str, output_dir: Path) -> Sweep | None:
    """A sweep by id or unique id prefix in output_dir; None when `ref` names none."""
    folder = output_dir / SWEEPS
    if not ref.startswith("sweep-") or "/" in ref or not folder.is_dir():
        return None
    exact = folder / f"{ref}.json"
    if exact.is_file():
        return Sweep(exact)
    found = sorted(p for p in folder.glob("*.json") if p.stem.startswith(ref))
    if len(found) > 1:
        raise UsageError(f"'{ref}' matches {len(found)} sweeps in {folder}; give more of the id")
    return Sweep(found[0]) if found else None


def list_sweeps(output_dir: Path) -> list[Sweep]:
    """Every sweep recorded in output_dir, by id."""
    try:
        with os.scandir(output_dir / SWEEPS) as entries:
            names = sorted(e.name for e in entries if e.name.startswith("sweep-") and e.name.endswith(".json"))
    except OSError:  # no sweep yet
        return []
    return [Sweep(output_dir / SWEEPS / n) for n in names]


def finished(rd: RunDir) -> bool:
    try:
        return RunState(rd.read()["state"]).finished
    except Exception:  # noqa: BLE001 - an unreadable run has ended as far as the sweep goes
        return True


def drive_local(sweep: Sweep, start: Any, parallel: int, say: Any, poll_s: float = 1.0) -> None:
    """Start each point's run (start(overrides) -> RunDir), at most `parallel` alive at once,
    and return when every run has ended."""
    data = sweep.read()
    running: list[RunDir] = []
    for i, _ in enumerate(data["points"]):
        while len(running) >= parallel:
            time.sleep(poll_s)
            running = [rd for rd in running if not finished(rd)]
        rd = start(overrides_of(data, i))
        sweep.set_run(i, rd.id)
        say(f"point {i + 1}/{len(data['points'])}: {rd.id}  " + " ".join(overrides_of(data, i)[len(data["fixed"]):]))
        running.append(rd)
    while running:
        time.sleep(poll_s)
        running = [rd for rd in running if not finished(rd)]
