"""A Megatron trainer's activation memory for one micro-batch, under train.megatron's attention
and recompute keys (rlctl/engines/train/megatron_layers.py), per GPU, in bytes.

Per token, one layer keeps A = ModelShape.activation_values_per_token() / layers values for its
backward pass (the training dtype), and the layer input is `hidden` values. With S the micro-batch's
padded sequence length (at most the longest sample; the whole micro-batch when not known):
- attention=local also keeps the S x S probabilities of every head: heads x S values per token,
  LOCAL_SCORE_BYTES each, and the layer whose attention runs its backward LOCAL_BACKWARD_SCORE_BYTES;
  attention=sdpa keeps none (flash and memory-efficient kernels);
- recompute none: every layer's A (and scores);
- recompute full, uniform with n layers a unit: the input of each unit (layers / n of them), and
  during the backward of a unit its n layers' A (and scores) again;
- recompute full, block with n layers: the first n layers keep their input only, the rest keep
  A; one recomputed layer's A in its backward;
- recompute selective (core attention): every layer's A, scores only of the layer whose
  attention is recomputed.
All of it split over train.megatron.tp (Megatron's tensor parallelism splits heads and the MLP;
the layer inputs are replicated without sequence parallelism, and counted whole).

The fp32 logits: MEGATRON_LOGITS_BYTES per vocabulary entry and token (the fp32 copy of the
logits and the vocab-parallel cross entropy's softmax, which it keeps for the backward pass).

scripts/gpu_long_samples.py measures these against the trainer on a GPU
(results/gpu_long_samples.json).
"""

from __future__ import annotations

from rlctl.recipe import MegatronAttention, MegatronConfig, Recompute, RecomputeMethod
from rlctl.costs.model import ModelShape

MEGATRON_LAYER_FACTOR = 1.4
"""Megatron's local layer keeps more per token than ModelShape counts for a transformers layer
(the fused QKV output, the q/k norms' inputs and outputs, the rope outputs): 68k values per token
in a Qwen3-1.7B layer measured against 49k counted (results/gpu_long_samples.json, sdpa/none)."""
LOCAL_SCORE_BYTES = 6.5
"""Bytes per attention score Megatron's unfused attention keeps for the backward pass: the fp32
probabilities (4) and their bf16 copy (2); 6.5 measured (local/none)."""
LOCAL_BACKWARD_SCORE_BYTES = 15.0
"""Bytes per score of the one layer whose attention runs its backward (or is recomputed for it):
the kept 6.5, the bf16 scores buffer Megatron reuses (2) and the softmax backward's gradients;
15 measured (local/full at 16k)."""
MEGATRON_LOGITS_BYTES = 6.0
"""Bytes per logit and token at the loss' peak: the bf16 logits and their fp32 copy in the
forward pass, the kept fp32 softmax and the bf16 gradient in the backward (measured: sdpa/full)."""


def megatron_activations(cfg: MegatronConfig, shape: ModelShape, tokens: float, value_bytes: float,
                         seq_len: float | None = None) -> dict[str, float]:
    """{"activations": bytes, "attention scores": bytes} per GPU for a micro-batch of `tokens`
    padded to sequences of `seq_len` (None: one sequence of all of them)."""
    layers = max(1, round(shape.n_layers))
    per_layer = (MEGATRON_LAYER_FACTOR * shape.activation_values_per_token() / shape.n_layers * tokens * value_bytes
                 / cfg.tp)
    layer_input = shape.d_hidden * tokens * value_bytes
    seq = min(seq_len or tokens, tokens)
    pairs = 0.0 if cfg.attention is MegatronAttention.SDPA else shape.n_heads * tokens * seq / cfg.tp
    kept_scores, backward_scores = pairs * LOCAL_SCORE_BYTES, pairs * LOCAL_BACKWARD_SCORE_BYTES
    n = min(cfg.recompute_num_layers, layers)
    if cfg.recompute_granularity is Recompute.NONE:
        kept, scores = layers * per_layer, (layers - 1) * kept_scores + backward_scores
    elif cfg.recompute_granularity is Recompute.SELECTIVE:
        kept, scores = layers * per_layer, backward_scores
    elif cfg.recompute_method is RecomputeMethod.UNIFORM:
        kept, scores = -(-layers // n) * layer_input + n * per_layer, (n - 1) * kept_scores + backward_scores
    else:  # block
        kept = n * layer_input + (layers - n) * per_layer + per_layer
        scores = (layers - n) * kept_scores + backward_scores
    return {"activations": kept, "attention scores": scores}


def megatron_logits(shape: ModelShape, tokens: float, tp: int) -> float:
    return shape.n_vocab * tokens * MEGATRON_LOGITS_BYTES / tp
