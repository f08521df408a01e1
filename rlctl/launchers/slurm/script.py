"""The batch script of a Slurm run: a pure function of the recipe, golden-tested
(tests/golden/slurm/).

Component 0 holds the trainer ranks (and the controller, on its first node); component 1 holds the
rollout servers. The script starts the attempt (`python -m rlctl.worker attempt`: a later one
resumes from the newest checkpoint), resolves its node names, writes the plan into run.json
(`python -m rlctl.worker plan`), starts each server as its own `srun --het-group=1` step on its
node, waits for their /health, starts the trainer ranks with `srun --het-group=0` and the
controller, and then watches them: a server step that exits is started again (up to
rollout.max_restarts), the trainer step or the controller exiting ends the whole job. With
slurm.requeue, Slurm's SIGUSR1 before the time limit makes the controller checkpoint and stop,
and the job requeues itself. Every process runs `python -m rlctl.worker ROLE`, as with the local
launcher, and the run directory (a shared filesystem) stays the source of truth.

Placement, what each task gets:
- GPUs. Each rollout server's step asks for its own (`--gres=gpu:N --exact`), so Slurm gives the
  servers of a node different GPUs and a restarted one free ones; the server counts them from 0
  (SGLang's --base-gpu-id 0, the built-in server's cuda:0), whatever Slurm's numbering (GPUs 4-7
  of a shared node, or 0..k-1 renumbered under ConstrainDevices). Trainer ranks see every GPU of
  their node and take GPU rank mod count, as the local launcher does.
- CPUs and memory: `--cpus-per-task` on sbatch and on srun (srun of Slurm 22.05 and 23.02 does not
  inherit it), CPUS_PER_GPU per GPU of a task by default; `--mem=0` (the node's memory) by default
  for a component that asks for GPUs. rlctl/recipe/cluster.py says what each key defaults to.
- Environment: slurm.setup's lines, then slurm.env's exports; srun passes the whole environment
  (`--export=ALL`, whatever the submitting shell's SLURM_EXPORT_ENV says) to every task. The
  nodes' Python is chosen after both (`python_lines`).
"""

from __future__ import annotations

import shlex
from pathlib import Path

from rlctl.run.checkpoint import PREEMPTED_EXIT
from rlctl.launchers.slurm.placement import node_mem, rank_gpus, server_gpus, step_placement, task_cpus
from rlctl.launchers.slurm.values import refuse_control_characters, sbatch_value
from rlctl.recipe import Recipe, SlurmConfig, slurm_rollout_nodes


def port_stride(recipe: Recipe) -> int:
    """Ports a job takes from its base (servers per node, the trainer service, the rendezvous, the
    weight-sync store), rounded up to 8: job j's ports start at 20000 + j x stride (mod 40000), so
    the jobs of a sweep sharing a node (consecutive ids) never share a port."""
    return -(-(recipe.slurm.rollout.servers_per_node + 3) // 8) * 8


def _quoted(value: str) -> str:
    """Single-quoted for the shell always, so that no value reads as anything but a string."""
    return "'" + value.replace("'", "'\"'\"'") + "'"


def python_lines(sl: SlurmConfig, fallback: str) -> str:
    """Set PY, the nodes' Python, after slurm.setup and slurm.env, and stop the job at once if it
    cannot import rlctl: slurm.python (a path, or a command looked up on PATH), else the python3
    that setup put on PATH, else (no setup lines) `fallback`, the interpreter of `rlctl launch`."""
    if sl.python.startswith("~/"):
        chosen, what = f'PY="$HOME"/{shlex.quote(sl.python[2:])}', "slurm.python"
    elif "/" in sl.python:
        chosen, what = f"PY={shlex.quote(sl.python)}", "slurm.python"
    elif sl.python or sl.setup:
        name = sl.python or "python3"
        chosen = f"PY=$(command -v {shlex.quote(name)} || echo {shlex.quote(name)})"
        what = "slurm.python" if sl.python else f"{name} on PATH after slurm.setup"
    else:
        chosen, what = f"PY={shlex.quote(fallback)}", "the python of rlctl launch"
    return f"""\
# The nodes' Python: {what}.
{chosen}
if ! "$PY" -c 'import rlctl' 2>/dev/null; then
  echo "error: the nodes' python, $PY ({what}), cannot import rlctl: install rlctl there, or fix slurm.setup / slurm.python" >&2
  exit 1
fi"""


# With slurm.requeue: Slurm sends the batch shell SIGUSR1 signal_before_s before the time limit.
_REQUEUE_FNS = r"""
# Slurm's warning before the time limit (--signal=B:USR1): the controller writes a checkpoint at
# the end of the step in progress and exits with code {preempted}; then the job requeues itself.
PREEMPT=""
on_usr1() {{
  echo "rlctl: SIGUSR1 at $(date -Is): the time limit is near; checkpoint, then requeue"
  PREEMPT=1
  [ -n "$CONTROLLER" ] && kill -USR1 "$CONTROLLER" 2>/dev/null
}}
trap on_usr1 USR1

# requeue_run: stop every component, and requeue this job unless rlctl_step requeue says not to
# (it records why: slurm.max_requeues, or no progress). Slurm holds the job for its credential
# lifetime, then starts it again, and the new attempt resumes from the newest checkpoint.
requeue_run() {{
  trap - USR1 INT
  trap 'exit 0' TERM  # scontrol requeue ends this script
  stop_pids 15 ${{CONTROLLER:+"$CONTROLLER"}} ${{TRAINER:+"$TRAINER"}}
  stop_pids 10 ${{SERVER[@]+"${{SERVER[@]}}"}}
  rlctl_step requeue || exit 1
  scontrol requeue "$SLURM_JOB_ID" || end_run failed job "scontrol requeue $SLURM_JOB_ID failed"
  sleep 60
  exit 0
}}
"""


_CONTROLLER = '"$PY" -m rlctl.worker controller --run-dir "$RUN_DIR" >"$RLCTL_LOGS/controller.log" 2>&1 &'


def _requeue_parts(requeue: bool) -> dict[str, str]:
    """The batch script's lines for slurm.requeue: its functions; the check while the servers
    start; the controller started with SIGUSR1 ignored until it sets its own handler (the default
    action would end it), and the warning sent again every second until it stops; the case of a
    controller that stopped after a checkpoint."""
    if not requeue:
        return {"requeue_fns": "", "requeue_early": "", "controller_start": _CONTROLLER, "requeue_resend": "",
                "requeue_after": ""}
    return {"requeue_fns": _REQUEUE_FNS.format(preempted=PREEMPTED_EXIT),
            "requeue_early": '[ -n "$PREEMPT" ] && requeue_run\n  ',
            "controller_start": f"(trap '' USR1; exec {_CONTROLLER[:-2]}) &",
            "requeue_resend": '[ -n "$PREEMPT" ] && kill -USR1 "$CONTROLLER" 2>/dev/null\n  ',
            "requeue_after": f'[ "$code" = {PREEMPTED_EXIT} ] && requeue_run\n'}


def _nodes_and_memory(colocated: bool, spn: int) -> tuple[str, str]:
    """The lines that name the job's nodes, and those that give each step its share of a node's
    memory (STEP_MEM for a server, TRAINER_MEM for the trainer step; JOB_MEM is scontrol's Mem=,
    in MB, all of the node's with --mem=0). Colocated, the servers of a node share half of it and the
    trainer ranks the other half."""
    if colocated:
        return ("""TRAINER_NODES=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | tr '\\n' ' ')
ROLLOUT_NODES=$TRAINER_NODES  # colocated: every server on its trainer ranks' node""",
                f"""STEP_MEM=() TRAINER_MEM=()
if [ "${{JOB_MEM:-0}}" -gt 0 ]; then
  STEP_MEM=(--mem=$((JOB_MEM / 2 / {spn}))M) TRAINER_MEM=(--mem=$((JOB_MEM / 2))M)
fi""")
    return ("""TRAINER_NODES=$(scontrol show hostnames "$SLURM_JOB_NODELIST_HET_GROUP_0" | tr '\\n' ' ')
ROLLOUT_NODES=$(scontrol show hostnames "$SLURM_JOB_NODELIST_HET_GROUP_1" | tr '\\n' ' ')""",
            f"""STEP_MEM=()
[ "${{JOB_MEM:-0}}" -gt 0 ] && STEP_MEM=(--mem=$((JOB_MEM / {spn}))M)""")


def render_batch_script(recipe: Recipe, run_dir: Path, run_id: str, python: str) -> str:
    """The batch script of a run. Pure: same recipe, paths and interpreter -> same text.

    `python` is the interpreter of `rlctl launch`, used on the nodes only when the recipe has
    neither slurm.python nor slurm.setup lines (`python_lines`)."""
    refuse_control_characters(recipe, run_dir, run_id, python)
    sl = recipe.slurm
    n_servers, n_ranks = recipe.rollout.servers, recipe.train.ranks
    r_nodes, t_nodes = slurm_rollout_nodes(recipe), sl.trainer.nodes
    ranks_per_node, spn = n_ranks // t_nodes, sl.rollout.servers_per_node
    run_dir_q = shlex.quote(str(run_dir))
    threads, colocated = recipe.run.threads_per_process, recipe.colocate.enabled
    t_cpus = task_cpus(sl.trainer.cpus_per_task, rank_gpus(recipe), threads)
    r_cpus = task_cpus(sl.rollout.cpus_per_task, server_gpus(recipe, bound=False), threads)

    def component(nodes: int, tasks_per_node: int, gpus: int, cpus: int, mem: str) -> list[str]:
        lines = [f"#SBATCH --job-name={run_id}", f"#SBATCH --nodes={nodes}", f"#SBATCH --ntasks-per-node={tasks_per_node}"]
        lines += [f"#SBATCH --gpus-per-node={gpus}"] if gpus else []
        lines += [f"#SBATCH --cpus-per-task={cpus}"]
        lines += [f"#SBATCH --mem={node_mem(mem, gpus)}"] if node_mem(mem, gpus) else []
        lines += [f"#SBATCH --{key}={value}" for key, value in (("partition", sl.partition), ("account", sl.account),
                                                                 ("qos", sl.qos)) if value]
        lines += [f"#SBATCH {arg}" for arg in sl.sbatch_args]
        return lines

    if colocated:
        what = [f"# rlctl run {run_id}: one Slurm job, written by `rlctl launch` (launcher=slurm, colocate.enabled).",
                f"#   {t_nodes} node(s), {n_ranks} trainer rank(s) and {n_servers} rollout server(s) taking turns on "
                f"their GPUs; the controller runs on the first"]
        components = component(t_nodes, ranks_per_node, sl.trainer.gpus_per_node, t_cpus, sl.trainer.mem)
    else:
        what = [f"# rlctl run {run_id}: one heterogeneous Slurm job, written by `rlctl launch` (launcher=slurm).",
                f"#   component 0: {t_nodes} trainer node(s), {n_ranks} trainer rank(s); the controller runs on the first",
                f"#   component 1: {r_nodes} rollout node(s), {n_servers} rollout server(s), {spn} per node"]
        components = [*component(t_nodes, ranks_per_node, sl.trainer.gpus_per_node, t_cpus, sl.trainer.mem),
                      "#SBATCH hetjob", *component(r_nodes, spn, sl.rollout.gpus_per_node, r_cpus, sl.rollout.mem)]
    header = [
        "#!/bin/bash",
        "# shellcheck disable=SC1090,SC1091  # slurm.setup may source files that exist only on the nodes",
        *what,
        f"#SBATCH --output={sbatch_value(str(run_dir).replace('%', '%%') + '/logs/slurm-%j.out')}",
        "#SBATCH --open-mode=append",
        f"#SBATCH --time={sl.time}",
        *([f"#SBATCH --signal=B:USR1@{sl.signal_before_s}", "#SBATCH --requeue"] if sl.requeue else ["#SBATCH --no-requeue"]),
        *components,
    ]
    setup = "\n".join(sl.setup) if sl.setup else "# (no slurm.setup lines)"
    env = "\n".join(f"export {name}={_quoted(value)}" for name, value in sl.env.items()) or "# (no slurm.env)"
    place = step_placement(recipe)
    no_expand = '# shellcheck disable=SC2016  # "$@" is expanded by the step\'s own shell\n'
    server_note = "  " + no_expand if place.server_bind else ""
    trainer_note = no_expand if place.trainer_bind else ""
    port_base = str(sl.port_base) if sl.port_base else f"$((20000 + SLURM_JOB_ID * {port_stride(recipe)} % 40000))"
    prepare = (
        'rlctl_step prepare >"$RLCTL_LOGS/prepare.log" 2>&1 '
        '|| end_run failed prepare "building the model failed; see $RLCTL_LOGS/prepare.log"\n'
        if recipe.model.init is not None else ""
    )
    rq = _requeue_parts(sl.requeue)
    nodes, step_mem = _nodes_and_memory(colocated, spn)
    max_restarts = recipe.rollout.max_restarts
    stall_s = int(recipe.run.stall_timeout_s)
    body = f"""\
set -uo pipefail

RUN_DIR={run_dir_q}
export PYTHONUNBUFFERED=1
echo "rlctl: job ${{SLURM_JOB_ID:-}} starts on $HOSTNAME (Slurm restart count ${{SLURM_RESTART_COUNT:-0}})"

# slurm.setup
{setup}

# slurm.env
{env}

{python_lines(sl, python)}
{place.functions}
rlctl_step() {{ "$PY" -m rlctl.worker "$1" --run-dir "$RUN_DIR" "${{@:2}}"; }}

# The attempt's number; a later attempt (requeued, or submitted again by rlctl resume) continues
# from the run's newest checkpoint. Each attempt logs into its own folder.
ATTEMPT=$(rlctl_step attempt | tail -n 1) || {{ echo "error: could not start the attempt in $RUN_DIR" >&2; exit 1; }}
export RLCTL_LOGS="$RUN_DIR/logs/attempt-$ATTEMPT"
mkdir -p "$RLCTL_LOGS"

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

CONTROLLER="" TRAINER=""

# end_run STATE COMPONENT REASON: record the run's end, stop every component, leave the job.
# No component may hold nodes after another one died.
end_run() {{
  trap - TERM INT
  if [ "$1" = completed ]; then
    rlctl_step state --state completed --reason "$3"
    stop_pids 15 ${{CONTROLLER:+"$CONTROLLER"}} ${{TRAINER:+"$TRAINER"}}
    stop_pids 10 ${{SERVER[@]+"${{SERVER[@]}}"}}
    exit 0
  fi
  rlctl_step state --state "$1" --failed "$2" --reason "$3"
  stop_pids 3 ${{CONTROLLER:+"$CONTROLLER"}} ${{TRAINER:+"$TRAINER"}} ${{SERVER[@]+"${{SERVER[@]}}"}}
  exit 1
}}
trap 'end_run cancelled job "SIGTERM from Slurm (scancel or the time limit)"' TERM
trap 'end_run cancelled job "SIGINT from Slurm"' INT
{rq['requeue_fns']}
{nodes}
rlctl_step plan --trainer-nodes "$TRAINER_NODES" --rollout-nodes "$ROLLOUT_NODES" --port-base "{port_base}" \\
  || end_run failed plan "could not write the plan; see $RUN_DIR/logs/slurm-$SLURM_JOB_ID.out"
{prepare}
# Rollout servers: one srun step each, on its node of {'the job' if colocated else 'component 1'} (server i on node i / {spn}), so
# that a server that dies while the run runs is started again alone, on its node, up to
# rollout.max_restarts times (server_check); meanwhile the controller sends its requests to the
# others, and gives it the weights when it is back. Then wait for every server's /health.
read -r -a ROLLOUT_NODE <<<"$ROLLOUT_NODES"
# Each server step asks for its share of the memory the job holds on a node (scontrol's Mem=, in MB;
# all of the node's with --mem=0): where Slurm tracks memory, a step that names none asks for all of
# it, and the servers of a node could not run side by side. Where it does not (Mem=0), nothing.
JOB_MEM=$(scontrol show job -d "${{SLURM_JOB_ID_HET_GROUP_1:-$SLURM_JOB_ID}}" 2>/dev/null | grep -o ' Mem=[0-9]*' | head -n 1 | cut -d= -f2)
{step_mem}
SERVER=() RESTARTS=()
start_server() {{  # start_server I: server I's step
{server_note}  srun {place.server_group}--nodes=1 --ntasks=1 --nodelist="${{ROLLOUT_NODE[$1 / {spn}]}}" --cpus-per-task={r_cpus} \\
    {place.server_flags} ${{STEP_MEM[@]+"${{STEP_MEM[@]}}"}} --export=ALL --output="$RLCTL_LOGS/rollout-$1.log" \\
    {place.server_bind}"$PY" -m rlctl.worker rollout --run-dir "$RUN_DIR" --index "$1" 2>>"$RLCTL_LOGS/rollout-$1.srun.log" &
  SERVER[$1]=$!
}}
# server_check: a server step that exited ends the run before the controller runs; after, it is
# started again, or given up after rollout.max_restarts (the run goes on without it).
server_check() {{
  local i code
  for ((i = 0; i < {n_servers}; i++)); do
    if [ -z "${{SERVER[i]}}" ] || kill -0 "${{SERVER[i]}}" 2>/dev/null; then continue; fi  # given up, or running
    wait "${{SERVER[i]}}"
    code=$?
    [ -n "$CONTROLLER" ] || end_run failed "rollout-$i" "its srun step exited with code $code before all were healthy"
    RESTARTS[i]=$((RESTARTS[i] + 1))
    rlctl_step server-exit --index "$i" --code "$code" --restarts "${{RESTARTS[i]}}"
    if ((RESTARTS[i] > {max_restarts})); then SERVER[i]=""; else start_server "$i"; fi
  done
}}
for ((i = 0; i < {n_servers}; i++)); do RESTARTS[i]=0; start_server "$i"; done
deadline=$((SECONDS + {sl.health_timeout_s}))
until rlctl_step health; do
  server_check
  {rq['requeue_early']}if [ "$SECONDS" -ge "$deadline" ]; then
    end_run failed rollout "not every server answered /health within {sl.health_timeout_s} s"
  fi
  sleep 1
done

# Trainer ranks{' on component 0' if not colocated else ''} (rendezvous on its first node), and the controller here.
{trainer_note}srun {place.trainer_flags}--nodes={t_nodes} --ntasks={n_ranks} --ntasks-per-node={ranks_per_node} --cpus-per-task={t_cpus} \\
  --export=ALL --kill-on-bad-exit=1 --output="$RLCTL_LOGS/trainer-%t.log" \\
  {place.trainer_bind}"$PY" -m rlctl.worker trainer --run-dir "$RUN_DIR" 2>"$RLCTL_LOGS/trainer.srun.log" &
TRAINER=$!
rm -f "$RUN_DIR/heartbeat"  # the controller's loop touches it every 2 s (rlctl/process/watchdog.py)
{rq['controller_start']}
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
# run.stall_timeout_s: a controller whose heartbeat stopped is frozen or hung.
heartbeat_check() {{
  local beat
  beat=$(stat -c %Y "$RUN_DIR/heartbeat" 2>/dev/null) || return 0
  if (( $(date +%s) - beat > {stall_s} )); then
    end_run failed controller "made no progress for {stall_s} s (its heartbeat stopped; run.stall_timeout_s): frozen or hung; see $RLCTL_LOGS/controller.log"
  fi
}}
while sleep 1; do
  {rq['requeue_resend']}server_check
  step_exited trainer "$TRAINER"
  heartbeat_check
  if ! kill -0 "$CONTROLLER" 2>/dev/null; then
    wait "$CONTROLLER"
    code=$?
    [ "$code" = 0 ] && end_run completed controller "all steps done"
    {rq['requeue_after']}    for _ in 1 2 3 4 5; do
      sleep 1
      step_exited trainer "$TRAINER"
    done
    end_run failed controller "exited with code $code"
  fi
done
"""
    return "\n".join(header) + "\n" + body
