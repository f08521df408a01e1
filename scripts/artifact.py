"""Where a benchmark's figures go: one JSON file under results/, which the docs cite.

Every script under scripts/ that measures something calls `write_artifact(name, figures)` once at
the end. The file records what produced the figures, so a number in the docs can be traced to a
commit, a date, a machine and a command, and goes visibly stale when the code moves on:

    {"name": ..., "commit": "ff24ea2...", "dirty": false, "date": "2026-12-04T15:20:00+00:00",
     "machine": {"cpu": ..., "cores": 2, "memory_gib": 23.4, "gpu": null, "python": ..., "torch": ...},
     "command": "python scripts/bench_cli.py --runs 2000", "figures": {...}}

`results/NAME.json` holds the latest run of NAME; a script measured on two kinds of machine
names them apart (e.g. `bench_weightsync-h200`). Nothing here imports rlctl or torch up front: a benchmark of the CLI's start
must not pay for them.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "results"


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


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
        "platform": platform.platform(),
    }


def write_artifact(name: str, figures: dict[str, Any], argv: list[str] | None = None,
                   results: Path | None = None) -> Path:
    """Write results/NAME.json (atomically) and return its path; `figures` must be JSON data."""
    argv = sys.argv if argv is None else argv
    script = Path(argv[0])
    try:
        script = script.resolve().relative_to(REPO)
    except ValueError:
        pass
    record = {
        "name": name,
        "commit": _git("rev-parse", "HEAD"),
        "dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "command": shlex.join(["python", str(script), *argv[1:]]),
        "figures": figures,
    }
    folder = results or RESULTS
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=1, default=str) + "\n")
    tmp.replace(path)
    print(f"figures written to {path.relative_to(REPO) if path.is_relative_to(REPO) else path}", file=sys.stderr)
    return path
