"""The rlctl steps a Slurm batch script runs besides the roles (see rlctl/launchers/slurm/script.py).

    python -m rlctl.worker attempt --run-dir D     prints the attempt's number; a later attempt (a
                                                   requeue, a resubmission) resumes from the newest checkpoint
    python -m rlctl.worker plan    --run-dir D --trainer-nodes "n1" --rollout-nodes "n2 n3" --port-base P
    python -m rlctl.worker health  --run-dir D     exit 0 when every rollout server answers /health
    python -m rlctl.worker requeue --run-dir D     exit 0 when the job should requeue itself (recorded)
    python -m rlctl.worker server-exit --run-dir D --index I --code C --restarts K
                                                   rollout server I's step exited; the K-th restart
    python -m rlctl.worker state   --run-dir D --state failed --failed rollout [--reason ...]

They run on the job's first trainer node and write to the run directory (a shared filesystem),
so the run directory stays the source of truth for `rlctl status` as with the local launcher.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
from pathlib import Path

from rlctl.run.checkpoint import list_checkpoints, prepare_resume
from rlctl.launchers.health import healthy
from rlctl.process.topology import Topology, slurm_topology
from rlctl.recipe import FieldError, recipe_from_yaml
from rlctl.run.dir import RunDir, RunState, now_iso
from rlctl.run.tail import last_log_line

# What srun says on its own stderr when a task of its step ends badly.
_SRUN_TASK_ERROR = re.compile(r"srun: error: (?P<node>\S+): tasks? (?P<tasks>[\d,\-]+): (?P<what>.+)")


def main(args: argparse.Namespace) -> int:
    rd = RunDir(args.run_dir)
    if args.role == "plan":
        return write_plan(rd, args.trainer_nodes.split(), args.rollout_nodes.split(), args.port_base)
    if args.role == "health":
        plan = Topology.from_json(rd.read()["plan"])
        return 0 if all(healthy(url) for url in plan.server_urls) else 1
    if args.role == "attempt":
        print(start_attempt(rd), flush=True)
        return 0
    if args.role == "requeue":
        return requeue(rd)
    if args.role == "server-exit":
        return server_exit(rd, args.index, args.code, args.restarts)
    return record_state(rd, RunState(args.state), args.reason, args.failed)


def write_plan(rd: RunDir, trainer_nodes: list[str], rollout_nodes: list[str], port_base: int) -> int:
    """The plan from the job's nodes, once the recipe's files are found here: `rlctl launch` does
    not look for them (the submitting machine need not hold the cluster's paths). A failure is
    the run's exit reason, in one line naming the key."""
    recipe = recipe_from_yaml(rd.recipe_path.read_text(), str(rd.recipe_path))
    try:
        for key, section in (("model", recipe.model), ("data", recipe.data)):
            try:
                section.check_files()
            except FieldError as e:
                raise ValueError(f"{key}.{e.key}: {e.message} (looked for on {socket.gethostname()}, the job's "
                                 "first node)") from None
        wandb_missing = recipe.tracking.wandb.missing_here()  # the controller logs from this node
        if wandb_missing:
            raise ValueError(f"tracking.wandb.mode: {wandb_missing} (looked for on {socket.gethostname()}, the "
                             "job's first node)")
        plan = slurm_topology(recipe, trainer_nodes, rollout_nodes, port_base)
    except ValueError as e:
        print(f"error: {e}", flush=True)
        record_state(rd, RunState.FAILED, str(e), "")
        return 1

    def apply(d: dict) -> None:
        d["plan"] = plan.to_json()
        d.setdefault("slurm", {}).update(
            job_id=os.environ.get("SLURM_JOB_ID"), restart_count=int(os.environ.get("SLURM_RESTART_COUNT", 0)),
            trainer_nodes=trainer_nodes, rollout_nodes=rollout_nodes, batch_host=socket.gethostname(),
            logs=os.environ.get("RLCTL_LOGS"),
        )
    rd.update(apply)
    print(f"plan: trainers on {' '.join(trainer_nodes)}, rollout servers on {' '.join(rollout_nodes)}, ports from {port_base}",
          flush=True)
    return 0


def server_exit(rd: RunDir, index: int, code: int, restarts: int) -> int:
    """Record that rollout server `index`'s step exited with `code` while the run was running, and
    what the batch script does about it: start it again (restart number `restarts`), or give it
    up after rollout.max_restarts. The same events as the local supervisor's."""
    recipe = recipe_from_yaml(rd.recipe_path.read_text(), str(rd.recipe_path))
    role, limit = f"rollout-{index}", recipe.rollout.max_restarts
    rd.event("process_exit", role=role, code=code)
    rd.event("server_down", role=role)
    if restarts > limit:
        rd.event("server_given_up", role=role, restarts=limit)
    else:
        rd.event("server_restarted", role=role, attempt=restarts, after=f"its srun step exited with code {code}")
    return 0


def start_attempt(rd: RunDir) -> int:
    """The number of the attempt this job starts (1, 2, ...). The run's first starts it; any later
    one (Slurm requeued the job, or `rlctl resume` submitted it again) continues from the newest
    checkpoint, or from the start where there is none yet."""
    started = int((rd.read().get("slurm") or {}).get("attempts_started", 0))
    if started:
        found = list_checkpoints(rd.path)
        prepare_resume(rd, found[-1] if found else None)
    rd.update(lambda d: d.setdefault("slurm", {}).update(attempts_started=started + 1))
    return started + 1


def requeue(rd: RunDir) -> int:
    """Before the time limit (the controller has checkpointed and stopped, or the warning came
    before it started): 0 and the requeue recorded when the job should requeue itself; 1 and the
    run failed, saying why, when slurm.max_requeues is reached or the attempt made no progress."""
    info = rd.read()
    recipe = recipe_from_yaml(rd.recipe_path.read_text(), str(rd.recipe_path))
    restarts = int(os.environ.get("SLURM_RESTART_COUNT", 0))
    began = int((info.get("resume") or {}).get("steps", 0))
    found = list_checkpoints(rd.path)
    newest = found[-1].steps if found else 0
    limit = recipe.slurm.max_requeues
    if restarts >= limit:
        why = f"the time limit came again and the job was requeued slurm.max_requeues={limit} times already"
    elif newest <= began:
        why = (f"the time limit came before this attempt wrote a checkpoint beyond step {began}: raise slurm.time "
               f"or slurm.signal_before_s (now {recipe.slurm.signal_before_s} s)")
    else:
        reason = f"the time limit was near: a checkpoint at step {newest}, then requeued"
        rd.event("requeue", restart_count=restarts, checkpoint_steps=newest, reason=reason)
        end = {"state": "requeued", "at": now_iso(), "reason": reason}
        rd.update(lambda d: d.update(state=RunState.STARTING.value, attempt_end=end))
        return 0
    record_state(rd, RunState.FAILED, why + (f"; `rlctl resume {rd.id}` continues from step {newest}" if found else ""), "")
    return 1


def record_state(rd: RunDir, state: RunState, reason: str, failed: str) -> int:
    if failed and state is RunState.FAILED:
        reason = failure_reason(rd, failed, reason)
    if state.finished:
        if RunState(rd.read()["state"]).finished:
            return 0  # the first word stands: a cancel after a failure does not rewrite why
        rd.event("run_end", state=state.value, reason=reason)
    rd.set_state(state, reason or None)
    return 0


def failure_reason(rd: RunDir, component: str, what: str) -> str:
    """Name the process that died: srun's own stderr says which task of the step ended badly and
    on which node; that task's log usually says why."""
    logs = Path(os.environ.get("RLCTL_LOGS") or rd.logs)
    srun_log = logs / f"{component}.srun.log"
    lines = srun_log.read_text(errors="replace").splitlines() if srun_log.is_file() else []
    for line in lines:  # the first task srun reports is the one that died; --kill-on-bad-exit ended the rest
        m = _SRUN_TASK_ERROR.search(line)
        if m:
            task = re.split(r"[,-]", m["tasks"])[0]
            role = component if component[-1].isdigit() else f"{component}-{task}"  # rollout-3: a step of its own
            said = last_log_line(logs / f"{role}.log")
            tail = f"; it said: {said}" if said and "Killed" not in m["what"] else ""
            return f"{role} on {m['node']}: {m['what'].strip()} ({what}){tail}; see {logs / f'{role}.log'}"
    said = last_log_line(logs / f"{component}.log") if component == "controller" else None
    return f"{component}: {what}" + (f"; it said: {said}" if said else "") + f"; see {logs}"

