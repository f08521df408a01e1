"""The pure parts of train.engine=megatron, on CPU: HF <-> Megatron weight mapping (fused QKV in
query groups, fused gate/up), tensor-parallel sharding, and the recipe checks. The engine itself
needs CUDA: scripts/gpu_checks.py runs it on the GPU machine."""

from __future__ import annotations

import pytest
import torch

from conftest import QUICKSTART, rlctl
from rlctl.engines.train.megatron_convert import Layout, gather, hf_to_mcore, mcore_to_hf, shard, tp_dim


def tiny_qwen3(tied: bool, heads: int = 4, kv_heads: int = 2):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, head_dim=16, tie_word_embeddings=tied, max_position_embeddings=64)
    torch.manual_seed(0)
    return Qwen3ForCausalLM(cfg).eval()


@pytest.mark.parametrize("tied", [True, False])
def test_round_trip_is_exact_and_in_hf_order(tied):
    model = tiny_qwen3(tied)
    layout = Layout.from_hf_config(model.config)
    hf = {n: p.detach().clone() for n, p in model.named_parameters()}
    back = mcore_to_hf(hf_to_mcore(hf, layout), layout)
    assert [n for n, _ in back] == list(hf)  # named_parameters order, tied head listed once
    for name, t in back:
        assert torch.equal(t, hf[name]), name


def test_fused_qkv_computes_the_same_projections():
    """Not just invertible: the fused weight, read in Megatron's grouped layout, gives each query
    group its own q heads, then k, then v, as HF's separate projections do."""
    model = tiny_qwen3(True, heads=4, kv_heads=2)
    L = Layout.from_hf_config(model.config)
    attn = model.model.layers[1].self_attn
    mc = hf_to_mcore({n: p.detach() for n, p in model.named_parameters()}, L)
    x = torch.randn(3, L.hidden_size)
    fused = (x @ mc["decoder.layers.1.self_attention.linear_qkv.weight"].T).view(3, L.num_kv_heads, -1, L.head_dim)
    q_per_group = L.num_heads // L.num_kv_heads
    q = attn.q_proj(x).view(3, L.num_kv_heads, q_per_group, L.head_dim)
    k = attn.k_proj(x).view(3, L.num_kv_heads, 1, L.head_dim)
    v = attn.v_proj(x).view(3, L.num_kv_heads, 1, L.head_dim)
    torch.testing.assert_close(fused, torch.cat([q, k, v], dim=2))
    mlp = model.model.layers[1].mlp
    gate_up = x @ mc["decoder.layers.1.mlp.linear_fc1.weight"].T
    torch.testing.assert_close(gate_up, torch.cat([mlp.gate_proj(x), mlp.up_proj(x)], dim=-1))


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_shards_gather_back(tp):
    model = tiny_qwen3(False, heads=8, kv_heads=4)
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


def test_unsupported_model_family_is_refused():
    from transformers import GPT2Config

    with pytest.raises(ValueError, match="Qwen3/Qwen2/Llama"):
        Layout.from_hf_config(GPT2Config())


@pytest.mark.parametrize("override, key", [
    ("train.engine=megatron", "train.device"),
    ("train.megatron.pp=2", "train.megatron.pp"),
    ("train.megatron.dtype=fp8", "train.megatron.dtype"),
    ("train.megatron.tp=3", "train.megatron.tp"),
])
def test_bad_megatron_settings_name_the_key(tmp_path, override, key):
    extra = ["train.engine=megatron", "train.device=cuda"] if override == "train.megatron.tp=3" else []
    res = rlctl("launch", str(QUICKSTART), *extra, override, f"run.output_dir={tmp_path}", cwd=tmp_path)
    assert res.returncode == 2 and f": {key}: " in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
