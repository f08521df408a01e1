"""How the Megatron trainer's transformer layers are built for long samples: the layer spec with
train.megatron.attention's core attention, and train.megatron's recompute keys in Megatron-core's
own TransformerConfig fields (recompute_granularity, recompute_method, recompute_num_layers).

Transformer Engine is not used, installed or not: rlctl builds Megatron-core's local layer spec,
whose parameter names rlctl/engines/train/megatron_convert.py maps to and from HF (TE's spec
folds the norms into its linears, under other names). `transformer_engine_note()` says so in the
trainer's log where TE is importable.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from rlctl.errors import RunError
from rlctl.recipe import MegatronAttention, MegatronConfig, Recompute


def recompute_options(cfg: MegatronConfig, num_layers: int) -> dict[str, Any]:
    """TransformerConfig's recompute fields for train.megatron (Megatron-core's validation: full
    needs a method and 1..num_layers layers; selective takes neither)."""
    if cfg.recompute_granularity is Recompute.NONE:
        return {"recompute_granularity": None}
    if cfg.recompute_granularity is Recompute.SELECTIVE:
        return {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}
    if not 1 <= cfg.recompute_num_layers <= num_layers:
        raise RunError(f"train.megatron.recompute_num_layers={cfg.recompute_num_layers}: the model has {num_layers} "
                       f"layers; set it between 1 and {num_layers}")
    return {"recompute_granularity": "full", "recompute_method": cfg.recompute_method.value,
            "recompute_num_layers": cfg.recompute_num_layers}


def layer_spec(qk_norm: bool, attention: MegatronAttention):
    """Megatron-core's local GPT layer spec (RMSNorm), its core attention replaced for sdpa."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from rlctl.engines.train.megatron_attention import SdpaAttention

    spec = get_gpt_layer_local_spec(qk_layernorm=qk_norm, normalization="RMSNorm")
    if attention is MegatronAttention.SDPA:
        spec.submodules.self_attention.submodules.core_attention = SdpaAttention
    return spec


def transformer_engine_note(attention: MegatronAttention) -> str:
    """One log line where Transformer Engine is installed ('' where it is not)."""
    if importlib.util.find_spec("transformer_engine") is None:
        return ""
    return (f"Transformer Engine is installed but not used: the trainer builds Megatron-core's local layer spec "
            f"with attention={attention.value} (rlctl/engines/train/megatron_layers.py)")
