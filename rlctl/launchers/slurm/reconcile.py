"""A Slurm run's state joined with its job's: what Slurm said goes into run.json (Slurm forgets
finished jobs after MinJobAge), and a run whose job ended without the run recording it (killed,
time limit, node failure) is ended in run.json too."""

from __future__ import annotations

from typing import Any

from rlctl.launchers.slurm.client import query
from rlctl.launchers.slurm.job import ACTIVE, JobInfo
from rlctl.run.dir import RunDir, RunState
from rlctl.run.tail import last_log_line


def job_id_of(info: dict[str, Any]) -> str | None:
    return (info.get("slurm") or {}).get("job_id")


def needs_query(info: dict[str, Any]) -> bool:
    """Ask Slurm about this run? While the run is going, or while its last seen job state was
    still active (so that the final state and exit code get recorded)."""
    if info.get("launcher") != "slurm" or not job_id_of(info):
        return False
    last = (info.get("slurm") or {}).get("last")
    return not RunState(info["state"]).finished or last is None or last.get("state") in ACTIVE


def reconcile(rd: RunDir, info: dict[str, Any], job: JobInfo | None, queried: bool) -> dict[str, Any]:
    """Record what Slurm said about the run's job; end the run if its job ended first. Returns
    the updated run.json."""
    jid = job_id_of(info)
    if not queried or jid is None:
        return info
    if job is not None:
        info = rd.update(lambda d: d["slurm"].update(last=job.to_json()))
    last = (info.get("slurm") or {}).get("last")
    if RunState(info["state"]).finished:
        if job is None and last is not None and last.get("state") in ACTIVE:
            # The run ended and Slurm has forgotten the job since we last looked: stop asking.
            ended = {**last, "state": "ENDED", "reason": "no longer listed by Slurm"}
            info = rd.update(lambda d: d["slurm"].update(last=ended))
        return info
    if job is None:
        if last is None:
            return info  # just submitted: squeue may not list it for a moment
        job = JobInfo(**{**last, "state": "UNKNOWN"})
        reason = f"Slurm job {jid} is no longer known to Slurm and the run never recorded its end"
    elif job.active:
        return info
    else:
        reason = f"Slurm job {jid} ended {job.describe()} before the run recorded its end"
        said = last_log_line(rd.logs / f"slurm-{jid}.out")  # e.g. the nodes' python cannot import rlctl
        reason += f"; the job's output said: {said}" if said else ""
    state = RunState.CANCELLED if job.state == "CANCELLED" else RunState.FAILED
    rd.set_state(state, reason)
    rd.event("run_end", state=state.value, reason=reason)
    return rd.read()


def refresh(runs: list[RunDir], infos: dict[str, dict[str, Any]] | None = None) -> dict[str, JobInfo | None]:
    """Query Slurm once for every run that needs it; update their run.json. Returns the job info
    by run id (None: Slurm does not know the job) for the runs that were asked about. `infos`:
    run.json by run id, when the caller has read them already."""
    infos = infos if infos is not None else {rd.id: rd.read() for rd in runs}
    wanted = {rid: job_id_of(info) for rid, info in infos.items() if needs_query(info)}
    if not wanted:
        return {}
    jobs = query(sorted(set(wanted.values())))
    out: dict[str, JobInfo | None] = {}
    for rd in runs:
        if rd.id in wanted:
            job = jobs.get(wanted[rd.id])
            reconcile(rd, infos[rd.id], job, queried=True)
            out[rd.id] = job
    return out
