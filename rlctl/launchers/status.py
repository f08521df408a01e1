"""What `rlctl status` shows, read from the run directories; rlctl/commands/status.py renders it
and `--json` prints it as it is.

A run's state is the one reading rlctl/launchers/liveness.py gives (what run.json says, unless
run.json says it is still going while its supervisor is gone: then it is failed, with the
supervisor's log to read). Slurm runs are joined with Slurm's own state first (one batched
squeue for all of them, rlctl/launchers/slurm/), and the job's state goes beside the run's.

One damaged run directory never stops the listing: a run whose run.json cannot be read is a row
with state `unreadable` and `unreadable: why`; lines of events.jsonl or metrics.jsonl that are
not JSON objects are skipped, and `problems` says so (`rlctl status RUN`).
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

from rlctl.launchers.liveness import is_run_process, read_run
from rlctl.run.dir import RunDir, UnreadableRun
from rlctl.run.find import find_run, list_runs
from rlctl.run.check import one_line
from rlctl.run.tail import jsonl_tail

ROW_TAIL_BYTES = 8192
"""How much of the end of metrics.jsonl a row reads for its last record at first (a record is
about 1 KiB); jsonl_tail widens the window when no whole record fits in it."""


def _elapsed(info: dict[str, Any]) -> float:
    start = dt.datetime.fromisoformat(info["created"])
    end = dt.datetime.fromisoformat(info["ended"]) if info.get("ended") else dt.datetime.now(dt.UTC)
    return (end - start).total_seconds()


def _number(value: Any) -> float | None:
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def summary(rd: RunDir, info: dict[str, Any] | None = None) -> dict[str, Any]:
    """One row of `rlctl status`. `info`: run.json, when the caller has read it already."""
    now = read_run(rd, info)
    info, state, reason = now.info, now.state, now.reason
    records, problems = jsonl_tail(rd.metrics_path, 1, ROW_TAIL_BYTES)
    last = records[-1] if records else {}
    step = last.get("step")
    row = {
        "id": info["id"],
        "name": info["name"],
        "mode": info.get("mode"),
        "launcher": info.get("launcher"),
        "colocated": info.get("colocated") is True,
        "state": state.value,
        "step": step + 1 if isinstance(step, int) and not isinstance(step, bool) else 0,
        "steps_total": info.get("steps_total"),
        "reward": _number(last.get("reward_mean")),
        "elapsed_s": _elapsed(info),
        "created": info["created"],
        "exit_reason": reason,
        "path": str(rd.path),
        "slurm": _slurm_summary(info),
    }
    return {**row, "problems": problems} if problems else row


def unreadable_row(rd: RunDir, why: str) -> dict[str, Any]:
    """The row of a run that cannot be read: the keys of a summary, empty, and why."""
    return {"id": one_line(rd.id, 120), "name": None, "mode": None, "launcher": None, "colocated": None,
            "state": "unreadable",
            "step": None, "steps_total": None, "reward": None, "elapsed_s": None, "created": None,
            "exit_reason": None, "path": str(rd.path), "slurm": None, "unreadable": why}


def safe_summary(rd: RunDir, info: dict[str, Any] | None = None) -> dict[str, Any]:
    """summary(), or the unreadable row when the run cannot be read. The checks of run.json
    (rlctl/run/check.py) cover what summary reads; a value they let through and a reader still
    trips on marks the run too, so that one run never stops the listing of the others."""
    try:
        return summary(rd, info)
    except UnreadableRun as e:
        return unreadable_row(rd, e.why)
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
        return unreadable_row(rd, f"run.json: {e.__class__.__name__}: {one_line(str(e), 80)}")


def _slurm_summary(info: dict[str, Any]) -> dict[str, Any] | None:
    sl = info.get("slurm")
    if not sl or not sl.get("job_id"):
        return None
    from rlctl.launchers.slurm import JobInfo

    last = sl.get("last")
    try:
        describe = JobInfo(**last).describe() if last else "submitted, not yet seen by squeue"
    except TypeError as e:  # slurm.last with keys a JobInfo does not have
        describe = f"slurm.last unreadable ({one_line(str(e), 80)})"
    return {"job_id": sl["job_id"], **(last or {}), "describe": describe}


def detail(rd: RunDir) -> dict[str, Any]:
    """`rlctl status RUN`: the summary, every process, the last events and metrics, the logs, and
    `problems`: what is damaged in the run directory besides run.json (lines skipped, a file
    that is not a file). Raises UnreadableRun when run.json cannot be read."""
    info = rd.read()
    from rlctl.run.checkpoint import list_checkpoints
    from rlctl.run.evals import eval_summary

    out = summary(rd, info)
    problems = out.pop("problems", [])
    procs = []
    for role, p in (info.get("processes") or {}).items():
        procs.append({"role": role, "pid": p.get("pid"), "host": p.get("host"), "port": p.get("port"),
                      # a Slurm run's processes live on other nodes: no pid to check from here
                      "alive": None if info.get("launcher") == "slurm" else
                      is_run_process(rd, p.get("pid")),
                      "log": p.get("log", str(rd.log_path(role)))})
    out["processes"] = procs
    out["last_events"], events_problems = jsonl_tail(rd.events_path, 10)  # not the whole log: it can be GBs
    out["last_metrics"] = (jsonl_tail(rd.metrics_path, 1)[0] or [None])[-1]
    out["evals"] = eval_summary(rd)  # per held-out set: the first and latest evaluation
    out["wandb"] = (info.get("tracking") or {}).get("wandb")
    pool = info.get("pool")  # launcher=pool: the pool's name and this run's usage of its devices
    out["pool"] = {"name": pool.get("name"), "usage": pool.get("usage") or {}} if isinstance(pool, dict) else None
    out["logs"] = [str(p) for p in rd.log_files().values()]
    out["checkpoints"] = [c.describe() for c in list_checkpoints(rd.path)]  # rlctl/run/checkpoint.py
    out["attempts"] = attempts(info)
    out["problems"] = problems + events_problems + _recipe_problems(rd)
    return out


def attempts(info: dict[str, Any]) -> list[dict[str, Any]]:
    """Every attempt of the run, the current one last: where it started (a checkpoint's step),
    when, how it ended and why (requeued, failed, cancelled), and its Slurm job."""
    from rlctl.run.checkpoint import attempt_ending

    records = [dict(a) for a in (info.get("attempts") or []) if isinstance(a, dict)]
    if not records:
        records = [{"attempt": 1, "resumed_from": None, "started": info.get("created")}]
    if isinstance(info.get("attempt_end"), dict):  # a Slurm job requeued or submitted again, whose next
        records[-1].update(attempt_ending(info))    # attempt has not begun
        records.append({"attempt": len(records) + 1, "resumed_from": None, "started": None})
    out = []
    for i, a in enumerate(records):
        current = i == len(records) - 1
        row = {k: a.get(k) for k in ("attempt", "resumed_from", "started", "ended", "state", "exit_reason")}
        if current:  # the current attempt's end is the run's own
            row.update(ended=info.get("ended"), state=info.get("state"), exit_reason=info.get("exit_reason"))
        slurm = a.get("slurm") or ((info.get("slurm") or {}) if current else {})
        row["slurm_job"] = slurm.get("job_id")
        row["slurm_restart"] = slurm.get("restart_count")
        out.append(row)
    return out


def _recipe_problems(rd: RunDir) -> list[str]:
    """recipe.yaml missing or not a file (its content is read by `rlctl compare`, not here)."""
    from rlctl.run.tail import describe_open_error, open_regular

    try:
        with open_regular(rd.recipe_path):
            return []
    except OSError as e:
        return [describe_open_error("recipe.yaml", rd.recipe_path, e)]


def sweep_summaries(runs_dir: Path, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every sweep in runs_dir (rlctl/run/sweep.py): its id, recipe, grid keys, how many runs it has,
    and how many are in each state, from `rows` (the runs' summaries: no run is read again). A
    point not started yet counts as `not started`, a run gone from runs_dir as `missing`; a sweep
    record that cannot be read is a row with `unreadable: why`."""
    from rlctl.run.sweep import UnreadableSweep, list_sweeps

    state_of = {r["id"]: r["state"] for r in rows}
    out = []
    for sw in list_sweeps(runs_dir):
        try:
            data = sw.read()
            runs = [p["run"] for p in data["points"]]
            states = [state_of.get(r, "missing") if r else "not started" for r in runs]
            out.append({"id": sw.id, "recipe": data["recipe"], "grid": list(data["grid"]), "points": len(runs),
                        "states": {s: states.count(s) for s in sorted(set(states))}})
        except UnreadableSweep as e:
            out.append({"id": sw.id, "unreadable": one_line(str(e), 200)})
        except (KeyError, TypeError, AttributeError) as e:
            out.append({"id": sw.id, "unreadable": f"{e.__class__.__name__}: {one_line(str(e), 80)}"})
    return out


def _refresh_slurm(runs: list[RunDir], infos: dict[str, dict[str, Any]] | None = None) -> None:
    from rlctl.launchers.slurm import refresh

    refresh(runs, infos)  # asks Slurm only if some run is a Slurm run that needs it


def run_detail(ref: str, runs_dir: Path) -> dict[str, Any]:
    """One run (an id, name or directory) in detail, joined with Slurm's state first (a run of
    another launcher does not load the Slurm launcher, nor the recipe schema it renders from)."""
    rd = find_run(ref, runs_dir)
    try:
        on_slurm = rd.read().get("launcher") == "slurm"
    except UnreadableRun:
        on_slurm = False  # detail() says why
    if on_slurm:
        _refresh_slurm([rd])
    return detail(rd)


def summaries(runs_dir: Path) -> list[dict[str, Any]]:
    """Every run in runs_dir, one row each, joined with Slurm's state first (one query for all)."""
    runs = list_runs(runs_dir)
    infos: dict[str, dict[str, Any]] = {}
    unreadable: dict[str, str] = {}
    for rd in runs:
        try:
            infos[rd.id] = rd.read()
        except UnreadableRun as e:
            unreadable[rd.id] = e.why
    # A run Slurm was asked about may have just been updated: read those again, no others.
    stale = {rid for rid, info in infos.items() if info.get("launcher") == "slurm"}
    if stale:
        _refresh_slurm([rd for rd in runs if rd.id in stale], infos)
    return [unreadable_row(rd, unreadable[rd.id]) if rd.id in unreadable else
            safe_summary(rd, None if rd.id in stale else infos[rd.id]) for rd in runs]
