"""Hugging Face <-> Megatron-core weights for the Qwen3 / Llama family (local layer spec).

Pure tensor code (torch only, no megatron import), so it is tested on CPU:

    HF                                         Megatron-core (local spec)
    model.embed_tokens.weight                  embedding.word_embeddings.weight
    model.layers.N.input_layernorm.weight      decoder.layers.N.input_layernorm.weight
    model.layers.N.self_attn.{q,k,v}_proj      decoder.layers.N.self_attention.linear_qkv.weight
    model.layers.N.self_attn.o_proj            decoder.layers.N.self_attention.linear_proj.weight
    model.layers.N.self_attn.{q,k}_norm        decoder.layers.N.self_attention.{q,k}_layernorm.weight
    model.layers.N.post_attention_layernorm    decoder.layers.N.pre_mlp_layernorm.weight
    model.layers.N.mlp.{gate,up}_proj          decoder.layers.N.mlp.linear_fc1.weight
    model.layers.N.mlp.down_proj               decoder.layers.N.mlp.linear_fc2.weight
    model.norm.weight                          decoder.final_layernorm.weight
    lm_head.weight                             output_layer.weight (absent when tied)

linear_qkv is grouped per KV head: for each query group g, its q heads, then k_g, then v_g, each
head_dim rows. linear_fc1 is cat(gate, up). With tensor parallelism, column-parallel weights
(embedding, output layer, qkv, fc1) are split on dim 0 and row-parallel ones (linear_proj, fc2)
on dim 1; fc1's shard i is [gate_i; up_i], and qkv splits cleanly because every shard holds
whole query groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Layout:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    ffn_hidden_size: int
    vocab_size: int
    qk_norm: bool
    tied: bool

    @classmethod
    def from_hf_config(cls, cfg: Any) -> Layout:
        if getattr(cfg, "model_type", "") not in ("qwen3", "llama", "qwen2"):
            raise ValueError(f"train.engine=megatron maps Qwen3/Qwen2/Llama weights; this model is {cfg.model_type!r}")
        heads = cfg.num_attention_heads
        return cls(
            num_layers=cfg.num_hidden_layers, num_heads=heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.intermediate_size, vocab_size=cfg.vocab_size,
            qk_norm=cfg.model_type == "qwen3", tied=bool(getattr(cfg, "tie_word_embeddings", False)),
        )


def _layer_pairs(i: int, layout: Layout) -> list[tuple[str, str]]:
    """(HF name, Megatron name) of the one-to-one tensors of layer i."""
    hf, mc = f"model.layers.{i}.", f"decoder.layers.{i}."
    pairs = [
        (hf + "input_layernorm.weight", mc + "input_layernorm.weight"),
        (hf + "self_attn.o_proj.weight", mc + "self_attention.linear_proj.weight"),
        (hf + "post_attention_layernorm.weight", mc + "pre_mlp_layernorm.weight"),
        (hf + "mlp.down_proj.weight", mc + "mlp.linear_fc2.weight"),
    ]
    if layout.qk_norm:
        pairs += [(hf + "self_attn.q_norm.weight", mc + "self_attention.q_layernorm.weight"),
                  (hf + "self_attn.k_norm.weight", mc + "self_attention.k_layernorm.weight")]
    return pairs


def hf_to_mcore(hf: dict[str, torch.Tensor], layout: Layout) -> dict[str, torch.Tensor]:
    """Full (unsharded) Megatron tensors from HF tensors."""
    L = layout
    out = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
           "decoder.final_layernorm.weight": hf["model.norm.weight"]}
    if not L.tied:
        out["output_layer.weight"] = hf["lm_head.weight"]
    q_per_group = L.num_heads // L.num_kv_heads
    for i in range(L.num_layers):
        for hf_name, mc_name in _layer_pairs(i, L):
            out[mc_name] = hf[hf_name]
        p = f"model.layers.{i}.self_attn."
        q = hf[p + "q_proj.weight"].view(L.num_kv_heads, q_per_group * L.head_dim, L.hidden_size)
        k = hf[p + "k_proj.weight"].view(L.num_kv_heads, L.head_dim, L.hidden_size)
        v = hf[p + "v_proj.weight"].view(L.num_kv_heads, L.head_dim, L.hidden_size)
        out[f"decoder.layers.{i}.self_attention.linear_qkv.weight"] = torch.cat([q, k, v], dim=1).reshape(-1, L.hidden_size)
        m = f"model.layers.{i}.mlp."
        out[f"decoder.layers.{i}.mlp.linear_fc1.weight"] = torch.cat([hf[m + "gate_proj.weight"], hf[m + "up_proj.weight"]])
    return out


def mcore_to_hf(mc: dict[str, torch.Tensor], layout: Layout) -> list[tuple[str, torch.Tensor]]:
    """HF-named tensors from full Megatron tensors, in the order of transformers' named_parameters()."""
    L = layout
    out = [("model.embed_tokens.weight", mc["embedding.word_embeddings.weight"])]
    q_per_group = L.num_heads // L.num_kv_heads
    for i in range(L.num_layers):
        one_to_one = dict((h, mc[m]) for h, m in _layer_pairs(i, L))
        qkv = mc[f"decoder.layers.{i}.self_attention.linear_qkv.weight"].view(
            L.num_kv_heads, (q_per_group + 2) * L.head_dim, L.hidden_size)
        q, k, v = torch.split(qkv, [q_per_group * L.head_dim, L.head_dim, L.head_dim], dim=1)
        gate, up = torch.chunk(mc[f"decoder.layers.{i}.mlp.linear_fc1.weight"], 2, dim=0)
        p = f"model.layers.{i}."
        named = {
            p + "self_attn.q_proj.weight": q.reshape(-1, L.hidden_size),
            p + "self_attn.k_proj.weight": k.reshape(-1, L.hidden_size),
            p + "self_attn.v_proj.weight": v.reshape(-1, L.hidden_size),
            p + "mlp.gate_proj.weight": gate,
            p + "mlp.up_proj.weight": up,
            **one_to_one,
        }
        order = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
                 "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                 "input_layernorm.weight", "post_attention_layernorm.weight"]  # transformers' own order
        out += [(p + n, named[p + n]) for n in order if p + n in named]
    out.append(("model.norm.weight", mc["decoder.final_layernorm.weight"]))
    if not L.tied:
        out.append(("lm_head.weight", mc["output_layer.weight"]))
    return out


# -- tensor parallelism ---------------------------------------------------------------------------

def tp_dim(name: str) -> int | None:
    """The dim a Megatron tensor is split on across TP ranks (None: replicated)."""
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return 1
    if name.endswith(("word_embeddings.weight", "output_layer.weight", "linear_qkv.weight", "linear_fc1.weight")):
        return 0
    return None


def shard(name: str, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This TP rank's part of a full Megatron tensor."""
    dim = tp_dim(name)
    if dim is None or tp_size == 1:
        return full
    if full.shape[dim] % tp_size:
        raise ValueError(f"{name}: dim {dim} of size {full.shape[dim]} does not split over {tp_size} TP ranks")
    if name.endswith("linear_fc1.weight"):
        gate, up = torch.chunk(full, 2, dim=0)
        return torch.cat([torch.chunk(gate, tp_size)[tp_rank], torch.chunk(up, tp_size)[tp_rank]])
    return torch.chunk(full, tp_size, dim=dim)[tp_rank].contiguous()


def gather(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """The full Megatron tensor from every TP rank's part (in rank order)."""
    dim = tp_dim(name)
    if dim is None or len(shards) == 1:
        return shards[0]
    if name.endswith("linear_fc1.weight"):
        halves = [torch.chunk(s, 2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(shards, dim=dim)
