"""Slurm's command-line client: submit a job, ask for its state, cancel it.

State is read by column name, never by position: `squeue -O` and `sacct --parsable2` print a
header line, each row is read under the header's titles, and the one free-text column (the
reason) comes last and takes the rest of its line, so a `|` inside it cannot shift the others.
The job name, also free text (it is the run id), is not asked for. `squeue --json` is not used:
on Slurm 22.05 it ignores -j and prints every job of the cluster (about 2 KB each), it has no
elapsed time, and its schema changes with Slurm's releases.

One batched squeue for all runs; `scontrol show job -o` for the exit code of a finished job while
Slurm still remembers it; `sacct` for jobs it has forgotten, where accounting is configured. The
user's SQUEUE_* and SACCT_* settings are ignored: a format or sort would change what is printed,
and a filter such as SQUEUE_PARTITION would hide the job.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

from rlctl.errors import RunError
from rlctl.launchers.slurm.job import JobInfo

# squeue -O items are FIELD:WIDTH[SUFFIX]: width 0 prints the whole value, the suffix separates.
# Each field with the title squeue prints over its column; the free-text one last.
_SQUEUE_COLUMNS = (("JobID", "JOBID"), ("HetJobID", "HET_JOB_ID"), ("HetJobOffset", "HET_JOB_OFFSET"),
                   ("State", "STATE"), ("TimeUsed", "TIME"), ("NodeList", "NODELIST"), ("Reason", "REASON"))
SQUEUE_FIELDS = "|,".join(f"{field}:0" for field, _ in _SQUEUE_COLUMNS)  # JobID:0|,HetJobID:0|,...,Reason:0
SACCT_FIELDS = "JobID,State,Elapsed,NodeList,ExitCode,Reason"
_VAGUE_REASONS = ("", "None", "Resources", "Priority")
# Settings of the user's shell that would change what Slurm's commands print or which jobs they list.
_IGNORED_ENV = ("SQUEUE_", "SACCT_", "SLURM_TIME_FORMAT")


def _run(cmd: list[str], timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_IGNORED_ENV)}
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise RunError(f"{cmd[0]} not found: Slurm's commands are not on PATH here; install slurm-client or "
                       f"load the Slurm module (launcher=slurm)") from None
    except subprocess.TimeoutExpired:
        raise RunError(f"{cmd[0]} did not answer in {timeout:.0f} s: is slurmctld up? (scontrol ping)") from None


def _failed(cmd: list[str], res: subprocess.CompletedProcess[str]) -> RunError:
    lines = [ln.strip() for ln in (res.stderr or res.stdout).splitlines() if ln.strip()]
    said = lines[-1] if lines else f"exit code {res.returncode}"
    return RunError(f"{cmd[0]} failed: {said}")


def submit(script: Path) -> str:
    """sbatch the script; the job id."""
    cmd = ["sbatch", "--parsable", str(script)]
    res = _run(cmd)
    if res.returncode != 0:
        raise _failed(cmd, res)
    return res.stdout.strip().split(";")[0]


def query(job_ids: list[str]) -> dict[str, JobInfo]:
    """The state of several jobs with one squeue call. Jobs Slurm no longer remembers (past
    MinJobAge) are looked up in accounting where it exists, else left out."""
    if not job_ids:
        return {}
    cmd = ["squeue", "-t", "all", "-O", SQUEUE_FIELDS, "-j", ",".join(job_ids)]
    res = _run(cmd)
    if res.returncode != 0 and "Invalid job id" not in res.stderr:
        raise _failed(cmd, res)
    jobs = parse_squeue(res.stdout) if res.returncode == 0 else {}  # else: Slurm forgot all of them
    for jid, job in jobs.items():
        if not job.active:
            job.exit_code = parse_exit_code(_run(["scontrol", "show", "job", "-o", jid]).stdout)
    missing = [j for j in job_ids if j not in jobs]
    if missing:
        jobs.update(_sacct(missing))
    return jobs


def _sacct(job_ids: list[str]) -> dict[str, JobInfo]:
    """Finished jobs from accounting; nothing where accounting is off (then run.json tells)."""
    res = _run(["sacct", "--parsable2", "-X", f"--format={SACCT_FIELDS}", "-j", ",".join(job_ids)])
    return parse_sacct(res.stdout) if res.returncode == 0 else {}


def cancel(job_id: str, wait_s: float = 60.0) -> JobInfo | None:
    """scancel the job and wait until Slurm reports it ended; its last state."""
    cmd = ["scancel", job_id]
    res = _run(cmd)
    if res.returncode != 0 and "already completing or completed" not in res.stderr and "Invalid job id" not in res.stderr:
        raise _failed(cmd, res)
    deadline = time.monotonic() + wait_s
    while True:
        job = query([job_id]).get(job_id)
        if job is None or not job.active:
            return job
        if time.monotonic() > deadline:
            raise RunError(f"job {job_id} still {job.state} {wait_s:.0f} s after scancel; see scontrol show job {job_id}")
        time.sleep(0.2)


# ---------------------------------------------------------------------------------------------
# Reading what they print


def _table(text: str, tool: str, titles: tuple[str, ...]) -> list[dict[str, str]]:
    """The rows of `|`-separated output under its header line, keyed by upper-case title. The
    last column takes the rest of its line, `|` included."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        return []
    header = [title.strip().upper() for title in lines[0].split("|")]
    missing = [t for t in titles if t not in header]
    if missing:
        raise RunError(f"{tool} printed no {', '.join(missing)} column (its header: {lines[0].strip()}); "
                       f"rlctl reads the {tool} of Slurm 22.05 or later: check `{tool} --version`")
    rows = []
    for line in lines[1:]:
        values = line.split("|", len(header) - 1)
        if len(values) == len(header):
            rows.append(dict(zip(header, (v.strip() for v in values))))
    return rows


def parse_squeue(text: str) -> dict[str, JobInfo]:
    """Jobs by id from `squeue -O SQUEUE_FIELDS`. The components of a heterogeneous job (a row
    each, with their own job ids) become one JobInfo under the het job's id: the state and elapsed
    time of component 0, the node list and state of each component in order."""
    rows = _table(text, "squeue", tuple(title for _, title in _SQUEUE_COLUMNS))
    rows.sort(key=lambda row: int(row["HET_JOB_OFFSET"]) if row["HET_JOB_OFFSET"].isdigit() else 0)
    jobs: dict[str, JobInfo] = {}
    for row in rows:
        het_id, reason = row["HET_JOB_ID"], row["REASON"]
        base = het_id if het_id.isdigit() and het_id != "0" else row["JOBID"]  # N/A: not a het job
        job = jobs.setdefault(base, JobInfo(base, row["STATE"], reason, row["TIME"], []))
        if job.reason in _VAGUE_REASONS and reason not in _VAGUE_REASONS:
            job.reason = reason  # a het job's real obstacle may be one component's: say that one
        job.nodes.append(row["NODELIST"])
        job.states.append(row["STATE"])
    return jobs


def parse_sacct(text: str) -> dict[str, JobInfo]:
    """Jobs by id from `sacct --parsable2 -X --format=SACCT_FIELDS` (with its header); a het
    job's components are rows JOBID+OFFSET."""
    jobs: dict[str, JobInfo] = {}
    for row in _table(text, "sacct", tuple(SACCT_FIELDS.upper().split(","))):
        base, _, offset = row["JOBID"].partition("+")
        state = row["STATE"].split(" ", 1)[0]  # "CANCELLED by 0"
        job = jobs.setdefault(base, JobInfo(base, state, row["REASON"], row["ELAPSED"], [], row["EXITCODE"]))
        if offset in ("", "0"):
            job.state, job.exit_code = state, row["EXITCODE"]
        job.nodes.append(row["NODELIST"])
        job.states.append(state)
    return jobs


def parse_exit_code(text: str) -> str:
    """The exit code (CODE:SIGNAL) of component 0 in `scontrol show job -o` output, "" if none.
    Its items are KEY=VALUE, but the job name before JobState= is free text that may hold spaces
    and `=`: the exit code is read after the last JobState=."""
    first = text.splitlines()[0] if text.strip() else ""
    after_name = first.rpartition(" JobState=")[2]
    m = re.search(r"(?:^| )ExitCode=(\d+:\d+)(?= |$)", after_name)
    return m[1] if m else ""
