"""The batch script of a Slurm run: a pure function of the recipe, golden-tested
(tests/golden/slurm/).

Component 0 holds the trainer ranks (and the controller, on its first node); component 1 holds the
rollout servers. The script resolves its node names, writes the plan into run.json (`python -m
rlctl.worker plan`), starts the servers with `srun --het-group=1`, waits for their /health, starts
the trainer ranks with `srun --het-group=0` and the controller, and ends the whole job as soon as
any component exits. Every process runs `python -m rlctl.worker ROLE`, as with the local launcher,
and the run directory (a shared filesystem) stays the source of truth.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from rlctl.recipe import Recipe, slurm_rollout_nodes


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
