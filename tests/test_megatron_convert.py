"""The pure parts of train.engine=megatron, on CPU: HF <-> Megatron weight mapping (fused QKV and
Qwen2's fused q/k/v bias in query groups, fused gate/up), tensor-parallel sharding, the refusals
(unmapped or missing tensors, unsupported architecture features), and the recipe checks. The engine
itself needs CUDA: scripts/gpu_checks.py runs it on the GPU machine."""

from __future__ import annotations

import re

import pytest
import torch

from conftest import QUICKSTART, rlctl_here
from rlctl.engines.train.megatron_convert import (Layout, check_mcore_names, describe, gather, hf_to_mcore,
                                                  iter_mcore_to_hf, mcore_names, mcore_to_hf, shard, tp_dim)
from rlctl.errors import RunError


SHAPE = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=64)


def randomized(model):
    """Every parameter random, so that a swapped, dropped or zero tensor (HF zeroes biases and sets
    norms to 1 at init) shows in a comparison."""
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    return model.eval()


def tiny_qwen3(tied: bool, heads: int = 4, kv_heads: int = 2):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(**SHAPE, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=16, tie_word_embeddings=tied)
    torch.manual_seed(0)
    return randomized(Qwen3ForCausalLM(cfg))


def tiny_qwen2(tied: bool, heads: int = 4, kv_heads: int = 2):
    """Qwen2: q/k/v projections with biases, no qk-norm, head_dim = hidden / heads."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(**SHAPE, num_attention_heads=heads, num_key_value_heads=kv_heads, tie_word_embeddings=tied)
    torch.manual_seed(0)
    return randomized(Qwen2ForCausalLM(cfg))


TINY = {"qwen3": tiny_qwen3, "qwen2": tiny_qwen2}


def hf_state(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
@pytest.mark.parametrize("tied", [True, False])
def test_round_trip_is_exact_and_in_hf_order(arch, tied):
    model = TINY[arch](tied)
    layout = Layout.from_hf_config(model.config)
    hf = hf_state(model)
    mc = hf_to_mcore(hf, layout)
    assert sorted(mc) == sorted(mcore_names(layout))
    biases = [n for n in mc if n.endswith("linear_qkv.bias")]
    assert len(biases) == (2 if arch == "qwen2" else 0)  # Qwen2's q/k/v biases become the fused bias
    for n in biases:
        assert mc[n].shape == ((layout.num_heads + 2 * layout.num_kv_heads) * layout.head_dim,)
    back = mcore_to_hf(mc, layout)
    assert [n for n, _ in back] == list(hf)  # named_parameters order (biases included), tied head listed once
    for name, t in back:
        assert torch.equal(t, hf[name]), name


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
def test_fused_qkv_computes_the_same_projections(arch):
    """Not just invertible: the fused weight (and Qwen2's fused bias), read in Megatron's grouped
    layout, gives each query group its own q heads, then k, then v, as HF's separate projections do."""
    model = TINY[arch](True, heads=4, kv_heads=2)
    L = Layout.from_hf_config(model.config)
    attn = model.model.layers[1].self_attn
    mc = hf_to_mcore(hf_state(model), L)
    x = torch.randn(3, L.hidden_size)
    fused = torch.nn.functional.linear(x, mc["decoder.layers.1.self_attention.linear_qkv.weight"],
                                       mc.get("decoder.layers.1.self_attention.linear_qkv.bias"))
    fused = fused.view(3, L.num_kv_heads, -1, L.head_dim)
    q_per_group = L.num_heads // L.num_kv_heads
    with torch.no_grad():
        q = attn.q_proj(x).view(3, L.num_kv_heads, q_per_group, L.head_dim)
        k = attn.k_proj(x).view(3, L.num_kv_heads, 1, L.head_dim)
        v = attn.v_proj(x).view(3, L.num_kv_heads, 1, L.head_dim)
        torch.testing.assert_close(fused, torch.cat([q, k, v], dim=2))
        mlp = model.model.layers[1].mlp
        gate_up = x @ mc["decoder.layers.1.mlp.linear_fc1.weight"].T
        torch.testing.assert_close(gate_up, torch.cat([mlp.gate_proj(x), mlp.up_proj(x)], dim=-1))


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_shards_gather_back(tp, arch):
    model = TINY[arch](False, heads=8, kv_heads=4)
    L = Layout.from_hf_config(model.config)
    mc = hf_to_mcore({n: p.detach() for n, p in model.named_parameters()}, L)
    for name, full in mc.items():
        parts = [shard(name, full, r, tp) for r in range(tp)]
        assert torch.equal(gather(name, parts), full), name
        if tp_dim(name) is not None:
            assert parts[0].shape[tp_dim(name)] * tp == full.shape[tp_dim(name)]
    # shard r of fc1 is [gate_r; up_r], what a column-parallel SwiGLU layer holds
    fc1 = mc["decoder.layers.0.mlp.linear_fc1.weight"]
    gate = model.model.layers[0].mlp.gate_proj.weight.detach()
    assert torch.equal(shard("decoder.layers.0.mlp.linear_fc1.weight", fc1, 1, tp)[: L.ffn_hidden_size // tp],
                       torch.chunk(gate, tp)[1])
    # shard r of qkv holds whole query groups: q heads of those groups, then their k and v
    qkv = shard("decoder.layers.0.self_attention.linear_qkv.weight", mc["decoder.layers.0.self_attention.linear_qkv.weight"], 0, tp)
    q_rows = (L.num_heads // L.num_kv_heads) * L.head_dim
    assert torch.equal(qkv[:q_rows], model.model.layers[0].self_attn.q_proj.weight.detach()[:q_rows])


def test_qwen2_tp2_shards_round_trip_and_compute_their_query_groups():
    """HF -> Megatron -> 2 TP shards -> gathered -> HF is exact, and each rank's column-parallel
    linear_qkv (weight and bias shard) computes q, k, v of its own query groups, bias included."""
    tp = 2
    model = tiny_qwen2(False, heads=8, kv_heads=4)
    L = Layout.from_hf_config(model.config)
    hf = hf_state(model)
    mc = hf_to_mcore(hf, L)
    ranks = [{n: shard(n, t, r, tp) for n, t in mc.items()} for r in range(tp)]
    back = mcore_to_hf({n: gather(n, [rk[n] for rk in ranks]) for n in mc}, L)
    assert [n for n, _ in back] == list(hf)
    for name, t in back:
        assert torch.equal(t, hf[name]), name
    attn, x = model.model.layers[0].self_attn, torch.randn(3, L.hidden_size)
    groups, q_per_group, hd = L.num_kv_heads // tp, L.num_heads // L.num_kv_heads, L.head_dim
    with torch.no_grad():
        q = attn.q_proj(x).view(3, L.num_kv_heads, q_per_group * hd)
        k, v = attn.k_proj(x).view(3, L.num_kv_heads, hd), attn.v_proj(x).view(3, L.num_kv_heads, hd)
    for r, rk in enumerate(ranks):
        bias = rk["decoder.layers.0.self_attention.linear_qkv.bias"]
        assert bias.shape == (groups * (q_per_group + 2) * hd,)
        out = torch.nn.functional.linear(x, rk["decoder.layers.0.self_attention.linear_qkv.weight"], bias)
        g = slice(r * groups, (r + 1) * groups)
        torch.testing.assert_close(out.view(3, groups, -1), torch.cat([q[:, g], k[:, g], v[:, g]], dim=2))


@pytest.mark.parametrize("extra", ["model.layers.1.self_attn.o_proj.bias", "model.layers.0.mlp.gate_proj.bias",
                                   "visual.patch_embed.proj.weight"])
def test_an_hf_tensor_the_mapping_does_not_use_is_an_error_naming_it(extra):
    model = tiny_qwen2(False)
    hf = {**hf_state(model), extra: torch.zeros(4)}
    with pytest.raises(RunError) as e:
        hf_to_mcore(hf, Layout.from_hf_config(model.config))
    assert extra in str(e.value) and "does not map" in str(e.value) and "\n" not in str(e.value)


def test_qkv_biases_of_an_architecture_without_them_are_refused_not_dropped():
    from transformers import LlamaConfig

    qwen2 = hf_state(tiny_qwen2(True))  # the same shapes as this Llama config, plus q/k/v biases
    L = Layout.from_hf_config(LlamaConfig(**SHAPE, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
    assert not L.qkv_bias and not L.qk_norm
    with pytest.raises(RunError, match=re.escape("model.layers.{0-1}.self_attn.k_proj.bias")):
        hf_to_mcore(qwen2, L)
    without = {n: t for n, t in qwen2.items() if not n.endswith("_proj.bias")}
    assert torch.equal(mcore_to_hf(hf_to_mcore(without, L), L)[1][1], without["model.layers.0.self_attn.q_proj.weight"])


@pytest.mark.parametrize("tied, drop", [(False, "model.layers.1.self_attn.k_proj.bias"), (False, "lm_head.weight"),
                                        (True, "model.layers.0.self_attn.v_proj.bias")])
def test_a_missing_hf_tensor_is_an_error_naming_it(tied, drop):
    model = tiny_qwen2(tied)
    hf = hf_state(model)
    del hf[drop]
    with pytest.raises(RunError, match="lack HF tensors " + re.escape(drop)):
        hf_to_mcore(hf, Layout.from_hf_config(model.config))


def test_a_tied_lm_head_may_be_absent_or_a_copy_but_not_different():
    model = tiny_qwen2(True)
    L, hf = Layout.from_hf_config(model.config), hf_state(model)
    embed = hf["model.embed_tokens.weight"]
    assert "lm_head.weight" not in hf  # tied: transformers lists it once, as the embedding
    saved = {**hf, "lm_head.weight": embed.clone(), "model.rotary_emb.inv_freq": torch.ones(8)}
    mc = hf_to_mcore(saved, L)
    assert "output_layer.weight" not in mc and torch.equal(mc["embedding.word_embeddings.weight"], embed)
    with pytest.raises(RunError, match="lm_head.weight differs from model.embed_tokens.weight"):
        hf_to_mcore({**hf, "lm_head.weight": embed + 1}, L)


def test_an_hf_tensor_of_the_wrong_shape_is_an_error():
    model = tiny_qwen2(True)
    hf = {**hf_state(model), "model.layers.0.self_attn.v_proj.bias": torch.zeros(3)}
    with pytest.raises(RunError, match=re.escape("model.layers.0.self_attn.v_proj.bias (3,) (config: (32,))")):
        hf_to_mcore(hf, Layout.from_hf_config(model.config))


def test_megatron_parameters_must_be_exactly_those_the_mapping_fills():
    model = tiny_qwen2(True)
    L = Layout.from_hf_config(model.config)
    names = mcore_names(L)
    check_mcore_names(names, L, "the model")
    no_bias = [n for n in names if not n.endswith("linear_qkv.bias")]  # a model built without add_qkv_bias
    with pytest.raises(RunError, match=re.escape("the model lacks Megatron parameters decoder.layers.{0-1}.self_attention.linear_qkv.bias")):
        check_mcore_names(no_bias, L, "the model")
    extra = "decoder.layers.1.self_attention.linear_proj.bias"  # what add_bias_linear would add
    with pytest.raises(RunError, match=re.escape(f"does not fill: {extra}")):
        check_mcore_names([*names, extra], L, "the model")
    mc = hf_to_mcore(hf_state(model), L)
    with pytest.raises(RunError, match=re.escape(extra)):
        mcore_to_hf({**mc, extra: torch.zeros(64)}, L)


def config(kind: str, **kw):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[kind]
    return cls(**{**SHAPE, "num_attention_heads": 4, "num_key_value_heads": 2, **kw})


@pytest.mark.parametrize("kind, kw, says", [
    ("qwen2", dict(use_sliding_window=True, max_window_layers=1, sliding_window=16), "sliding-window attention of 16 tokens (layers 1;"),
    ("qwen3", dict(attention_bias=True), "attention_bias=true (an o_proj bias"),
    ("llama", dict(attention_bias=True), "attention_bias=true (an o_proj bias"),
    ("llama", dict(mlp_bias=True), "mlp_bias=true"),
    ("llama", dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    ("llama", dict(max_position_embeddings=256, rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                                 "rope_theta": 10000.0}), "rope_type 'linear'"),
])
def test_architecture_features_the_mapping_cannot_express_are_refused_in_one_line(kind, kw, says):
    with pytest.raises(RunError) as e:
        Layout.from_hf_config(config(kind, **kw))
    msg = str(e.value)
    assert msg.startswith(f"train.engine=megatron cannot train this {kind} model: ") and says in msg and "\n" not in msg


def test_supported_families_and_what_each_maps():
    assert [(L.qkv_bias, L.qk_norm) for L in map(Layout.from_hf_config, (config("qwen2"), config("qwen3"), config("llama")))] \
        == [(True, False), (False, True), (False, False)]
    # a sliding window as long as the longest sequence is full attention: accepted
    assert Layout.from_hf_config(config("qwen2", use_sliding_window=True, max_window_layers=1, sliding_window=64)).qkv_bias


def test_describe_folds_layer_indices():
    names = ["model.layers.0.a.bias", "model.layers.1.a.bias", "model.layers.3.a.bias", "lm_head.weight", "model.layers.2.b"]
    assert describe(names) == "lm_head.weight, model.layers.{0-1,3}.a.bias, model.layers.2.b"


def test_unsupported_model_family_is_refused():
    from transformers import GPT2Config

    with pytest.raises(RunError, match="Qwen3/Qwen2/Llama"):
        Layout.from_hf_config(GPT2Config())


@pytest.mark.parametrize("override, key", [
    ("train.engine=megatron", "train.device"),
    ("train.megatron.pp=2", "train.megatron.pp"),
    ("train.megatron.dtype=fp8", "train.megatron.dtype"),
    ("train.megatron.tp=3", "train.megatron.tp"),
])
def test_bad_megatron_settings_name_the_key(tmp_path, override, key):
    extra = ["train.engine=megatron", "train.device=cuda"] if override == "train.megatron.tp=3" else []
    res = rlctl_here("launch", str(QUICKSTART), *extra, override, f"run.output_dir={tmp_path}", cwd=tmp_path)
    assert res.returncode == 2 and f": {key}: " in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
def test_weights_stream_one_layer_at_a_time_and_each_megatron_tensor_is_asked_for_once(arch):
    """What the weight sync reads: a TP engine gathers a tensor when it is asked for, so the
    stream must ask for each once, in an order every rank repeats, and no further ahead than the
    layer it is converting."""
    model = TINY[arch](tied=False)
    layout = Layout.from_hf_config(model.config)
    hf = hf_state(model)
    mc = hf_to_mcore(hf, layout)
    asked: list[str] = []

    def get(name):
        asked.append(name)
        return mc[name]

    out = []
    for name, t in iter_mcore_to_hf(get, layout):
        layer = re.match(r"model\.layers\.(\d+)\.", name)
        if layer:  # nothing of a later layer has been gathered yet
            assert all(int(m.split(".")[2]) <= int(layer[1]) for m in asked if m.startswith("decoder.layers."))
        out.append((name, t))
    assert sorted(asked) == sorted(mcore_names(layout)) and len(asked) == len(set(asked))
    assert [n for n, _ in out] == list(hf) and all(torch.equal(t, hf[n]) for n, t in out)
