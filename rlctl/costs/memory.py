"""What a placement holds on each GPU: the trainer's state and activations, a server's weights and
KV cache. Bytes per GPU, each part named, so a placement that does not fit says what overflows.

Trainer, per GPU of a tp x pp x dp layout (parameters split over tp x pp):
- torch engine (train.engine=torch): fp32 parameters, fp32 gradients and AdamW's two fp32 moments
  on every data-parallel rank (4 + 4 + 8 bytes per parameter, nothing sharded);
- megatron engine: parameters in train.megatron.dtype, fp32 gradients (DDP's main_grad) and the
  distributed optimizer's fp32 master copy (bf16 only) and moments, sharded over data parallel
  (2 + 4 + 12/dp bytes per parameter in bf16);
- the algorithm's extra models: a frozen KL reference (algo.kl_coef > 0), behaviour copies of
  the weights (PPO or algo.recompute_logprobs: one, or max_staleness + 1 in async), and PPO's
  critic with its own gradients, optimizer and copies;
- activations of one micro-batch, all of them alive at the end of its forward pass
  (ModelShape.activation_values_per_token, in the training dtype, split over tp; with 1F1B the
  first pipeline stage holds pp micro-batches of its 1/pp of the layers: the same total), and
  its fp32 logits (ModelShape.logits_values_per_token, split over tp); for the megatron engine,
  what train.megatron's attention and recompute keep instead (costs/activations.py);
- the optimizer step's temporaries, where they top the micro-batch's activations (freed by then):
  for the megatron engine one fp32 value per parameter it steps (Megatron-core's optimizer is
  torch's AdamW where Transformer Engine and Apex are absent, and its multi-tensor update holds
  the square roots of the second moments: a Qwen3-4B trainer that fits an H100 for its
  micro-batch runs out of it in its first step, results/gpu_long_samples-qwen3-4b.json).
Server, per GPU of a tp-way server: its weights in the serving dtype and the KV cache of the
requests it runs, split over tp; for the built-in server also its decode step's attention
working set (server_memory).

Not counted: the CUDA context, NCCL buffers, allocator fragmentation and cuBLAS workspaces (the
`fits` headroom is for them), and rollout-side activations (a decode step's are small).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from rlctl.engines.train.adapter import trainer_adapter
from rlctl.costs.activations import megatron_activations, megatron_logits
from rlctl.recipe import AlgoName, PipelineMode, Recipe
from rlctl.costs.model import DEFAULT_KV_DIM, CostModel, ModelShape

GIB = 1024**3
TRAINER_HEADROOM = 0.92
"""A trainer fits when its counted bytes are at most this share of the GPU's memory."""


MICRO_BATCH_PARTS = ("activations", "attention scores", "logits")
"""What one micro-batch holds, all of it freed before the optimizer steps."""

@dataclass(frozen=True)
class Breakdown:
    """Bytes per GPU, by part."""

    parts: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    def largest(self) -> str:
        return max(self.parts, key=lambda k: self.parts[k]) if self.parts else ""


@dataclass(frozen=True)
class TrainLayout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    micro_batch_tokens: int = 8192


def layout_of(cost: CostModel) -> TrainLayout:
    return TrainLayout(cost.train_tp, cost.train_pp, cost.train_dp, cost.micro_batch_tokens)


def train_tokens(recipe: Recipe) -> float:
    """Tokens one step trains on (prompt and response of every sample), on average."""
    from rlctl.costs.lengths import Lengths

    samples = recipe.rollout.batch_size * recipe.rollout.group_size
    return samples * (recipe.sim.prompt_tokens + Lengths.of(recipe).mean)


def behaviour_copies(recipe: Recipe) -> int:
    """Weight copies a trainer keeps for old log-probs and values (rlctl/engines/train/behaviour.py)."""
    algo = recipe.algo
    if not (algo.name is AlgoName.PPO or algo.recompute_logprobs):
        return 0
    return recipe.pipeline.max_staleness + 1 if recipe.pipeline.mode is PipelineMode.ASYNC else 1


def _train_bytes(recipe: Recipe) -> tuple[float, float, float, float]:
    """(parameter, gradient, optimizer-not-sharded, optimizer-sharded-over-dp) bytes per parameter,
    and the activation value width follows the parameter width."""
    return trainer_adapter(recipe.train.engine).param_bytes(recipe.train)


def micro_batch_tokens(recipe: Recipe, layout: TrainLayout, train_tokens: float) -> float:
    """Tokens in the largest micro-batch one rank runs: the cap, or a whole piece when smaller.
    A piece is a group when train batches stream in (rolloutpipe, async), else a train batch."""
    streamed = recipe.pipeline.mode is not PipelineMode.SYNC and recipe.pipeline.stream_train
    groups = 1 if streamed else recipe.train.groups_per_batch
    piece = train_tokens * groups / recipe.rollout.batch_size
    return min(float(layout.micro_batch_tokens), max(1.0, piece / layout.dp))


def longest_sample(recipe: Recipe) -> int:
    """Tokens of the longest sample the trainer may get: sim.prompt_tokens of prompt (the prompt
    length the planner prices) and rollout.sampling.max_new_tokens of response."""
    return recipe.sim.prompt_tokens + recipe.rollout.sampling.max_new_tokens


def trainer_memory(recipe: Recipe, shape: ModelShape, layout: TrainLayout, micro_tokens: float) -> Breakdown:
    """Bytes per trainer GPU (module docstring)."""
    param_b, grad_b, opt_full, opt_sharded = _train_bytes(recipe)
    shard = shape.params / (layout.tp * layout.pp)
    state = shard * (param_b + grad_b + opt_full + opt_sharded / layout.dp)
    parts = {"weights": shard * param_b, "gradients": shard * grad_b,
             "optimizer": shard * (opt_full + opt_sharded / layout.dp)}
    algo = recipe.algo
    parts["reference"] = shard * param_b if algo.kl_coef > 0 else 0.0
    copies = behaviour_copies(recipe)
    parts["behaviour copies"] = copies * shard * param_b
    parts["critic"] = state + copies * shard * param_b if algo.name is AlgoName.PPO else 0.0
    layers = trainer_adapter(recipe.train.engine).layer_config(recipe.train)
    if layers is not None:
        megatron = replace(layers, tp=layout.tp)
        parts.update(megatron_activations(megatron, shape, micro_tokens, param_b, longest_sample(recipe)))
        parts["logits"] = megatron_logits(shape, micro_tokens, layout.tp)
    else:
        parts["activations"] = shape.activation_values_per_token() * micro_tokens * param_b / layout.tp
        parts["logits"] = shape.logits_values_per_token() * micro_tokens * 4 / layout.tp
    temporaries = trainer_adapter(recipe.train.engine).step_bytes(recipe.train) * shard / layout.dp
    parts["optimizer step"] = max(0.0, temporaries - sum(parts.get(k, 0.0) for k in MICRO_BATCH_PARTS))
    return Breakdown(parts)


def server_memory(cost: CostModel, running: int, expands_kv: bool = False) -> Breakdown:
    """Bytes per GPU of one server running `running` requests of the cost model's mean context.
    `expands_kv`: the engine's attention repeats a layer's keys and values to every query head
    (transformers' repeat_kv: the built-in server) and grows the layer's cache by a copy, so a
    decode step also holds one layer's keys and values at the query width and one at its own."""
    tp = cost.gpus_per_server
    m = cost.model
    tokens = running * cost.mean_context_tokens
    parts = {"weights": m.weight_bytes / tp, "kv cache": tokens * m.kv_bytes_per_token / tp}
    if expands_kv:
        per_layer = m.kv_bytes_per_token / m.n_layers
        widen = (m.q_dim or m.d_hidden) / (m.kv_dim or DEFAULT_KV_DIM)
        parts["attention"] = tokens * per_layer * (widen + 1) / tp
    return Breakdown(parts)


def running_batch(cost: CostModel, max_running: int, kv_budget: float | None = None) -> int:
    """Requests a server runs at once: max_running, or fewer when their KV cache does not fit in
    `kv_budget` bytes per GPU (default: memory_fraction of the GPU less the weights)."""
    tp = cost.gpus_per_server
    if kv_budget is None:
        kv_budget = cost.hardware.hbm_bytes * cost.memory_fraction - cost.model.weight_bytes / tp
    per_request = cost.mean_context_tokens * cost.model.kv_bytes_per_token / tp
    return max(0, min(max_running, int(kv_budget / per_request)))


def colocated_budget(cost: CostModel, trainer: Breakdown, max_running: int) -> tuple[int, float]:
    """Colocated (rollout and training take turns on every GPU): the running batch the servers
    get beside the trainer's resident state, and the bytes of that state swapped to host memory
    for it. The gradients and optimizer state leave when otherwise fewer than max_running
    requests would fit; activations and logits are gone between steps."""
    hbm = cost.hardware.hbm_bytes * cost.memory_fraction
    resident = trainer.total - trainer.parts.get("activations", 0.0) - trainer.parts.get("logits", 0.0)
    weights = cost.model.weight_bytes / cost.gpus_per_server
    running = running_batch(cost, max_running, hbm - weights - resident)
    if running >= max_running:
        return running, 0.0
    swap = trainer.parts.get("gradients", 0.0) + trainer.parts.get("optimizer", 0.0)
    swapped = running_batch(cost, max_running, hbm - weights - resident + swap)
    return (swapped, swap) if swapped > running else (running, 0.0)
