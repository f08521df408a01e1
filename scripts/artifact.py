"""Where a benchmark's figures go: one JSON file under results/, which the docs cite.

Every script under scripts/ that measures something calls `write_artifact(name, figures)` once at
the end. The file records what produced the figures, so a number in the docs can be traced to a
commit, a date, a machine and a command, and goes visibly stale when the code moves on:

    {"name": ..., "commit": "ff24ea2...", "dirty": false, "date": "2026-12-04T15:20:00+00:00",
     "machine": {"cpu": ..., "cores": 2, "memory_gib": 23.4, "gpu": null, "python": ..., "torch": ...},
     "command": "python scripts/bench_cli.py --runs 2000", "figures": {...}}

`results/NAME.json` holds the latest run of NAME; a script measured on two kinds of machine
names them apart (e.g. `bench_weightsync-ipc-cuda`). The folder is results/ unless the
RLCTL_RESULTS environment variable names another (a GPU machine that returns only one folder,
or a trial run that must not replace the cited figures). A float that is not finite (NaN, inf)
is written as null: the files are plain JSON. Nothing here imports rlctl or torch up front: a
benchmark of the CLI's start must not pay for them.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "results"
RESULTS_ENV = "RLCTL_RESULTS"


def slug(text: str) -> str:
    """A piece of an artifact's name: lower case, letters, digits and dashes."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def repo_path(path: str | Path) -> str:
    """A path as the figures record it: relative to the repository when inside it."""
    resolved = Path(path).resolve()
    return str(resolved.relative_to(REPO)) if resolved.is_relative_to(REPO) else str(path)


def results_folder() -> Path:
    """results/, or the folder RLCTL_RESULTS names."""
    return Path(os.environ[RESULTS_ENV]) if os.environ.get(RESULTS_ENV) else RESULTS


def _plain(value: Any) -> Any:
    """JSON data with every non-finite float as None (json.dumps would write NaN, which is not JSON)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def git_state() -> dict[str, Any]:
    """The checkout's commit, and whether tracked files differ from it (`dirty`)."""
    return {"commit": _git("rev-parse", "HEAD"), "dirty": bool(_git("status", "--porcelain", "--untracked-files=no"))}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / (1 << 20), 1)
    except OSError:
        pass
    return None


def machine() -> dict[str, Any]:
    """What the figures were measured on. torch is described only if the benchmark imported it."""
    torch = sys.modules.get("torch")
    system = os.uname()  # not platform.platform(): on Linux it runs `uname -p` in a subprocess
    gpu = None
    if torch is not None and torch.cuda.is_available():
        gpu = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    return {
        "cpu": _cpu_model(),
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_gib": _memory_gib(),
        "gpu": gpu,
        "python": platform.python_version(),
        "torch": getattr(torch, "__version__", None),
        "platform": f"{system.sysname} {system.release} {system.machine}",
        # What else was running: the 1, 5 and 15 minute load averages as the figures are written.
        "load_average": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
    }


def write_artifact(name: str, figures: dict[str, Any], argv: list[str] | None = None,
                   results: Path | None = None, git: dict[str, Any] | None = None) -> Path:
    """Write NAME.json into `results` (default: results_folder()) atomically and return its path;
    `figures` must be JSON data (anything else is written as its str()). `argv` is the command
    (default sys.argv), `git` the commit and dirty flag (default git_state())."""
    argv = sys.argv if argv is None else argv
    script = Path(argv[0])
    try:
        script = script.resolve().relative_to(REPO)
    except ValueError:
        pass
    record = {
        "name": name,
        **(git or git_state()),
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "command": shlex.join(["python", str(script), *argv[1:]]),
        "figures": _plain(figures),
    }
    folder = results or results_folder()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    tmp = folder / f".{name}.json.{os.getpid()}.tmp"  # written whole, then renamed over the old file
    tmp.write_text(json.dumps(record, indent=1, default=str, allow_nan=False) + "\n")
    tmp.replace(path)
    print(f"figures written to {path.relative_to(REPO) if path.is_relative_to(REPO) else path}", file=sys.stderr)
    return path
