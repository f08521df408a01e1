"""Where each task of a Slurm run lands: its GPUs, CPUs and memory (rlctl/launchers/slurm/script.py
writes the lines).

Side by side (the default), component 1's server steps each ask for their own GPUs (`--gres=gpu:N
--exact`) and bind to them (rlctl_own_gpus), and component 0's trainer ranks see every GPU of their
node. Colocated, one component holds both (rlctl_colocated_gpus, below).
"""

from __future__ import annotations

from dataclasses import dataclass

from rlctl.engines.rollout.registry import rollout_adapter
from rlctl.engines.train.adapter import trainer_adapter
from rlctl.recipe import Device, Recipe

CPUS_PER_GPU = 4
"""Default CPUs per GPU of a task: SGLang runs a scheduler process per GPU besides its HTTP and
detokenizer processes; 4 per GPU fits every GPU node with 8 GPUs and 32 CPUs or more."""

# Exported to the rollout steps (srun --export=ALL), which run `bash -c 'rlctl_own_gpus N "$@"' ...`.
_OWN_GPUS = r"""
# rlctl_own_gpus N CMD...: exec CMD on the N GPUs Slurm gave this server's step (--gres=gpu:N, so
# the servers of a node never share one: Slurm gives concurrent steps different GPUs), counted
# from 0 by the server; 0..N-1 where Slurm set no CUDA_VISIBLE_DEVICES.
rlctl_own_gpus() {{
  local n=$1 all mine
  shift
  IFS=, read -r -a all <<<"${{CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $((n - 1)))}}"
  if ((${{#all[@]}} < n)); then
    echo "error: $(hostname) gave this server ${{#all[@]}} GPU(s) (${{all[*]}}), it needs $n:" \
      "raise slurm.rollout.gpus_per_node or lower servers_per_node" >&2
    exit 1
  fi
  mine=$(IFS=,; echo "${{all[*]:0:n}}")
  echo "rlctl: $(hostname) runs this server on GPUs $mine (CUDA_VISIBLE_DEVICES; step $SLURM_JOB_ID.$SLURM_STEP_ID)"
  export CUDA_VISIBLE_DEVICES=$mine
  exec "$@"
}}
export -f rlctl_own_gpus
"""

# Colocated (colocate.enabled): one component; its ranks' and servers' steps overlap
# (srun --overlap, no --gres: each sees all of the job's GPUs of its node) and each task takes its
# own by position, trainer rank r (SLURM_LOCALID l) GPU l of its node and server s's TP rank j GPU
# (s mod servers_per_node) x tp + j: a rank and the server TP rank it hands weights to (rlctl/
# engines/weightsync/ipc_ranks.py) share one GPU.
_COLOCATED_GPUS = r"""
# rlctl_colocated_gpus FIRST N CMD...: exec CMD on GPUs FIRST..FIRST+N-1 of those Slurm gave the job
# on this node (counted in CUDA_VISIBLE_DEVICES' order, which every step of the node sees alike;
# 0.. where Slurm set none): a trainer rank and its server take the same one.
rlctl_colocated_gpus() {{
  local first=$1 n=$2 all mine
  shift 2
  IFS=, read -r -a all <<<"${{CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $((first + n - 1)))}}"
  if ((${{#all[@]}} < first + n)); then
    echo "error: $(hostname) has ${{#all[@]}} GPU(s) of this job (${{all[*]}}), this task needs GPUs $first..$((first + n - 1)):" \
      "set slurm.trainer.gpus_per_node to the trainer ranks per node" >&2
    exit 1
  fi
  mine=$(IFS=,; echo "${{all[*]:first:n}}")
  echo "rlctl: $(hostname) runs this task on GPUs $mine (CUDA_VISIBLE_DEVICES; step $SLURM_JOB_ID.$SLURM_STEP_ID)"
  export CUDA_VISIBLE_DEVICES=$mine
  exec "$@"
}}
export -f rlctl_colocated_gpus
"""


def server_gpus(recipe: Recipe, bound: bool = True) -> int:
    """GPUs of each rollout server: SGLang's or vLLM's tp_size, 1 for a built-in server on cuda,
    else 0. bound=True: the GPUs it is bound to, where a CPU server on a component that asks for
    GPUs is bound to 1 as well (harmless, and how the test cluster observes the binding).
    Colocated, the component is the trainer's, whose GPUs the servers share."""
    asked = recipe.slurm.trainer.gpus_per_node if recipe.colocate.enabled else recipe.slurm.rollout.gpus_per_node
    return rollout_adapter(recipe.rollout.engine).server_gpus(recipe.rollout, bound and asked > 0)


def rank_gpus(recipe: Recipe) -> int:
    """GPUs per trainer rank, for its default CPUs: the node's GPUs shared by its ranks."""
    sl, per_node = recipe.slurm.trainer, recipe.train.ranks // recipe.slurm.trainer.nodes
    if sl.gpus_per_node:
        return max(1, sl.gpus_per_node // per_node)
    return int(trainer_adapter(recipe.train.engine).device(recipe.train) is Device.CUDA)


def task_cpus(cpus_per_task: int, gpus: int, threads: int) -> int:
    """slurm.*.cpus_per_task, or CPUS_PER_GPU per GPU of the task, or its torch threads without GPUs."""
    return cpus_per_task or (CPUS_PER_GPU * gpus if gpus else threads)


def node_mem(mem: str, gpus_per_node: int) -> str:
    """slurm.*.mem, or all of the node's memory (0) for a component with GPUs, or the cluster's default."""
    return mem or ("0" if gpus_per_node else "")


@dataclass(frozen=True)
class StepPlacement:
    """How the batch script places its steps: the shell functions it exports, and per kind of
    step the srun flags and the command that binds the task to its GPUs."""

    functions: str = ""
    server_flags: str = "--exact"
    server_bind: str = ""
    trainer_flags: str = "--het-group=0 "
    trainer_bind: str = ""
    server_group: str = "--het-group=1 "


def step_placement(recipe: Recipe) -> StepPlacement:
    gpus = server_gpus(recipe)
    if recipe.colocate.enabled:
        spn, tp = recipe.slurm.rollout.servers_per_node, max(1, gpus)
        bound = gpus > 0
        return StepPlacement(
            functions=_COLOCATED_GPUS.format() if bound else "", server_flags="--overlap", server_group="",
            server_bind=(f"bash -c 'rlctl_colocated_gpus \"$@\"' rlctl_colocated_gpus $(($1 % {spn} * {tp})) {tp} \\\n    "
                         if bound else ""),
            trainer_flags="--overlap ${TRAINER_MEM[@]+\"${TRAINER_MEM[@]}\"} ",
            trainer_bind=("bash -c 'rlctl_colocated_gpus \"$SLURM_LOCALID\" 1 \"$@\"' rlctl_colocated_gpus \\\n  "
                          if bound else ""))
    if not gpus:
        return StepPlacement()
    return StepPlacement(functions=_OWN_GPUS.format(), server_flags=f"--gres=gpu:{gpus} --exact",
                         server_bind=f"bash -c 'rlctl_own_gpus {gpus} \"$@\"' rlctl_own_gpus \\\n    ")
