"""The launch-time check that a Megatron trainer's micro-batch fits its GPU: the planner's memory
model (costs/memory.py, costs/activations.py) for the largest micro-batch the run can form,
refused in one line that names the key to change before any process starts.

The largest micro-batch: train.micro_batch_tokens of padded tokens, or one sample longer than that
alone (sim.prompt_tokens of prompt and rollout.sampling.max_new_tokens of response). The GPU:
sim.gpu's memory (h200 unless set), of which TRAINER_HEADROOM is counted as usable. Checked only
where the model's shape is known (model.init, or a config.json at model.path on this machine):
a size guessed from nothing would refuse runs on a guess.
"""

from __future__ import annotations

from rlctl.engines.train.adapter import trainer_adapter
from rlctl.costs.memory import GIB, MICRO_BATCH_PARTS, TRAINER_HEADROOM, TrainLayout, longest_sample, trainer_memory
from rlctl.recipe import Launcher, MegatronAttention, Recipe, Recompute

ACTIVATION_PARTS = MICRO_BATCH_PARTS


def micro_batch_problem(recipe: Recipe) -> tuple[str, str] | None:
    """(the key to change, why) when the Megatron trainer's largest micro-batch does not fit."""
    from rlctl.models.hf_config import read_config
    from rlctl.costs.shape import model_shape
    from rlctl.costs.model import HARDWARE

    train = recipe.train
    layers = trainer_adapter(train.engine).layer_config(train)  # the engine whose layers the planner was measured on
    if layers is None or recipe.launcher is Launcher.POOL:
        return None
    if recipe.model.init is None and not (recipe.model.path and read_config(recipe.model.path)):
        return None
    longest = longest_sample(recipe)
    tokens = max(train.micro_batch_tokens, longest)
    tp = layers.tp
    need = trainer_memory(recipe, model_shape(recipe), TrainLayout(tp=tp, dp=train.ranks // tp, micro_batch_tokens=tokens),
                          tokens)
    gpu = HARDWARE[recipe.sim.gpu]
    usable = gpu.hbm_bytes * TRAINER_HEADROOM
    if need.total <= usable:
        return None
    activations = sum(need.parts.get(k, 0.0) for k in ACTIVATION_PARTS)
    if activations >= need.total - activations:
        key = "rollout.sampling.max_new_tokens" if longest > train.micro_batch_tokens else "train.micro_batch_tokens"
        fixes = [f"lower {key}"]
        if layers.recompute_granularity is not Recompute.FULL:
            fixes.append("set train.megatron.recompute_granularity=full")
        if layers.attention is not MegatronAttention.SDPA:
            fixes.append("set train.megatron.attention=sdpa")
        fixes.append("raise train.megatron.tp")
    else:
        key, fixes = "train.megatron.tp", ["raise train.megatron.tp (the model's state does not fit one GPU)"]
    parts = ", ".join(f"{k} {v / GIB:.1f}" for k, v in sorted(need.parts.items(), key=lambda kv: -kv[1])[:3] if v)
    why = (f"a micro-batch of up to {tokens:,} tokens needs about {need.total / GIB:.1f} GiB per trainer GPU "
           f"({parts} GiB), more than {TRAINER_HEADROOM:.0%} of the {recipe.sim.gpu.value}'s "
           f"{gpu.hbm_bytes / GIB:.0f} GiB (sim.gpu); {', '.join(fixes[:-1]) + ' or ' + fixes[-1] if len(fixes) > 1 else fixes[0]}")
    return key, why
