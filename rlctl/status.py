"""What `rlctl status` shows, read from the run directories; rlctl/commands/status.py renders it
and `--json` prints it as it is.

A run's state is what run.json says, unless run.json says it is still going while its
supervisor is gone: then it is failed, with the supervisor's log to read. Slurm runs are joined
with Slurm's own state first (one batched squeue for all of them, rlctl/launchers/slurm/), and
the job's state goes beside the run's.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

from rlctl.rundir import RunDir, RunState, find_run, list_runs, pid_alive
from rlctl.tail import last_jsonl_record, last_jsonl_records

STARTING_GRACE_S = 30.0
"""A local run with no supervisor pid yet is still starting for this long, then failed."""


def effective_state(rd: RunDir, info: dict[str, Any]) -> tuple[RunState, str | None]:
    """The run's state and why it ended, with a vanished supervisor counted as a failure."""
    state = RunState(info["state"])
    if state.finished or info.get("launcher") == "slurm":
        return state, info.get("exit_reason")  # a Slurm run was joined with Slurm's state before
    supervisor = info.get("processes", {}).get("supervisor", {}).get("pid")
    if supervisor is None:
        created = dt.datetime.fromisoformat(info["created"])
        age = (dt.datetime.now(dt.UTC) - created).total_seconds()
        if age < STARTING_GRACE_S:
            return state, None
        return RunState.FAILED, f"no supervisor ever started; see {rd.log_path('supervisor')}"
    if not pid_alive(supervisor, expect_in_cmdline=rd.id):
        return RunState.FAILED, f"supervisor (pid {supervisor}) is gone; see {rd.log_path('supervisor')}"
    return state, None


def _elapsed(info: dict[str, Any]) -> float:
    start = dt.datetime.fromisoformat(info["created"])
    end = dt.datetime.fromisoformat(info["ended"]) if info.get("ended") else dt.datetime.now(dt.UTC)
    return (end - start).total_seconds()


def summary(rd: RunDir, info: dict[str, Any] | None = None) -> dict[str, Any]:
    """One row of `rlctl status`. `info`: run.json, when the caller has read it already."""
    info = info if info is not None else rd.read()
    state, reason = effective_state(rd, info)
    last = last_jsonl_record(rd.metrics_path)
    return {
        "id": info["id"],
        "name": info["name"],
        "mode": info.get("mode"),
        "launcher": info.get("launcher"),
        "state": state.value,
        "step": (last["step"] + 1) if last else 0,
        "steps_total": info.get("steps_total"),
        "reward": last["reward_mean"] if last else None,
        "elapsed_s": _elapsed(info),
        "created": info["created"],
        "exit_reason": reason,
        "path": str(rd.path),
        "slurm": _slurm_summary(info),
    }


def _slurm_summary(info: dict[str, Any]) -> dict[str, Any] | None:
    sl = info.get("slurm")
    if not sl or not sl.get("job_id"):
        return None
    from rlctl.launchers.slurm import JobInfo

    last = sl.get("last")
    return {"job_id": sl["job_id"], **(last or {}),
            "describe": JobInfo(**last).describe() if last else "submitted, not yet seen by squeue"}


def detail(rd: RunDir) -> dict[str, Any]:
    """`rlctl status RUN`: the summary, every process, the last events and metrics, the logs."""
    info = rd.read()
    out = summary(rd)
    procs = []
    for role, p in info.get("processes", {}).items():
        procs.append({"role": role, "pid": p.get("pid"), "host": p.get("host"), "port": p.get("port"),
                      # a Slurm run's processes live on other nodes: no pid to check from here
                      "alive": None if info.get("launcher") == "slurm" else
                      pid_alive(p.get("pid"), expect_in_cmdline=rd.id) if p.get("pid") else False,
                      "log": p.get("log", str(rd.log_path(role)))})
    out["processes"] = procs
    out["last_events"] = last_jsonl_records(rd.events_path, 10)  # not the whole log: it can be GBs
    out["last_metrics"] = last_jsonl_record(rd.metrics_path)
    out["wandb"] = (info.get("tracking") or {}).get("wandb")
    out["logs"] = [str(p) for p in rd.log_files().values()]
    return out


def _refresh_slurm(runs: list[RunDir], infos: dict[str, dict[str, Any]] | None = None) -> None:
    from rlctl.launchers.slurm import refresh

    refresh(runs, infos)  # asks Slurm only if some run is a Slurm run that needs it


def run_detail(ref: str, runs_dir: Path) -> dict[str, Any]:
    """One run (an id, name or directory) in detail, joined with Slurm's state first."""
    rd = find_run(ref, runs_dir)
    _refresh_slurm([rd])
    return detail(rd)


def summaries(runs_dir: Path) -> list[dict[str, Any]]:
    """Every run in runs_dir, one row each, joined with Slurm's state first (one query for all)."""
    runs = list_runs(runs_dir)
    infos = {rd.id: rd.read() for rd in runs}
    _refresh_slurm(runs, infos)
    # A run Slurm was asked about may have just been updated: read those again, no others.
    stale = {rd.id for rd in runs if infos[rd.id].get("launcher") == "slurm"}
    return [summary(rd, None if rd.id in stale else infos[rd.id]) for rd in runs]
