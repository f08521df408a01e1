"""Finding a run's directory in an output directory, by its path, id, id prefix or name, and
listing every run there, readable or not (a damaged run is still listed: status says why)."""

from __future__ import annotations

import os
from pathlib import Path

from rlctl.errors import UsageError
from rlctl.run.check import one_line
from rlctl.run.dir import RunDir
from rlctl.run.ids import RUN_ID


def is_run_entry(path: Path) -> bool:
    """A run directory, readable or not: an entry with a run.json (of any kind: a file, a
    directory, a dangling symlink), or an entry named like a run id (a run.json gone missing, a
    file where the directory should be). Hidden entries are not runs."""
    if path.name.startswith("."):
        return False
    return os.path.lexists(path / "run.json") or (RUN_ID.fullmatch(path.name) is not None and os.path.lexists(path))


def find_run(ref: str, output_dir: Path) -> RunDir:
    """A run by directory path, full id, or unique id prefix / name (newest wins for a name).
    The run found may still be unreadable: RunDir.read() says why."""
    as_path = Path(ref)
    if os.path.lexists(as_path / "run.json"):
        return RunDir(as_path)
    if ref and is_run_entry(output_dir / ref):
        return RunDir(output_dir / ref)
    if as_path.is_absolute():  # a path, and not a run's: no id or name begins with /
        raise UsageError(f"{one_line(ref)} is not a run directory (no run.json in it); give a run's directory, "
                         "id or name (`rlctl status` lists the runs)")
    try:
        candidates = sorted((p for p in output_dir.glob(f"{ref}*") if is_run_entry(p)), key=lambda p: p.name)
    except (OSError, ValueError, NotImplementedError):  # a pattern glob cannot take
        candidates = []
    if not candidates:
        raise UsageError(f"no run '{one_line(ref)}' in {output_dir}; `rlctl status` lists the runs")
    named = [p for p in candidates if p.name.rsplit("-", 3)[0] == ref]
    if named:
        return RunDir(named[-1])
    if len(candidates) > 1:
        raise UsageError(f"'{one_line(ref)}' matches {len(candidates)} runs in {output_dir}; give more of the id")
    return RunDir(candidates[0])


def list_runs(output_dir: Path) -> list[RunDir]:
    """Every run directory in output_dir (is_run_entry, one stat fewer for a run id), readable or not, by id."""
    try:
        with os.scandir(output_dir) as entries:
            names = sorted(e.name for e in entries if not e.name.startswith("."))
    except OSError:  # missing, or not a directory
        return []
    return [RunDir(output_dir / n) for n in names
            if RUN_ID.fullmatch(n) is not None or os.path.lexists(os.path.join(output_dir, n, "run.json"))]
