"""Hugging Face <-> Megatron-core weights for Qwen3, Qwen2 and Llama (local layer spec).

Pure tensor code (torch only, no megatron import), so it is tested on CPU:

    HF                                         Megatron-core (local spec)
    model.embed_tokens.weight                  embedding.word_embeddings.weight
    model.layers.N.input_layernorm.weight      decoder.layers.N.input_layernorm.weight
    model.layers.N.self_attn.{q,k,v}_proj.weight  decoder.layers.N.self_attention.linear_qkv.weight
    model.layers.N.self_attn.{q,k,v}_proj.bias    decoder.layers.N.self_attention.linear_qkv.bias (Qwen2)
    model.layers.N.self_attn.o_proj            decoder.layers.N.self_attention.linear_proj.weight
    model.layers.N.self_attn.{q,k}_norm        decoder.layers.N.self_attention.{q,k}_layernorm.weight (Qwen3)
    model.layers.N.post_attention_layernorm    decoder.layers.N.pre_mlp_layernorm.weight
    model.layers.N.mlp.{gate,up}_proj          decoder.layers.N.mlp.linear_fc1.weight
    model.layers.N.mlp.down_proj               decoder.layers.N.mlp.linear_fc2.weight
    model.norm.weight                          decoder.final_layernorm.weight
    lm_head.weight                             output_layer.weight (absent when tied)

linear_qkv is grouped per KV head: for each query group g, its q heads, then k_g, then v_g, each
head_dim rows. Qwen2's q/k/v biases (TransformerConfig.add_qkv_bias) fuse the same way into
linear_qkv.bias: per group g, q_bias of its heads, k_bias_g, v_bias_g, head_dim entries each, so
that row r of the bias belongs to row r of the weight. linear_fc1 is cat(gate, up).

With tensor parallelism, column-parallel tensors (embedding, output layer, qkv weight and bias,
fc1) are split on dim 0 and row-parallel ones (linear_proj, fc2) on dim 1; fc1's shard i is
[gate_i; up_i]. qkv splits into contiguous row blocks, Megatron's own partition: whole query
groups when tp divides the KV heads.

Both directions are strict: an HF tensor the mapping does not use, one it needs and lacks, one of
the wrong shape, or a Megatron tensor left over or missing is an error naming the tensors. Two
HF tensors are allowed without being used: `*.rotary_emb.inv_freq` (a buffer older checkpoints
saved; computed from the config) and, when the embeddings are tied, an `lm_head.weight` equal to
`model.embed_tokens.weight`. Architecture features the local spec cannot express (an o_proj or
MLP bias, sliding-window attention, rope scaling, an activation other than SiLU) are refused by
Layout.from_hf_config with one line saying what.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from rlctl.errors import RunError

FAMILIES = ("qwen3", "qwen2", "llama")
IGNORED_HF_SUFFIXES = (".rotary_emb.inv_freq",)


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
    qkv_bias: bool = False
    model_type: str = "qwen3"

    @classmethod
    def from_hf_config(cls, cfg: Any) -> Layout:
        model_type = getattr(cfg, "model_type", "")
        if model_type not in FAMILIES:
            raise RunError(f"train.engine=megatron maps Qwen3/Qwen2/Llama weights; this model is {model_type!r}")
        unsupported = unsupported_features(cfg)
        if unsupported:
            raise RunError(f"train.engine=megatron cannot train this {model_type} model: {'; '.join(unsupported)}")
        heads = cfg.num_attention_heads
        return cls(
            num_layers=cfg.num_hidden_layers, num_heads=heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.intermediate_size, vocab_size=cfg.vocab_size,
            qk_norm=model_type == "qwen3", tied=bool(getattr(cfg, "tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2", model_type=model_type,
        )


def unsupported_features(cfg: Any) -> list[str]:
    """What in this HF config the Megatron model (local spec, no biases but Qwen2's q/k/v) would
    compute differently from the HF model; empty when it is supported."""
    out = []
    act = getattr(cfg, "hidden_act", "silu")
    if act != "silu":
        out.append(f"hidden_act {act!r} (only silu: SwiGLU)")
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        out.append(f"rope_type {rope_type!r} (only plain rope; rope scaling is not mapped)")
    window = getattr(cfg, "sliding_window", None)
    if window and window < cfg.max_position_embeddings:  # a window as long as any sequence is full attention
        types = getattr(cfg, "layer_types", None)
        sliding = [i for i, t in enumerate(types or []) if t != "full_attention"]
        if sliding or (types is None and getattr(cfg, "use_sliding_window", False)):
            out.append(f"sliding-window attention of {window} tokens (layers {_ranges(sliding) or 'all'}; "
                       "only full attention)")
    if getattr(cfg, "attention_bias", False):
        out.append("attention_bias=true (an o_proj bias: Megatron has q/k/v biases alone, add_qkv_bias, "
                   "or biases on every linear layer, add_bias_linear)")
    if getattr(cfg, "mlp_bias", False):
        out.append("mlp_bias=true (MLP biases are not mapped)")
    heads, kv = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    if heads % kv:
        out.append(f"{heads} attention heads do not form groups of {kv} KV heads")
    return out


# -- names and shapes -----------------------------------------------------------------------------

def hf_shapes(layout: Layout) -> dict[str, tuple[int, ...]]:
    """Every HF tensor the mapping uses and its shape, in the order of transformers' named_parameters()."""
    L = layout
    h, q_rows, kv_rows, ffn = L.hidden_size, L.num_heads * L.head_dim, L.num_kv_heads * L.head_dim, L.ffn_hidden_size
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (L.vocab_size, h)}
    for i in range(L.num_layers):
        p = f"model.layers.{i}."
        for proj, rows in (("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows)):
            out[f"{p}self_attn.{proj}.weight"] = (rows, h)
            if L.qkv_bias:
                out[f"{p}self_attn.{proj}.bias"] = (rows,)
        out[p + "self_attn.o_proj.weight"] = (h, q_rows)
        if L.qk_norm:
            out[p + "self_attn.q_norm.weight"] = out[p + "self_attn.k_norm.weight"] = (L.head_dim,)
        out[p + "mlp.gate_proj.weight"] = out[p + "mlp.up_proj.weight"] = (ffn, h)
        out[p + "mlp.down_proj.weight"] = (h, ffn)
        out[p + "input_layernorm.weight"] = out[p + "post_attention_layernorm.weight"] = (h,)
    out["model.norm.weight"] = (h,)
    if not L.tied:
        out["lm_head.weight"] = (L.vocab_size, h)
    return out


def mcore_names(layout: Layout) -> list[str]:
    """Every Megatron parameter of the model (local spec, one pipeline stage), full names."""
    out = ["embedding.word_embeddings.weight", "decoder.final_layernorm.weight"]
    if not layout.tied:
        out.append("output_layer.weight")
    for i in range(layout.num_layers):
        out += [mc for _, mc in _layer_pairs(i, layout)]
        out.append(f"decoder.layers.{i}.self_attention.linear_qkv.weight")
        if layout.qkv_bias:
            out.append(f"decoder.layers.{i}.self_attention.linear_qkv.bias")
        out.append(f"decoder.layers.{i}.mlp.linear_fc1.weight")
    return out


def describe(names: Iterable[str], most: int = 8) -> str:
    """Tensor names, each layer range folded: model.layers.{0-27}.self_attn.q_proj.bias."""
    groups: dict[str, list[int]] = {}
    for n in names:
        m = re.match(r"^(.*\.layers\.)(\d+)(\..*)$", n)
        key = m[1] + "{}" + m[3] if m else n
        groups.setdefault(key, []).append(int(m[2]) if m else -1)
    parts = []
    for key, idx in sorted(groups.items()):
        layers = sorted(i for i in idx if i >= 0)
        parts.append(key if not layers else key.format(
            layers[0] if len(layers) == 1 else "{" + _ranges(layers) + "}"))
    more = f" and {len(parts) - most} more" if len(parts) > most else ""
    return ", ".join(parts[:most]) + more


def _ranges(ints: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    out: list[str] = []
    for i in ints:
        if out and int(out[-1].split("-")[-1]) == i - 1:
            out[-1] = out[-1].split("-")[0] + f"-{i}"
        else:
            out.append(str(i))
    return ",".join(out)


def check_hf_tensors(hf: dict[str, torch.Tensor], layout: Layout) -> None:
    """Raise, naming the tensors, unless hf holds exactly the tensors the mapping uses, each of the
    layout's shape (allowed besides: rotary inv_freq buffers, a tied lm_head equal to the embedding)."""
    want = hf_shapes(layout)
    missing = [n for n in want if n not in hf]
    if missing:
        raise RunError(f"the model's weights lack HF tensors {describe(missing)}")
    extra = sorted(n for n in hf if n not in want and not n.endswith(IGNORED_HF_SUFFIXES))
    if layout.tied and "lm_head.weight" in extra:
        if not torch.equal(hf["lm_head.weight"], hf["model.embed_tokens.weight"]):
            raise RunError("lm_head.weight differs from model.embed_tokens.weight but the config ties them "
                           "(tie_word_embeddings); set tie_word_embeddings to false in config.json or drop lm_head")
        extra.remove("lm_head.weight")
    if extra:
        raise RunError(f"train.engine=megatron does not map HF tensors {describe(extra)}: "
                       f"not part of the {layout.model_type} architecture it builds")
    wrong = [f"{n} {tuple(hf[n].shape)} (config: {s})" for n, s in want.items() if tuple(hf[n].shape) != s]
    if wrong:
        raise RunError(f"HF tensors of the wrong shape: {', '.join(wrong[:4])}")


BACKBONE_ONLY = ("decoder.final_layernorm.weight", "output_layer.weight")
"""What a GPTModel built with post_process=False (a critic's backbone) does not have."""


def check_mcore_names(have: Iterable[str], layout: Layout, what: str, without: Iterable[str] = ()) -> None:
    """Raise unless `have` (names of `what`) are exactly the Megatron parameters of the layout
    (less `without`)."""
    want, have = set(mcore_names(layout)) - set(without), set(have)
    if want - have:
        raise RunError(f"{what} lacks Megatron parameters {describe(want - have)}")
    if have - want:
        raise RunError(f"{what} has Megatron parameters the HF mapping does not fill: {describe(have - want)}")


# -- the mapping ----------------------------------------------------------------------------------

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


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: Layout) -> torch.Tensor:
    """HF q, k, v (weights [rows, hidden] or biases [rows]) -> Megatron's fused rows, per query
    group: its q heads, then its k head, then its v head."""
    g, rest = layout.num_kv_heads, tuple(q.shape[1:])
    parts = [t.reshape(g, -1, *rest) for t in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def split_qkv(qkv: torch.Tensor, layout: Layout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of fuse_qkv."""
    L, rest = layout, tuple(qkv.shape[1:])
    q_rows = L.num_heads // L.num_kv_heads * L.head_dim
    grouped = qkv.reshape(L.num_kv_heads, q_rows + 2 * L.head_dim, *rest)
    q, k, v = torch.split(grouped, [q_rows, L.head_dim, L.head_dim], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def hf_to_mcore(hf: dict[str, torch.Tensor], layout: Layout) -> dict[str, torch.Tensor]:
    """Full (unsharded) Megatron tensors from HF tensors; every HF tensor must be used (check_hf_tensors)."""
    L = layout
    check_hf_tensors(hf, L)
    out = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
           "decoder.final_layernorm.weight": hf["model.norm.weight"]}
    if not L.tied:
        out["output_layer.weight"] = hf["lm_head.weight"]
    for i in range(L.num_layers):
        for hf_name, mc_name in _layer_pairs(i, L):
            out[mc_name] = hf[hf_name]
        a, mc = f"model.layers.{i}.self_attn.", f"decoder.layers.{i}."
        kinds = ("weight", "bias") if L.qkv_bias else ("weight",)
        for kind in kinds:
            out[f"{mc}self_attention.linear_qkv.{kind}"] = fuse_qkv(
                hf[f"{a}q_proj.{kind}"], hf[f"{a}k_proj.{kind}"], hf[f"{a}v_proj.{kind}"], L)
        m = f"model.layers.{i}.mlp."
        out[mc + "mlp.linear_fc1.weight"] = torch.cat([hf[m + "gate_proj.weight"], hf[m + "up_proj.weight"]])
    return out


def mcore_to_hf(mc: dict[str, torch.Tensor], layout: Layout) -> list[tuple[str, torch.Tensor]]:
    """HF-named tensors from full Megatron tensors, in the order of transformers' named_parameters();
    mc must hold exactly the layout's Megatron parameters (check_mcore_names)."""
    check_mcore_names(mc, layout, "the exported Megatron state")
    return list(iter_mcore_to_hf(mc.__getitem__, layout))


def iter_mcore_to_hf(get: Callable[[str], torch.Tensor], layout: Layout) -> Iterator[tuple[str, torch.Tensor]]:
    """mcore_to_hf, one layer at a time: get(name) gives a full Megatron tensor (a TP engine
    gathers its shards then), asked for once and only when the layer that uses it is converted,
    so no more than one layer's full tensors exist at once. Every TP rank calling this asks for
    the same tensors in the same order."""
    L = layout
    unit: dict[str, torch.Tensor] = {}
    for name in hf_shapes(L):
        if name not in unit:
            unit = _hf_unit(name, get, L)
        yield name, unit.pop(name)


def _hf_unit(name: str, get: Callable[[str], torch.Tensor], L: Layout) -> dict[str, torch.Tensor]:
    """The HF tensors made from the Megatron tensors that HF tensor `name` comes from: all of a
    layer's for a layer's tensor, else the one it maps to."""
    if not name.startswith("model.layers."):
        source = {"model.embed_tokens.weight": "embedding.word_embeddings.weight",
                  "model.norm.weight": "decoder.final_layernorm.weight", "lm_head.weight": "output_layer.weight"}
        return {name: get(source[name])}
    i = int(name.split(".")[2])
    named = {h: get(m) for h, m in _layer_pairs(i, L)}
    a, p = f"model.layers.{i}.self_attn.", f"decoder.layers.{i}."
    for kind in ("weight", "bias") if L.qkv_bias else ("weight",):
        q, k, v = split_qkv(get(f"{p}self_attention.linear_qkv.{kind}"), L)
        named.update({f"{a}q_proj.{kind}": q, f"{a}k_proj.{kind}": k, f"{a}v_proj.{kind}": v})
    gate, up = torch.chunk(get(p + "mlp.linear_fc1.weight"), 2, dim=0)
    named.update({f"model.layers.{i}.mlp.gate_proj.weight": gate, f"model.layers.{i}.mlp.up_proj.weight": up})
    return named


# -- tensor parallelism ---------------------------------------------------------------------------

def tp_dim(name: str) -> int | None:
    """The dim a Megatron tensor is split on across TP ranks (None: replicated)."""
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return 1
    if name.endswith(("word_embeddings.weight", "output_layer.weight", "linear_qkv.weight", "linear_qkv.bias",
                      "linear_fc1.weight")):
        return 0
    return None


def shard(name: str, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This TP rank's part of a full Megatron tensor."""
    dim = tp_dim(name)
    if dim is None or tp_size == 1:
        return full
    if full.shape[dim] % tp_size:
        raise RunError(f"{name}: dim {dim} of size {full.shape[dim]} does not split over {tp_size} TP ranks")
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
