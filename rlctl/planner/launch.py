"""The recipe keys that launch a planned placement: one heterogeneous Slurm job (launcher=slurm),
trainers in component 0 and rollout servers in component 1, each on whole nodes of
`per_node` GPUs (or part of one node when the side needs fewer). A colocated placement
(colocate.enabled, docs/colocate.md) on one GPU is a local run whose server and trainer take
turns on it; on more, one Slurm job whose every GPU holds a trainer rank and a server TP rank.

The rest are a plan only, and say so instead of keys: pipeline-parallel trainers (the Megatron
trainer runs pp=1; rlctl/recipe/train.py), and what the recipe's own checks refuse.
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
    if p.train_pp > 1:
        raise NotLaunchable("pipeline-parallel trainers are a plan: the Megatron trainer runs train.megatron.pp=1")
    ro = recipe.rollout
    tp_key = rollout_adapter(ro.engine).tp_key()
    if tp_key is None and p.rollout_tp > 1:
        raise NotLaunchable(f"{rollout_adapter(ro.engine).title} runs on one GPU (rollout.engine=sglang or vllm for tp > 1)")
    if p.colocated:
        keys = _colocated(recipe, p, per_node)
    else:
        t_nodes, t_gpus = _side(p.trainer_gpus, per_node)
        r_nodes, r_gpus = _side(p.rollout_gpus, per_node)
        keys = ["launcher=slurm", f"pipeline.mode={p.mode}", f"slurm.trainer.nodes={t_nodes}",
                f"slurm.trainer.gpus_per_node={t_gpus}", f"slurm.rollout.nodes={r_nodes}",
                f"slurm.rollout.gpus_per_node={r_gpus}", f"slurm.rollout.servers_per_node={r_gpus // p.rollout_tp}"]
        if recipe.train.sync_backend is SyncBackend.IPC:  # within one host only; the job spans nodes
            keys.append("train.sync_backend=nccl")
    keys += ["train.device=cuda", "rollout.device=cuda", f"train.ranks={p.trainer_gpus}",
             f"train.micro_batch_tokens={p.micro_batch_tokens}", f"rollout.servers={p.servers}",
             f"rollout.max_running_requests={running}"]
    train_tp_key = trainer_adapter(recipe.train.engine).tp_key()
    if train_tp_key is not None and p.gpus > 1:
        keys.append(f"{train_tp_key}={p.train_tp}")
    if tp_key is not None and p.gpus > 1:
        keys.append(f"{tp_key}={p.rollout_tp}")
    keys += [f"{key}=[]" for key, given in (("train.cpus", recipe.train.cpus), ("train.gpus", recipe.train.gpus),
                                           ("rollout.cpus", ro.cpus), ("rollout.gpus", ro.gpus)) if given]
    try:  # what else the run needs (the engine, its TP size) the recipe's own checks say
        recipe_from_yaml(recipe_to_yaml(recipe), "the plan's recipe", keys)
    except RecipeError as e:
        raise NotLaunchable(f"{'colocated: ' if p.colocated else ''}{e.key}: {e.message}") from None
    return keys


def _colocated(recipe: Recipe, p: Placement, per_node: int) -> list[str]:
    """Taking turns: on one GPU a local run, on more one Slurm job of whole nodes (or part of
    one) whose every GPU holds a trainer rank and a server TP rank."""
    keys = ["pipeline.mode=sync", "colocate.enabled=true"]
    if recipe.train.sync_backend not in (SyncBackend.AUTO, SyncBackend.IPC):  # NCCL refuses two ranks on one GPU
        keys.append("train.sync_backend=auto")
    if p.gpus == 1:
        return ["launcher=local", *keys]
    nodes, gpus = _side(p.gpus, per_node)
    return ["launcher=slurm", *keys, f"slurm.trainer.nodes={nodes}", f"slurm.trainer.gpus_per_node={gpus}",
            "slurm.rollout.nodes=0", "slurm.rollout.gpus_per_node=0", f"slurm.rollout.servers_per_node={gpus // p.rollout_tp}"]
