"""The recipe keys that launch a planned placement: one heterogeneous Slurm job (launcher=slurm),
trainers in component 0 and rollout servers in component 1, each on whole nodes of
`per_node` GPUs (or part of one node when the side needs fewer); a colocated placement on one
GPU, a local run whose server and trainer take turns on it (colocate.enabled, docs/colocate.md).

The rest are a plan only, and say so instead of keys: colocated ones on more GPUs (each trainer
rank handing its own server the weights is not built) and pipeline-parallel trainers (the
Megatron trainer runs pp=1; rlctl/recipe/train.py).
"""

from __future__ import annotations

from rlctl.engines.train.adapter import trainer_adapter
from rlctl.planner.placement import Placement
from rlctl.engines.rollout.registry import rollout_adapter
from rlctl.errors import RecipeError
from rlctl.recipe import Recipe, SyncBackend, recipe_from_yaml, recipe_to_yaml


class NotLaunchable(Exception):
    """A placement rlctl can plan but not launch yet: why."""


def _side(gpus: int, per_node: int) -> tuple[int, int]:
    """(nodes, GPUs per node) for a side of the job: whole nodes, or part of one."""
    if gpus <= per_node:
        return 1, gpus
    if gpus % per_node:
        raise NotLaunchable(f"{gpus} GPUs are not whole nodes of {per_node}")
    return gpus // per_node, per_node


def launch_overrides(recipe: Recipe, p: Placement, running: int, per_node: int) -> list[str]:
    """KEY=VALUE overrides that make `rlctl launch RECIPE ...` run placement `p` on Slurm."""
    if p.colocated:
        return _colocated(recipe, p, running)
    if p.train_pp > 1:
        raise NotLaunchable("pipeline-parallel trainers are a plan: the Megatron trainer runs train.megatron.pp=1")
    ro, tr = recipe.rollout, recipe.train
    tp_key = rollout_adapter(ro.engine).tp_key()
    if tp_key is None and p.rollout_tp > 1:
        raise NotLaunchable(f"{rollout_adapter(ro.engine).title} runs on one GPU (rollout.engine=sglang or vllm for tp > 1)")
    t_nodes, t_gpus = _side(p.trainer_gpus, per_node)
    r_nodes, r_gpus = _side(p.rollout_gpus, per_node)
    keys = ["launcher=slurm", f"pipeline.mode={p.mode}", "train.device=cuda", "rollout.device=cuda",
            f"train.ranks={p.trainer_gpus}", f"train.micro_batch_tokens={p.micro_batch_tokens}",
            f"rollout.servers={p.servers}", f"rollout.max_running_requests={running}",
            f"slurm.trainer.nodes={t_nodes}", f"slurm.trainer.gpus_per_node={t_gpus}",
            f"slurm.rollout.nodes={r_nodes}", f"slurm.rollout.gpus_per_node={r_gpus}",
            f"slurm.rollout.servers_per_node={r_gpus // p.rollout_tp}"]
    train_tp_key = trainer_adapter(tr.engine).tp_key()
    if train_tp_key is not None:
        keys.append(f"{train_tp_key}={p.train_tp}")
    if tp_key is not None:
        keys.append(f"{tp_key}={p.rollout_tp}")
    if tr.sync_backend is SyncBackend.IPC:  # within one host only; the job spans nodes
        keys.append("train.sync_backend=nccl")
    keys += [f"{key}=[]" for key, given in (("train.cpus", tr.cpus), ("train.gpus", tr.gpus),
                                           ("rollout.cpus", ro.cpus), ("rollout.gpus", ro.gpus)) if given]
    try:  # what else a colocated run needs (the engine, its TP size) the recipe's own checks say
        recipe_from_yaml(recipe_to_yaml(recipe), "the plan's recipe", keys)
    except RecipeError as e:
        raise NotLaunchable(f"colocated: {e.key}: {e.message}") from None
    return keys


def _colocated(recipe: Recipe, p: Placement, running: int) -> list[str]:
    """A local run on one GPU whose built-in server and trainer rank take turns on it."""
    if p.rollout_gpus > 1:
        raise NotLaunchable(f"colocated on {p.rollout_gpus} GPUs is a plan: a colocated run takes turns on one GPU "
                            "for now (docs/colocate.md)")
    keys = ["launcher=local", "pipeline.mode=sync", "colocate.enabled=true", "train.device=cuda",
            "rollout.device=cuda", "train.ranks=1", "rollout.servers=1",
            f"train.micro_batch_tokens={p.micro_batch_tokens}", f"rollout.max_running_requests={running}"]
    if recipe.train.sync_backend not in (SyncBackend.AUTO, SyncBackend.IPC):  # NCCL refuses two ranks on one GPU
        keys.append("train.sync_backend=auto")
    ro, tr = recipe.rollout, recipe.train
    keys += [f"{key}=[]" for key, given in (("train.cpus", tr.cpus), ("train.gpus", tr.gpus),
                                           ("rollout.cpus", ro.cpus), ("rollout.gpus", ro.gpus)) if given]
    return keys
