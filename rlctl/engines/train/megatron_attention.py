"""The Megatron trainer's core attention (`train.megatron.attention: sdpa`): torch's
scaled_dot_product_attention in the place of Megatron-core's unfused DotProductAttention.

Megatron-core's local layer spec computes attention as two batched matmuls around a softmax, and
autograd keeps the S x S probabilities of every layer for the backward pass (about 6 bytes per
head and score pair: the fp32 softmax and its bf16 copy): a 1.7B model runs out of a 141 GB GPU
at 8k tokens. A flash or memory-efficient kernel keeps only the output and one log-sum-exp per
row, and recomputes the scores blockwise in its backward.

The module is held to Megatron-core's own interface, as 0.19.2 declares and calls it
(megatron/core/transformer/attention.py; tests/test_megatron_attention.py reads that source):
- built by SelfAttention as `core_attention(config=, layer_number=, attn_mask_type=,
  attention_type=, cp_comm_type=, softmax_scale=, pg_collection=)`, with num_query_groups raised
  to the TP size where it is smaller (the config it gets says so);
- called as `forward(query, key, value, attention_mask, attn_mask_type=, attention_bias=,
  packed_seq_params=)` with query [sq, b, heads/tp, head_dim] and key, value [sk, b,
  groups/tp, head_dim], and returns [sq, b, heads/tp * head_dim];
- a mask, when given, is True where attention is not allowed (Megatron's attention_mask_func
  fills those scores); without one, a causal attn_mask_type means the causal mask (what
  Megatron's softmax builds); query heads share key/value groups in blocks of heads/groups
  (Megatron's repeat_interleave; torch's enable_gqa does the same).
It refuses what it does not compute (context parallelism, packed sequences, attention biases,
sliding windows, softmax offsets, query-key layer scaling, attention dropout) at construction or
call, so a config that needs them fails at once instead of training something else.

On CUDA the kernels are restricted to flash, memory-efficient and cuDNN attention: where none of
them takes the call the module repeats the key/value groups to every query head and asks again
(still no S x S scores), and where that fails too it raises, instead of torch falling back to the
math kernel, which materializes the scores.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from rlctl.errors import RunError

FAST_KERNELS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION")
"""torch.nn.attention.SDPBackend members the module lets run on CUDA (never MATH)."""


def tp_size_of(pg_collection: Any) -> int:
    """The tensor-parallel size: from the process groups SelfAttention hands down (0.19.2 always
    passes them), else from Megatron's global state (older releases)."""
    if pg_collection is not None and getattr(pg_collection, "tp", None) is not None:
        return pg_collection.tp.size()
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_world_size()


def _name(value: Any) -> str:
    """An enum member's name (Megatron's AttnMaskType), or the value itself as text."""
    return getattr(value, "name", str(value))


class SdpaAttention(torch.nn.Module):
    """Megatron-core's core attention through torch.nn.functional.scaled_dot_product_attention
    (module docstring). No parameters, so no weights change names: a checkpoint or HF mapping
    of the local spec is the same with either attention."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection: Any = None) -> None:
        super().__init__()
        _refuse_config(config, attention_dropout)
        tp = tp_size_of(pg_collection)
        heads, groups = config.num_attention_heads, config.num_query_groups
        if heads % tp or groups % tp:
            raise RunError(f"{heads} attention heads and {groups} key/value groups do not split over {tp} TP ranks; "
                           "set train.megatron.tp to a divisor of both")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.heads_per_partition = heads // tp
        self.groups_per_partition = groups // tp
        self.head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        self.expand_kv = False  # set once the fast kernels refuse grouped keys and values

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
                attn_mask_type: Any = None, attention_bias: torch.Tensor | None = None,
                packed_seq_params: Any = None) -> torch.Tensor:
        if packed_seq_params is not None:
            raise RunError("train.megatron.attention=sdpa: packed sequences (THD) are not supported; the trainer pads")
        if attention_bias is not None:
            raise RunError("train.megatron.attention=sdpa: attention biases are not supported")
        sq, b = query.shape[0], query.shape[1]
        if query.shape[2] != self.heads_per_partition or key.shape[2] != self.groups_per_partition:
            raise RunError(f"core attention: query {tuple(query.shape)} and key {tuple(key.shape)} do not have "
                           f"{self.heads_per_partition} heads and {self.groups_per_partition} groups per partition")
        causal = _name(attn_mask_type if attn_mask_type is not None else self.attn_mask_type) == "causal"
        mask = None
        if attention_mask is not None:  # Megatron's True = masked out; torch's True = attended
            mask, causal = ~attention_mask.bool(), False
        # [s, b, n, d] -> [b, n, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        out = self._attend(q, k, v, mask, causal)
        # [b, n, sq, d] -> [sq, b, n * d]
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.heads_per_partition * self.head_dim)

    def _attend(self, q, k, v, mask, causal: bool) -> torch.Tensor:
        grouped = self.heads_per_partition != self.groups_per_partition
        if not q.is_cuda:  # CPU (tests): torch picks its kernel
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=self.softmax_scale,
                                                  enable_gqa=grouped)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        kernels = [getattr(SDPBackend, name) for name in FAST_KERNELS if hasattr(SDPBackend, name)]
        with sdpa_kernel(kernels):
            if grouped and not self.expand_kv:
                try:
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                                          scale=self.softmax_scale, enable_gqa=True)
                except RuntimeError:
                    self.expand_kv = True  # no fast kernel takes grouped heads here: repeat them
            if grouped:
                rep = self.heads_per_partition // self.groups_per_partition
                k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=self.softmax_scale)


def _refuse_config(config: Any, attention_dropout: float | None) -> None:
    """What SdpaAttention does not compute, named by the TransformerConfig field that asks for it."""
    problems = []
    if getattr(config, "context_parallel_size", 1) != 1:
        problems.append("context_parallel_size > 1")
    if getattr(config, "apply_query_key_layer_scaling", False):
        problems.append("apply_query_key_layer_scaling")
    if getattr(config, "window_size", None) is not None:
        problems.append("window_size (sliding-window attention)")
    if getattr(config, "softmax_type", "vanilla") != "vanilla":
        problems.append(f"softmax_type={config.softmax_type}")
    dropout = config.attention_dropout if attention_dropout is None else attention_dropout
    if dropout:
        problems.append(f"attention_dropout={dropout}")
    if problems:
        raise RunError(f"train.megatron.attention=sdpa does not support {', '.join(problems)}; "
                       "use train.megatron.attention=local")


def core_attention_module(name: str) -> type | None:
    """The core-attention class for train.megatron.attention (None: keep the layer spec's own)."""
    return SdpaAttention if name == "sdpa" else None
