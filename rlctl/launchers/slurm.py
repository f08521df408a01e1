"""The Slurm launcher: a run is one heterogeneous Slurm job.

Component 0 holds the trainer ranks (and the controller, on its first node); component 1 holds the
rollout servers. `render_batch_script` turns a recipe into the batch script (a pure function,
golden-tested); the script resolves its node names, writes the plan into run.json
(`python -m rlctl.worker plan`), starts the servers with `srun --het-group=1`, waits for their
/health, starts the trainer ranks with `srun --het-group=0` and the controller, and ends the whole
job as soon as any component exits. Every process runs `python -m rlctl.worker ROLE`, as with the
local launcher, and the run directory (a shared filesystem) stays the source of truth.

State queries use Slurm's CLI: one batched `squeue` with an explicit format for all runs, and
`scontrol show job -o` for the exit code of a finished job while Slurm still remembers it;
`sacct` where accounting is configured. The user's SQUEUE_FORMAT and friends are ignored.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rlctl.errors import RunError
from rlctl.recipe import Recipe, slurm_rollout_nodes

# ---------------------------------------------------------------------------------------------
# Rendering


def render_batch_script(recipe: Recipe, run_dir: Path, run_id: str, python: str) -> str:
    """The batch script of a run. Pure: same recipe, paths and interpreter -> same text."""
    sl = recipe.slurm
    n_servers, n_ranks = recipe.rollout.servers, recipe.train.ranks
    r_nodes, t_nodes = slurm_rollout_nodes(recipe), sl.trainer.nodes
    ranks_per_node, spn = n_ranks // t_nodes, sl.rollout.servers_per_node
    run_dir_q = shlex.quote(str(run_dir))

    def component(nodes: int, tasks_per_node: int, gpus: int, cpus: int, mem: str) -> list[str]:
        lines = [f"#SBATCH --job-name={run_id}", f"#SBATCH --nodes={nodes}", f"#SBATCH --ntasks-per-node={tasks_per_node}"]
        lines += [f"#SBATCH --gpus-per-node={gpus}"] if gpus else []
        lines += [f"#SBATCH --cpus-per-task={cpus}"] if cpus else []
        lines += [f"#SBATCH --mem={mem}"] if mem else []
        lines += [f"#SBATCH --{key}={value}" for key, value in (("partition", sl.partition), ("account", sl.account),
                                                                 ("qos", sl.qos)) if value]
        lines += [f"#SBATCH {arg}" for arg in sl.sbatch_args]
        return lines

    header = [
        "#!/bin/bash",
        "# shellcheck disable=SC1090,SC1091  # slurm.setup may source files that exist only on the nodes",
        f"# rlctl run {run_id}: one heterogeneous Slurm job, written by `rlctl launch` (launcher=slurm).",
        f"#   component 0: {t_nodes} trainer node(s), {n_ranks} trainer rank(s); the controller runs on the first",
        f"#   component 1: {r_nodes} rollout node(s), {n_servers} rollout server(s), {spn} per node",
        f"#SBATCH --output={run_dir}/logs/slurm-%j.out",
        f"#SBATCH --time={sl.time}",
        *component(t_nodes, ranks_per_node, sl.trainer.gpus_per_node, sl.trainer.cpus_per_task, sl.trainer.mem),
        "#SBATCH hetjob",
        *component(r_nodes, spn, sl.rollout.gpus_per_node, sl.rollout.cpus_per_task, sl.rollout.mem),
    ]
    setup = "\n".join(sl.setup) if sl.setup else "# (no slurm.setup lines)"
    port_base = str(sl.port_base) if sl.port_base else "$((20000 + SLURM_JOB_ID % 20000))"
    prepare = (
        'rlctl_step prepare >"$RLCTL_LOGS/prepare.log" 2>&1 '
        '|| end_run failed prepare "building the model failed; see $RLCTL_LOGS/prepare.log"\n'
        if recipe.model.init is not None else ""
    )
    body = f"""\
set -uo pipefail

RUN_DIR={run_dir_q}
PY={shlex.quote(python)}
export RLCTL_LOGS="$RUN_DIR/logs/attempt-${{SLURM_RESTART_COUNT:-0}}"
export PYTHONUNBUFFERED=1
mkdir -p "$RLCTL_LOGS"

# slurm.setup
{setup}

rlctl_step() {{ "$PY" -m rlctl.worker "$1" --run-dir "$RUN_DIR" "${{@:2}}"; }}

# stop_pids GRACE PID...: SIGTERM (srun passes it to its tasks), SIGKILL after GRACE seconds.
stop_pids() {{
  local grace=$1 pid i alive
  shift
  for pid in "$@"; do kill -TERM "$pid" 2>/dev/null; done
  for ((i = 0; i < grace * 10; i++)); do
    alive=0
    for pid in "$@"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ "$alive" = 0 ] && return 0
    sleep 0.1
  done
  for pid in "$@"; do kill -KILL "$pid" 2>/dev/null; done
}}

CONTROLLER="" TRAINER="" ROLLOUT=""

# end_run STATE COMPONENT REASON: record the run's end, stop every component, leave the job.
# No component may hold nodes after another one died.
end_run() {{
  trap - TERM INT
  if [ "$1" = completed ]; then
    rlctl_step state --state completed --reason "$3"
    stop_pids 15 ${{CONTROLLER:+"$CONTROLLER"}} ${{TRAINER:+"$TRAINER"}}
    stop_pids 10 ${{ROLLOUT:+"$ROLLOUT"}}
    exit 0
  fi
  rlctl_step state --state "$1" --failed "$2" --reason "$3"
  stop_pids 3 ${{CONTROLLER:+"$CONTROLLER"}} ${{TRAINER:+"$TRAINER"}} ${{ROLLOUT:+"$ROLLOUT"}}
  exit 1
}}
trap 'end_run cancelled job "SIGTERM from Slurm (scancel or the time limit)"' TERM
trap 'end_run cancelled job "SIGINT from Slurm"' INT

TRAINER_NODES=$(scontrol show hostnames "$SLURM_JOB_NODELIST_HET_GROUP_0" | tr '\\n' ' ')
ROLLOUT_NODES=$(scontrol show hostnames "$SLURM_JOB_NODELIST_HET_GROUP_1" | tr '\\n' ' ')
rlctl_step plan --trainer-nodes "$TRAINER_NODES" --rollout-nodes "$ROLLOUT_NODES" --port-base "{port_base}" \\
  || end_run failed plan "could not write the plan; see $RUN_DIR/logs/slurm-$SLURM_JOB_ID.out"
{prepare}
# Rollout servers on every node of component 1, then wait for their /health.
srun --het-group=1 --nodes={r_nodes} --ntasks={n_servers} --ntasks-per-node={spn} --kill-on-bad-exit=1 \\
  --output="$RLCTL_LOGS/rollout-%t.log" "$PY" -m rlctl.worker rollout --run-dir "$RUN_DIR" \\
  2>"$RLCTL_LOGS/rollout.srun.log" &
ROLLOUT=$!
deadline=$((SECONDS + {sl.health_timeout_s}))
until rlctl_step health; do
  if ! kill -0 "$ROLLOUT" 2>/dev/null; then
    wait "$ROLLOUT"
    end_run failed rollout "the servers' srun step exited with code $? before all were healthy"
  fi
  if [ "$SECONDS" -ge "$deadline" ]; then
    end_run failed rollout "not every server answered /health within {sl.health_timeout_s} s"
  fi
  sleep 1
done

# Trainer ranks on component 0 (rendezvous on its first node), and the controller here.
srun --het-group=0 --nodes={t_nodes} --ntasks={n_ranks} --ntasks-per-node={ranks_per_node} --kill-on-bad-exit=1 \\
  --output="$RLCTL_LOGS/trainer-%t.log" "$PY" -m rlctl.worker trainer --run-dir "$RUN_DIR" \\
  2>"$RLCTL_LOGS/trainer.srun.log" &
TRAINER=$!
"$PY" -m rlctl.worker controller --run-dir "$RUN_DIR" >"$RLCTL_LOGS/controller.log" 2>&1 &
CONTROLLER=$!
rlctl_step state --state running

# The job ends as soon as any component exits. A server or trainer that died is the cause when
# the controller fails too (its requests to them fail), so they are named first.
step_exited() {{  # step_exited COMPONENT PID: end the run if that srun step has exited
  if ! kill -0 "$2" 2>/dev/null; then
    wait "$2"
    end_run failed "$1" "its srun step exited with code $?"
  fi
}}
while sleep 1; do
  step_exited rollout "$ROLLOUT"
  step_exited trainer "$TRAINER"
  if ! kill -0 "$CONTROLLER" 2>/dev/null; then
    wait "$CONTROLLER"
    code=$?
    [ "$code" = 0 ] && end_run completed controller "all steps done"
    for _ in 1 2 3 4 5; do
      sleep 1
      step_exited rollout "$ROLLOUT"
      step_exited trainer "$TRAINER"
    done
    end_run failed controller "exited with code $code"
  fi
done
"""
    return "\n".join(header) + "\n" + body


# ---------------------------------------------------------------------------------------------
# Talking to Slurm


# Slurm's pending reason codes, in words (squeue's %r).
PENDING_REASONS = {
    "Resources": "waiting for nodes to free up",
    "Priority": "other jobs have higher priority",
    "Dependency": "waiting for a job it depends on",
    "DependencyNeverSatisfied": "a job it depends on failed: it will never start",
    "BeginTime": "its start time has not come yet",
    "JobHeldUser": "held by its user (scontrol release)",
    "JobHeldAdmin": "held by an administrator",
    "ReqNodeNotAvail": "the nodes it needs are down, drained or reserved",
    "PartitionDown": "its partition is down",
    "PartitionInactive": "its partition is inactive",
    "PartitionNodeLimit": "it asks for more nodes than the partition allows",
    "PartitionConfig": "it asks for more than the partition's configuration allows (nodes, CPUs or GPUs)",
    "PartitionTimeLimit": "its time limit is above the partition's",
    "QOSMaxGRESPerUser": "you are at your QOS's GPU limit",
    "QOSMaxJobsPerUserLimit": "you are at your QOS's running-job limit",
    "QOSMaxNodePerUserLimit": "you are at your QOS's node limit",
    "QOSMaxWallDurationPerJobLimit": "its time limit is above the QOS's",
    "AssocGrpGRES": "your account is at its GPU limit",
    "AssocGrpNodeLimit": "your account is at its node limit",
    "AssocMaxJobsLimit": "your account is at its job limit",
    "AssocGrpCPUMinutesLimit": "your account has used its CPU minutes",
    "InvalidAccount": "the account is not valid for you (check slurm.account)",
    "InvalidQOS": "the QOS is not valid for you (check slurm.qos)",
    "Reservation": "waiting for its reservation",
    "NodeDown": "a node it needs is down",
    "BadConstraints": "no nodes satisfy its constraints",
    "None": "just submitted",
}
ACTIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING", "SIGNALING",
          "STAGE_OUT", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD", "STOPPED"}
_SQUEUE_FORMAT = "%i|%j|%T|%r|%M|%N"
_VAGUE_REASONS = ("", "None", "Resources", "Priority")
# Settings of the user's shell that would change what Slurm's commands print.
_IGNORED_ENV = ("SQUEUE_FORMAT", "SQUEUE_FORMAT2", "SQUEUE_SORT", "SQUEUE_STATES", "SACCT_FORMAT", "SLURM_TIME_FORMAT")


@dataclass
class JobInfo:
    job_id: str
    state: str
    """Slurm's state name: PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, TIMEOUT, ..."""
    reason: str = ""
    elapsed: str = ""
    nodes: list[str] = field(default_factory=list)
    """Node list per het component (trainer, rollout), in Slurm's compressed form."""
    exit_code: str = ""
    """Slurm's exit code, CODE:SIGNAL, once the job has ended."""

    @property
    def active(self) -> bool:
        return self.state in ACTIVE

    def describe(self) -> str:
        """One line in words: PENDING with why, RUNNING with where and how long, or how it ended."""
        if self.state == "PENDING":
            return f"PENDING: {PENDING_REASONS.get(self.reason, self.reason or 'queued')}"
        if self.active:
            where = " | ".join(self.nodes)
            return f"{self.state} on {where} for {self.elapsed}" if where else self.state
        code = f" (exit code {self.exit_code})" if self.exit_code else ""
        return f"{self.state}{code}"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _run(cmd: list[str], timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in _IGNORED_ENV}
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
    cmd = ["squeue", "-h", "-t", "all", "-o", _SQUEUE_FORMAT, "-j", ",".join(job_ids)]
    res = _run(cmd)
    if res.returncode != 0:
        if "Invalid job id" not in res.stderr:
            raise _failed(cmd, res)
        res = subprocess.CompletedProcess(cmd, 0, "", "")  # all of them forgotten
    jobs: dict[str, JobInfo] = {}
    for line in res.stdout.splitlines():
        parts = line.split("|")
        if len(parts) != 6:
            continue
        jid, _name, state, reason, elapsed, nodes = parts
        base, _, offset = jid.partition("+")
        job = jobs.setdefault(base, JobInfo(base, state, reason, elapsed, []))
        if offset in ("", "0"):
            job.state, job.elapsed = state, elapsed
        if job.reason in _VAGUE_REASONS and reason not in _VAGUE_REASONS:
            job.reason = reason  # a het job's real obstacle may be one component's: say that one
        job.nodes.append(nodes)
    for jid, job in jobs.items():
        if not job.active:
            job.exit_code = _exit_code(jid)
    missing = [j for j in job_ids if j not in jobs]
    if missing:
        jobs.update(_sacct(missing))
    return jobs


def _exit_code(job_id: str) -> str:
    res = _run(["scontrol", "show", "job", "-o", job_id])
    for line in res.stdout.splitlines():
        for item in line.split():
            if item.startswith("ExitCode="):
                return item.split("=", 1)[1]
    return ""


def _sacct(job_ids: list[str]) -> dict[str, JobInfo]:
    """Finished jobs from accounting; nothing where accounting is off (then run.json tells)."""
    res = _run(["sacct", "-P", "-n", "-X", "--format=JobID,State,Elapsed,NodeList,ExitCode,Reason", "-j", ",".join(job_ids)])
    if res.returncode != 0:
        return {}
    jobs: dict[str, JobInfo] = {}
    for line in res.stdout.splitlines():
        parts = line.split("|")
        if len(parts) < 6:
            continue
        jid, state, elapsed, nodes, exit_code, reason = parts[:6]
        base, _, offset = jid.partition("+")
        state = state.split()[0]  # "CANCELLED by 0"
        job = jobs.setdefault(base, JobInfo(base, state, reason, elapsed, [], exit_code))
        if offset in ("", "0"):
            job.state, job.exit_code = state, exit_code
        job.nodes.append(nodes)
    return jobs


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
# The run's state joined with Slurm's


def job_id_of(info: dict[str, Any]) -> str | None:
    return (info.get("slurm") or {}).get("job_id")


def needs_query(info: dict[str, Any]) -> bool:
    """Ask Slurm about this run? While the run is going, or while its last seen job state was
    still active (so that the final state and exit code get recorded)."""
    if info.get("launcher") != "slurm" or not job_id_of(info):
        return False
    from rlctl.rundir import RunState

    last = (info.get("slurm") or {}).get("last")
    return not RunState(info["state"]).finished or last is None or last.get("state") in ACTIVE


def reconcile(rd, info: dict[str, Any], job: JobInfo | None, queried: bool) -> dict[str, Any]:
    """Record what Slurm said in run.json (Slurm forgets finished jobs after MinJobAge), and end a
    run whose job ended without the run recording it (killed, time limit, node failure).
    Returns the updated run.json."""
    from rlctl.rundir import RunState

    jid = job_id_of(info)
    if not queried or jid is None:
        return info
    if job is not None:
        info = rd.update(lambda d: d["slurm"].update(last=job.to_json()))
    if RunState(info["state"]).finished:
        last = (info.get("slurm") or {}).get("last")
        if job is None and last is not None and last.get("state") in ACTIVE:
            # The run ended and Slurm has forgotten the job since we last looked: stop asking.
            ended = {**last, "state": "ENDED", "reason": "no longer listed by Slurm"}
            info = rd.update(lambda d: d["slurm"].update(last=ended))
        return info
    if job is None:
        last = (info.get("slurm") or {}).get("last")
        if last is None:
            return info  # just submitted: squeue may not list it for a moment
        job = JobInfo(**{**last, "state": "UNKNOWN"})
        reason = f"Slurm job {jid} is no longer known to Slurm and the run never recorded its end"
    elif job.active:
        return info
    else:
        reason = f"Slurm job {jid} ended {job.describe()} before the run recorded its end"
    state = RunState.CANCELLED if job.state == "CANCELLED" else RunState.FAILED
    rd.set_state(state, reason)
    rd.event("run_end", state=state.value, reason=reason)
    return rd.read()


def refresh(runs: list, infos: dict[str, dict[str, Any]] | None = None) -> dict[str, JobInfo | None]:
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
