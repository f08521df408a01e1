"""The Megatron trainer's long-sample pieces held to Megatron-core's own source (it needs CUDA and
Python 3.12 and cannot run here): SdpaAttention has the signature SelfAttention builds and calls a
core attention with, returns the layout Megatron's DotProductAttention returns, and computes
what DotProductAttention's own forward computes (run on the CPU from its source text:
tests/megatron_source.py); the recompute keys map onto TransformerConfig's fields and choices;
the layer spec has the slot the trainer fills."""

from __future__ import annotations

import enum
import inspect
import os
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch

import megatron_source
from megatron_source import SUPPORTED, MissingWheel, literal_choices, parameters
from rlctl.engines.train.megatron_attention import SdpaAttention
from rlctl.engines.train.megatron_layers import recompute_options
from rlctl.errors import RunError
from rlctl.recipe import MegatronConfig, Recompute, RecomputeMethod

ATTENTION = "megatron/core/transformer/attention.py"
DOT = "megatron/core/transformer/dot_product_attention.py"
CONFIG = "megatron/core/transformer/transformer_config.py"


def _missing(version: str) -> str:
    try:
        megatron_source.source(version)
    except MissingWheel as e:
        return str(e)
    return ""


if any(map(_missing, SUPPORTED)) and not os.environ.get("CI"):
    pytest.skip("Megatron-core's wheel is not here (scripts/run-tests.sh downloads it): "
                + "; ".join(filter(None, map(_missing, SUPPORTED))), allow_module_level=True)


@pytest.fixture(scope="module", params=SUPPORTED)
def src(request):
    return megatron_source.source(request.param)


def _ours(method) -> list[str]:
    return [p for p in inspect.signature(method).parameters if p != "self"]


def test_the_module_takes_what_self_attention_builds_it_with(src):
    """SelfAttention's own call `submodules.core_attention(...)` and the CoreAttentionBuilder
    protocol: every keyword is a parameter of SdpaAttention, and it needs no other."""
    builds = [c for c in src.calls(ATTENTION) if getattr(c.func, "attr", None) == "core_attention"
              and getattr(getattr(c.func, "value", None), "id", None) == "submodules"]
    assert builds, "SelfAttention no longer builds submodules.core_attention(...)"
    ours = inspect.signature(SdpaAttention.__init__).parameters
    required = {n for n, p in ours.items() if n != "self" and p.default is inspect.Parameter.empty}
    for call in builds:
        given = {k.arg for k in call.keywords}
        assert not call.args and given <= set(ours) and required <= given, (given, sorted(ours))
    protocol = parameters(src.function(ATTENTION, "CoreAttentionBuilder.__call__"))
    assert set(protocol) <= set(ours) and required <= set(protocol)
    # Megatron's own module has the same parameters, in the same order.
    assert parameters(src.function(DOT, "DotProductAttention.__init__")) == _ours(SdpaAttention.__init__)


def test_every_call_of_core_attention_fits_forward(src):
    """Each place attention.py calls the core attention (directly, through apply_module, or
    through _run_core_attention) passes query, key, value and mask by position and the rest by
    the names SdpaAttention.forward has."""
    forward = _ours(SdpaAttention.forward)
    keyword_only = set(forward[4:])
    sites = 0
    for call in src.calls(ATTENTION):
        text = __import__("ast").unparse(call.func)
        if text not in ("apply_module(self.core_attention)", "self.core_attention", "self._run_core_attention"):
            continue
        sites += 1
        named = {k.arg for k in call.keywords if k.arg is not None}
        assert len(call.args) == 4 and named <= keyword_only, (text, len(call.args), named)
    assert sites >= 3
    assert parameters(src.function(DOT, "DotProductAttention.forward")) == forward
    interface = src.function(ATTENTION, "CoreAttentionInterface.forward")
    assert [a.arg for a in interface.args.posonlyargs][1:] == forward[:4]
    assert {a.arg for a in interface.args.kwonlyargs} == keyword_only


def megatron_attention(src, heads: int, groups: int, tp: int, head_dim: int, mask_type: str):
    """Megatron's DotProductAttention.forward and FusedScaleMaskSoftmax's torch path, compiled from
    their source for the CPU, as a function (query, key, value, mask) -> context. What they
    reach outside torch: the global memory buffer (an empty tensor of the asked shape), the
    CUDA RNG tracker (dropout is 0) and the config's sequence_parallel flag."""
    ns = {"torch": torch, "enum": enum}
    mask_enum = src.compiled("megatron/core/transformer/enums.py", "AttnMaskType", ns)
    utils = "megatron/core/transformer/utils.py"
    ns |= {"AttnMaskType": mask_enum,
           "get_default_causal_mask": src.compiled(utils, "get_default_causal_mask", ns),
           "attention_mask_func": src.compiled(utils, "attention_mask_func", ns)}
    softmax_fn = src.compiled("megatron/core/fusions/fused_softmax.py", "FusedScaleMaskSoftmax.forward_torch_softmax", ns)
    softmax = SimpleNamespace(input_in_fp16=False, input_in_bf16=False, input_in_float16=False, softmax_in_fp32=True,
                              scale=None, window_size=None, attn_mask_type=mask_enum[mask_type],
                              mask_func=ns["attention_mask_func"])
    buffer = SimpleNamespace(get_tensor=lambda shape, dtype, name: torch.empty(shape, dtype=dtype))
    ns |= {"parallel_state": SimpleNamespace(get_global_memory_buffer=lambda: buffer),
           "tensor_parallel": SimpleNamespace(get_cuda_rng_tracker=lambda: SimpleNamespace(fork=nullcontext))}
    forward = src.compiled(DOT, "DotProductAttention.forward", ns)
    me = SimpleNamespace(
        num_attention_heads_per_partition=heads // tp, num_query_groups_per_partition=groups // tp,
        softmax_scale=head_dim**-0.5, hidden_size_per_partition=heads // tp * head_dim, softmax_offset=None,
        scale_mask_softmax=lambda x, m, o: softmax_fn(softmax, x, m, o), attention_dropout=torch.nn.Identity(),
        config=SimpleNamespace(sequence_parallel=False))
    return lambda q, k, v, mask: forward(me, q, k, v, mask), mask_enum


def _config(heads: int, groups: int, head_dim: int, **extra) -> SimpleNamespace:
    return SimpleNamespace(num_attention_heads=heads, num_query_groups=groups, kv_channels=head_dim,
                           attention_dropout=0.0, context_parallel_size=1, apply_query_key_layer_scaling=False,
                           window_size=None, softmax_type="vanilla", **extra)


def _tp(size: int) -> SimpleNamespace:
    """A ProcessGroupCollection as the module reads it: .tp.size()."""
    return SimpleNamespace(tp=SimpleNamespace(size=lambda: size))


@pytest.mark.parametrize("heads,groups,tp", [(8, 2, 1), (8, 2, 2), (4, 4, 1), (16, 8, 4)])
@pytest.mark.parametrize("masked", [False, True])
def test_same_context_as_megatrons_own_attention(src, heads, groups, tp, masked):
    """Causal without a mask (what the trainer passes), and a given mask (True = not attended),
    over several heads per key/value group and TP splits: the context and its gradients equal
    DotProductAttention's, [sq, b, heads/tp * head_dim]."""
    head_dim, sq, b = 16, 11, 3
    mask_type = "padding" if masked else "causal"
    theirs, mask_enum = megatron_attention(src, heads, groups, tp, head_dim, mask_type)
    ours = SdpaAttention(_config(heads, groups, head_dim), 1, mask_enum[mask_type], "self", pg_collection=_tp(tp))
    g = torch.Generator().manual_seed(heads * 100 + tp)
    q = torch.randn(sq, b, heads // tp, head_dim, generator=g, dtype=torch.float64)
    k = torch.randn(sq, b, groups // tp, head_dim, generator=g, dtype=torch.float64)
    v = torch.randn(sq, b, groups // tp, head_dim, generator=g, dtype=torch.float64)
    mask = None
    if masked:  # [b, 1, sq, sk], every row keeps its own position
        mask = torch.rand(b, 1, sq, sq, generator=g) < 0.4
        mask &= ~torch.eye(sq, dtype=torch.bool)
    outs, grads = [], []
    for fn in (theirs, ours):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*inputs, mask)
        out.backward(torch.ones_like(out))
        outs.append(out.detach())
        grads.append([t.grad for t in inputs])
    assert outs[1].shape == (sq, b, heads // tp * head_dim) == outs[0].shape
    assert torch.allclose(outs[0], outs[1], atol=1e-10)
    for a, c in zip(*grads):
        assert torch.allclose(a, c, atol=1e-10)


def test_what_the_module_does_not_compute_is_refused():
    for field, value in [("window_size", (128, 0)), ("context_parallel_size", 2), ("softmax_type", "learnable"),
                         ("attention_dropout", 0.1), ("apply_query_key_layer_scaling", True)]:
        cfg = _config(8, 2, 16)
        setattr(cfg, field, value)
        with pytest.raises(RunError, match="attention=local"):
            SdpaAttention(cfg, 1, "causal", "self", pg_collection=_tp(1))
    with pytest.raises(RunError, match="do not split over 4 TP ranks"):
        SdpaAttention(_config(8, 2, 16), 1, "causal", "self", pg_collection=_tp(4))
    m = SdpaAttention(_config(4, 2, 8), 1, "causal", "self", pg_collection=_tp(1))
    q, kv = torch.randn(5, 1, 4, 8), torch.randn(5, 1, 2, 8)
    with pytest.raises(RunError, match="packed sequences"):
        m(q, kv, kv, None, packed_seq_params=object())
    with pytest.raises(RunError, match="biases"):
        m(q, kv, kv, None, attention_bias=torch.zeros(1))


def test_the_layer_spec_has_the_slot_the_trainer_fills(src):
    """megatron_layers.layer_spec sets spec.submodules.self_attention.submodules.core_attention:
    the local spec builds TransformerLayerSubmodules(self_attention=ModuleSpec(SelfAttention,
    submodules=SelfAttentionSubmodules(core_attention=...)))."""
    specs = "megatron/core/models/gpt/gpt_layer_specs.py"
    local = [c for c in src.calls(specs, "get_gpt_layer_local_submodules")
             if getattr(c.func, "id", None) == "TransformerLayerSubmodules"]
    assert local
    for call in local:
        kw = {k.arg: k.value for k in call.keywords}
        attention = kw["self_attention"]
        assert getattr(attention.func, "id", None) == "ModuleSpec"
        inner = {k.arg: k.value for k in attention.keywords}
        if __import__("ast").unparse(inner["module"]) != "SelfAttention":
            continue  # multi-latent attention
        assert getattr(inner["submodules"].func, "id", None) == "SelfAttentionSubmodules"
        assert "core_attention" in {k.arg for k in inner["submodules"].keywords}
    assert "core_attention" in src.dataclass_fields(ATTENTION, "SelfAttentionSubmodules")
    assert "submodules" in src.dataclass_fields("megatron/core/transformer/spec_utils.py", "ModuleSpec")


def test_recompute_keys_are_megatrons_own(src):
    fields = src.dataclass_fields(CONFIG, "TransformerConfig")
    assert literal_choices(fields["recompute_granularity"]) == {r.value for r in Recompute} - {"none"}
    assert literal_choices(fields["recompute_method"]) == {m.value for m in RecomputeMethod}
    assert "recompute_num_layers" in fields and "recompute_modules" in fields
    for granularity in Recompute:
        for method in RecomputeMethod:
            options = recompute_options(MegatronConfig(recompute_granularity=granularity, recompute_method=method,
                                                       recompute_num_layers=4), num_layers=28)
            assert set(options) <= set(fields)
            # Megatron's __post_init__: full needs a method and a layer count; selective neither.
            if options["recompute_granularity"] == "full":
                assert options["recompute_method"] == method.value and options["recompute_num_layers"] == 4
            else:
                assert "recompute_method" not in options and "recompute_num_layers" not in options
    # "core_attn" is one of the modules selective recompute accepts.
    post_init = src.function(CONFIG, "TransformerConfig.__post_init__")
    assert "core_attn" in {n.value for n in __import__("ast").walk(post_init) if isinstance(n, __import__("ast").Constant)}


def test_recompute_layers_outside_the_model_are_refused():
    with pytest.raises(RunError, match="recompute_num_layers=30: the model has 28 layers"):
        recompute_options(MegatronConfig(recompute_num_layers=30), num_layers=28)
