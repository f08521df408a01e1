"""The cost model behind `rlctl simulate`: how long prefill, decode, training and the weight
broadcast take, from hardware specs, the model size and a few efficiency knobs.

It is a roofline model on purpose. Each phase is bound by one resource: prefill and training by
compute (2 and 6 FLOPs per parameter per token), batched decode by HBM bandwidth (every step reads
the weights once plus each running request's KV cache) until the batch is large enough to become
compute-bound, the broadcast by the inter-node link. The efficiency knobs (MFU, achieved bandwidth
fraction, fixed overheads) are what calibration against measured runs adjusts; the defaults are
typical values for well-tuned SGLang / Megatron / FSDP deployments.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rlctl.recipe.choices import AlgoName, GpuKind

if TYPE_CHECKING:
    from rlctl.recipe import Recipe


@dataclass(frozen=True)
class Hardware:
    """One accelerator, with the public spec numbers the roofline needs.

    `interconnect_bytes_per_s` is the per-node network bandwidth the trainer-to-rollout weight
    broadcast crosses (the trainer and the rollout servers sit on different nodes), not NVLink.
    """

    name: GpuKind
    bf16_flops: float
    hbm_bytes_per_s: float
    hbm_bytes: float
    interconnect_bytes_per_s: float
    nvlink_bytes_per_s: float = 0.0
    """GPU to GPU inside a node, one direction (tensor-parallel all-reduces)."""
    host_bytes_per_s: float = 0.0
    """GPU to host memory (PCIe): what moving a model's state off the GPU and back costs."""
    collective_latency_s: float = 1e-5
    """One small all-reduce: the floor of every tensor-parallel collective."""


# 400 Gb/s InfiniBand/RoCE per node = 50e9 B/s: the usual network of H100/H200 clusters, assumed
# for every GPU entry so that results compare hardware, not networks.
_NODE_NETWORK = 50e9

HARDWARE: dict[GpuKind, Hardware] = {
    # NVIDIA H200 SXM datasheet: 989 TFLOP/s dense BF16 (1979 is with 2:4 sparsity), 4.8 TB/s
    # HBM3e, 141 GB.
    # NVLink 4: 900 GB/s both ways, 450 one way; PCIe Gen5 x16: 64 GB/s, ~50 achieved.
    GpuKind.H200: Hardware(GpuKind.H200, 989e12, 4.8e12, 141e9, _NODE_NETWORK, 450e9, 50e9),
    # NVIDIA H100 SXM datasheet: same compute die as H200, 3.35 TB/s HBM3, 80 GB.
    GpuKind.H100: Hardware(GpuKind.H100, 989e12, 3.35e12, 80e9, _NODE_NETWORK, 450e9, 50e9),
    # NVIDIA A100 SXM 80GB datasheet: 312 TFLOP/s dense BF16, ~2.0 TB/s HBM2e, 80 GB; NVLink 3
    # 600 GB/s both ways; PCIe Gen4 x16 32 GB/s, ~25 achieved.
    GpuKind.A100: Hardware(GpuKind.A100, 312e12, 2.0e12, 80e9, _NODE_NETWORK, 300e9, 25e9),
    # One CPU host running the built-in engines in local tests: ~50 GFLOP/s achieved by torch
    # bf16/fp32 matmuls on a few cores, ~20 GB/s of DRAM bandwidth for one process, 64 GB of RAM,
    # and weight sync by a gloo broadcast over loopback TCP (a few GB/s); its "devices" share the
    # one memory, so moving state between them is a memory copy. Meant to be calibrated.
    GpuKind.CPU: Hardware(GpuKind.CPU, 5e10, 2e10, 64e9, 2e9, 2e9, 1e10, 5e-5),
}


# Shape assumed when only the parameter count is known (see ModelShape.kv_bytes_per_token).
_HIDDEN_PER_LAYER = 128
DEFAULT_KV_DIM = 1024


@dataclass(frozen=True)
class ModelShape:
    """A dense transformer, as far as the roofline cares: its parameter count and byte width, and
    optionally the layer count and KV width (KV heads * head dim) that size its KV cache, and the
    widths that size a trainer's activations (hidden, MLP, query, vocabulary). What is not given
    is estimated (the properties below say how)."""

    params: float
    bytes_per_param: float = 2.0
    layers: int | None = None
    kv_dim: int | None = None
    hidden: int | None = None
    intermediate: int | None = None
    q_dim: int | None = None
    vocab: int | None = None
    heads: int | None = None

    @classmethod
    def from_params_b(cls, params_b: float, bytes_per_param: float = 2.0, layers: int | None = None,
                      kv_dim: int | None = None, hidden: int | None = None, vocab: int | None = None) -> ModelShape:
        """A model of `params_b` billion parameters (bf16 unless told otherwise)."""
        return cls(params_b * 1e9, bytes_per_param, layers, kv_dim, hidden, vocab=vocab)

    @classmethod
    def from_hf_config(cls, config: dict, bytes_per_param: float = 2.0) -> ModelShape:
        """A Qwen/Llama-style decoder from its config.json, its parameters counted from the
        shapes (embeddings, attention with optional q/k norms, SwiGLU MLP, norms)."""
        h, layers = int(config["hidden_size"]), int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or h // heads)
        q, kv = heads * head_dim, int(config.get("num_key_value_heads") or heads) * head_dim
        inter, vocab = int(config["intermediate_size"]), int(config["vocab_size"])
        per_layer = h * q + 2 * h * kv + q * h + 3 * h * inter + 2 * h + 2 * head_dim
        embeddings = vocab * h * (1 if config.get("tie_word_embeddings", True) else 2)
        return cls(float(layers * per_layer + embeddings + h), bytes_per_param, layers, kv, h, inter, q, vocab, heads)

    @property
    def weight_bytes(self) -> float:
        return self.params * self.bytes_per_param

    @property
    def n_layers(self) -> float:
        """`layers`, or (params / (12 * 128^2))^(1/3): see kv_bytes_per_token."""
        return self.layers or (self.params / (12 * _HIDDEN_PER_LAYER**2)) ** (1 / 3)

    @property
    def d_hidden(self) -> float:
        """`hidden`, or 128 * layers (the common aspect ratio; see kv_bytes_per_token)."""
        return self.hidden or _HIDDEN_PER_LAYER * self.n_layers

    def activation_values_per_token(self) -> float:
        """Values one token's forward pass keeps for the backward pass, over all layers, without
        recomputation and with a fused attention kernel (no T x T scores): per layer about
        8 * hidden + 4 * MLP width + 4 * query width (norm inputs and outputs, the attention's
        inputs and output, the MLP's gate, up and their product, the residual stream), counted
        from what autograd saves in a Qwen3 layer (tests/test_plan.py measures it). The logits
        are apart: logits_values_per_token."""
        h = self.d_hidden
        inter = self.intermediate or 3 * h
        q = self.q_dim or h
        return self.n_layers * (8 * h + 4 * inter + 4 * q)

    def logits_values_per_token(self) -> float:
        """The fp32 logits, their log-softmax and its gradient: three vocabulary-wide rows per
        token at the peak of the loss."""
        return 3 * self.n_vocab

    @property
    def n_vocab(self) -> int:
        """`vocab`, or 128k when not given (Llama-3's, near Qwen's 152k)."""
        return self.vocab or 128_000

    @property
    def n_heads(self) -> float:
        """`heads`, or the query width in heads of 128 (the common head size)."""
        return self.heads or (self.q_dim or self.d_hidden) / 128

    @property
    def kv_bytes_per_token(self) -> float:
        """Bytes of KV cache one token occupies: K and V, for every layer, `kv_dim` wide.

        Without `layers`, they are estimated from the parameter count: a dense transformer has
        about 12 * layers * hidden^2 parameters, and common shapes keep hidden ~= 128 * layers
        (Llama-2/3-7/8B: 32 layers, 4096 hidden), so layers ~= (params / (12 * 128^2))^(1/3).
        Without `kv_dim`, 1024 = 8 KV heads of 128 dims, the usual GQA setting (Llama-3, Qwen3).
        This gives ~138 KiB/token at 8B (Llama-3-8B: 128 KiB) and ~284 KiB at 70B (Llama-3-70B:
        320 KiB); models with fewer KV heads (Qwen2.5-7B: 56 KiB) need the fields.
        """
        layers = self.layers or (self.params / (12 * _HIDDEN_PER_LAYER**2)) ** (1 / 3)
        kv_dim = self.kv_dim or DEFAULT_KV_DIM
        return 2 * layers * kv_dim * self.bytes_per_param


@dataclass
class CostModel:
    """Durations of each phase of an RL step on `hardware` for `model`.

    A rollout server is one tensor-parallel group of `gpus_per_server` GPUs; the trainer is
    `trainer_gpus` GPUs with the work spread evenly (data/FSDP parallel), so both scale linearly
    in their GPU count, which is what well-tuned engines approach at these sizes.

    Knobs, and why their defaults:
    - mfu_train 0.4: Megatron/FSDP training of 7-70B dense models reaches 35-45% MFU.
    - mfu_prefill 0.5: prefill is large dense matmuls, a little better than training (no backward,
      no optimizer, no activation recomputation).
    - decode_bw_efficiency 0.7: SGLang/vLLM decode kernels reach 60-80% of peak HBM bandwidth.
    - broadcast_efficiency 0.8: NCCL broadcast achieves ~80% of the link rate on large messages.
    - mean_context_tokens 2048: the KV cache each running request holds, on average over its
      life (prompt plus half its response); decode reads all of it every step. Set it from the
      prompt and response lengths of the workload being simulated.
    - memory_fraction 0.9: the share of HBM the server may use for weights plus KV cache
      (SGLang's mem_fraction_static is 0.8-0.9); the rest is activations and the CUDA context.
    - decode_step_overhead_s / train_step_overhead_s: fixed costs the rooflines miss (scheduler
      and kernel launches per decode step; optimizer step and gradient all-reduce latency per
      training step). Zero by default; calibration sets them.

    The trainer's layout and algorithm (the planner, rlctl/planner, varies them):
    - train_tp, train_pp: tensor- and pipeline-parallel sizes; data parallel is the rest of
      trainer_gpus. Tensor parallelism adds four all-reduces of the activations per layer and
      micro-batch over NVLink; pipeline parallelism the 1F1B bubble, (pp - 1) / micro-batches of
      the compute; data parallelism one all-reduce of the fp32 gradients per optimizer step over
      the network, not overlapped with the backward pass.
    - micro_batch_tokens, layer_launch_s: a train batch runs in micro-batches of at most that many
      tokens per data-parallel rank, each paying layer_launch_s per layer it runs (kernel launches
      and the framework around them; 0 by default, calibration sets it).
    - forward_passes, critic: extra forward passes over every token (a KL reference model, old
      log-probs recomputed) at 2 FLOPs per parameter, and PPO's critic (a forward for the values
      and a forward-backward for its loss: 8).
    - colocated, swap_bytes: rollout and training time-share the same GPUs: the weights reach
      the servers as a device-memory copy, and swap_bytes of the trainer's state leave for host
      memory during rollout and come back (what does not fit beside the servers).
    """

    hardware: Hardware
    model: ModelShape
    mfu_train: float = 0.4
    mfu_prefill: float = 0.5
    decode_bw_efficiency: float = 0.7
    gpus_per_server: int = 1
    trainer_gpus: int = 1
    broadcast_efficiency: float = 0.8
    mean_context_tokens: int = 2048
    memory_fraction: float = 0.9
    decode_step_overhead_s: float = 0.0
    train_step_overhead_s: float = 0.0
    train_tp: int = 1
    train_pp: int = 1
    micro_batch_tokens: int = 8192
    layer_launch_s: float = 0.0
    forward_passes: int = 0
    critic: bool = False
    colocated: bool = False
    swap_bytes: float = 0.0

    @property
    def train_dp(self) -> int:
        return max(1, self.trainer_gpus // (self.train_tp * self.train_pp))

    def _tp_allreduce_seconds(self, tp: int, values: float, count: float) -> float:
        """`count` ring all-reduces of `values` bf16 values each among `tp` GPUs of one node."""
        if tp <= 1:
            return 0.0
        link = self.hardware.nvlink_bytes_per_s or self.hardware.interconnect_bytes_per_s
        return count * (self.hardware.collective_latency_s + 2 * (tp - 1) / tp * values * 2 / link)

    def decode_step_seconds(self, batch: int) -> float:
        """One decode step of a continuous batch of `batch` requests on one server.

        Memory-bound side: the step reads all weights once (shared by the batch) plus every
        request's KV cache, spread over the server's `gpus_per_server` GPUs' HBM. Compute-bound
        side: 2 FLOPs per parameter per generated token, at prefill-like MFU since a large decode
        batch is a dense matmul too. The slower of the two wins; small batches are memory-bound,
        which is why continuous batching makes decode cheap per token.
        """
        tp = self.gpus_per_server
        kv_read = self.mean_context_tokens * self.model.kv_bytes_per_token
        memory = (self.model.weight_bytes + batch * kv_read) / (
            self.hardware.hbm_bytes_per_s * self.decode_bw_efficiency * tp)
        compute = 2 * self.model.params * batch / (self.hardware.bf16_flops * self.mfu_prefill * tp)
        # Tensor parallelism: two all-reduces of the batch's hidden states per layer.
        comm = self._tp_allreduce_seconds(tp, batch * self.model.d_hidden, 2 * self.model.n_layers)
        return max(memory, compute) + comm + self.decode_step_overhead_s

    def prefill_seconds(self, tokens: int) -> float:
        """Prefilling `tokens` prompt tokens on one server: 2 FLOPs per parameter per token,
        compute-bound (the attention term is small next to the matmuls at RL prompt lengths)."""
        return 2 * self.model.params * tokens / (self.hardware.bf16_flops * self.mfu_prefill * self.gpus_per_server)

    def train_seconds(self, tokens: float, step: bool = True, samples: int | None = None) -> float:
        """Forward and backward over `tokens` tokens: 6 FLOPs per parameter per token (2 forward,
        4 backward) plus the algorithm's extra passes, spread over the trainer GPUs, with the
        layout's costs (class docstring); and when the call ends in an optimizer step, the
        gradient all-reduce and the fixed per-step overhead (step=False: one piece of a train
        batch that arrives in pieces). Given `samples`, a data-parallel rank takes whole samples:
        the busiest one has ceil(samples / dp) of them, and a piece of fewer samples than ranks
        leaves ranks idle."""
        if tokens <= 0:
            return self.train_step_overhead_s if step else 0.0
        m = self.model
        per_rank = tokens / self.train_dp if not samples else math.ceil(samples / self.train_dp) * tokens / samples
        flops = (6 + 2 * self.forward_passes + (8 if self.critic else 0)) * m.params * per_rank
        compute = flops / (self.hardware.bf16_flops * self.mfu_train * self.train_tp * self.train_pp)
        micro = math.ceil(per_rank / self.micro_batch_tokens)
        stage_layers = m.n_layers / self.train_pp
        work = compute + micro * stage_layers * self.layer_launch_s
        work += self._tp_allreduce_seconds(self.train_tp, per_rank / micro * m.d_hidden, 4 * stage_layers * micro)
        seconds = work * (1 + (self.train_pp - 1) / micro)
        if step:
            seconds += self.train_step_overhead_s
            dp = self.train_dp
            if dp > 1:  # fp32 gradients of this rank's shard, ring all-reduce over the network
                grads = 4 * m.params / (self.train_tp * self.train_pp)
                seconds += 2 * (dp - 1) / dp * grads / self.hardware.interconnect_bytes_per_s
        return seconds

    def broadcast_seconds(self) -> float:
        """Pushing the new weights from the trainer to the rollout servers. A pipelined NCCL
        broadcast costs about one pass of the weights over one node link, however many nodes
        receive them, so the time is weight bytes / link bandwidth. Colocated, the servers take
        them from device memory (a read and a write), and the swapped state goes out and back."""
        if self.colocated:
            copy = 2 * self.model.weight_bytes / (self.hardware.hbm_bytes_per_s * self.decode_bw_efficiency)
            return copy + 2 * self.swap_bytes / (self.hardware.host_bytes_per_s or self.hardware.interconnect_bytes_per_s)
        return self.model.weight_bytes / (self.hardware.interconnect_bytes_per_s * self.broadcast_efficiency)

    def kv_capacity_tokens(self) -> int:
        """Tokens of KV cache one server can hold once its weights are loaded: what bounds how many
        requests it can run at once (max_running * mean context must fit)."""
        free = self.hardware.hbm_bytes * self.gpus_per_server * self.memory_fraction - self.model.weight_bytes
        return max(0, int(free / self.model.kv_bytes_per_token))


def algo_passes(recipe: Recipe) -> tuple[int, bool]:
    """(extra forward passes per token, whether a critic trains) for the recipe's algorithm: the
    CostModel's forward_passes and critic, one reading for the recipe's cost model
    (costs/recipe.py) and for calibration (sim/calibrate.py)."""
    algo = recipe.algo
    return int(algo.kl_coef > 0) + int(algo.recompute_logprobs), algo.name is AlgoName.PPO
