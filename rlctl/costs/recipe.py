"""A recipe's cost model (rlctl.costs.model.CostModel): the one `rlctl simulate` runs its simulated
engines on and `rlctl plan` predicts from, so that the two differ only in how they schedule.

The `sim:` section says the hardware, the GPU counts and layouts and the efficiency knobs; the
rest of the recipe says the model (costs/shape.py), the micro-batch size and the algorithm's
extra passes (a forward of the KL reference model when algo.kl_coef > 0, one of the behaviour
weights when old log-probs are recomputed, PPO's critic), and the mean context of a running
request when sim.context_tokens is 0. Colocated, the state swapped to host
memory is what does not fit beside the servers (memory.colocated_budget).
"""

from __future__ import annotations

from rlctl.engines.rollout.registry import rollout_adapter
from rlctl.recipe import Recipe
from rlctl.costs.model import HARDWARE, CostModel, algo_passes


def _mean_context(recipe: Recipe) -> int:
    """The prompt and what a running response has produced so far, on average: its age, which in
    a continuous batch is length-biased (E[L^2] / 2 E[L], costs/lengths.py's residual mean)."""
    from rlctl.costs.lengths import Lengths

    return max(1, round(recipe.sim.prompt_tokens + Lengths.of(recipe).residual_mean))


def _memory_fraction(recipe: Recipe) -> float:
    """The share of a GPU a server takes for weights and KV cache: the engine's own setting."""
    fraction = rollout_adapter(recipe.rollout.engine).memory_fraction(recipe.rollout)
    return CostModel.memory_fraction if fraction is None else fraction


def cost_model(recipe: Recipe) -> CostModel:
    from rlctl.costs.shape import model_shape

    sim = recipe.sim
    passes, critic = algo_passes(recipe)
    cost = CostModel(
        HARDWARE[sim.gpu], model_shape(recipe),
        mfu_train=sim.mfu_train, mean_context_tokens=sim.context_tokens or _mean_context(recipe),
        mfu_prefill=sim.mfu_prefill, decode_bw_efficiency=sim.decode_bw_efficiency, gpus_per_server=sim.tp,
        trainer_gpus=sim.trainer_gpus, decode_step_overhead_s=sim.decode_step_overhead_s,
        train_step_overhead_s=sim.train_step_overhead_s, train_tp=sim.train_tp, train_pp=sim.train_pp,
        micro_batch_tokens=recipe.train.micro_batch_tokens, layer_launch_s=sim.layer_launch_s,
        forward_passes=passes, critic=critic, colocated=sim.colocated, memory_fraction=_memory_fraction(recipe),
    )
    if sim.colocated:
        from dataclasses import replace

        from rlctl.costs.memory import colocated_budget, layout_of, micro_batch_tokens, train_tokens, trainer_memory

        layout = layout_of(cost)
        trainer = trainer_memory(recipe, cost.model, layout, micro_batch_tokens(recipe, layout, train_tokens(recipe)))
        _, swap = colocated_budget(cost, trainer, recipe.rollout.max_running_requests)
        cost = replace(cost, swap_bytes=swap)
    return cost
