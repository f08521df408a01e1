"""The train and pipeline sections: the trainer, and how training and rollout interleave."""

from __future__ import annotations

from dataclasses import dataclass, field

from rlctl.recipe.checks import FieldError, Section, at_most, divides, positive, within
from rlctl.recipe.choices import (Admission, Device, InflightAtUpdate, MegatronAttention, MegatronDtype, PipelineMode, Recompute,
                                  RecomputeMethod, SyncBackend, TrainEngine)


TRAIN_BOUNDS = {
    "ranks": 16_384,
    "groups_per_batch": 65_536,
    "micro_batch_tokens": 1 << 24,
    "sync_bucket_mb": 16_384.0,
}
"""Upper bounds of the train section no real run reaches: 16,384 trainer ranks (GPUs), 65,536
groups per train batch (rollout.batch_size's own bound), 2^24 tokens per micro-batch, and a
16 GiB weight-sync bucket (each rank allocates one). They turn a typo into an error instead of a
machine brought down by the processes or memory it asks for. megatron.tp is at most 64 and
pipeline.max_staleness 1024, pipeline.sync_every 10^7 (run.steps' bound); lr is in (0, 1],
weight_decay in [0, 1], grad_clip in (0, 10^6]."""


@dataclass(kw_only=True)
class MegatronConfig(Section):
    """train.engine=megatron: how the Megatron-core model is parallelized."""

    tp: int = 1
    """Tensor-parallel size; train.ranks = tp x data-parallel size."""
    pp: int = 1
    """Pipeline-parallel size; only 1: the trainer's forward-backward runs one model chunk per
    rank, and the export and checkpoint paths gather TP shards only (docs/engines.md, "The
    Megatron trainer")."""
    dtype: MegatronDtype = MegatronDtype.BFLOAT16
    """Parameter dtype: bfloat16 (fp32 master weights in the optimizer) or float32."""
    attention: MegatronAttention = MegatronAttention.SDPA
    """Core attention. sdpa: torch's scaled_dot_product_attention (flash or memory-efficient
    kernels, causal, GQA; never the S x S scores). local: Megatron-core's unfused
    DotProductAttention, which keeps every layer's S x S scores for the backward pass (a 1.7B
    model runs out of an H200's memory at 8k tokens: results/gpu_long_samples.json). Transformer
    Engine is not used even where it is installed (docs/engines.md, "Long samples")."""
    recompute_granularity: Recompute = Recompute.FULL
    """Activation recompute, Megatron-core's recompute_granularity. full: keep only the input of
    every recompute_num_layers layers and run their forward again in the backward pass (about a
    third more compute; what long responses need). selective: recompute the core attention only
    (it saves memory with attention=local alone). none: keep every activation."""
    recompute_method: RecomputeMethod = RecomputeMethod.UNIFORM
    """full recompute, Megatron-core's recompute_method. uniform: every layer is in a recompute
    unit of recompute_num_layers layers. block: the first recompute_num_layers layers are
    recomputed and the rest keep their activations."""
    recompute_num_layers: int = 1
    """full recompute: layers per recompute unit (uniform) or layers recomputed (block); 1 to the
    model's number of layers."""

    def check(self) -> None:
        positive("tp", self.tp)
        at_most("tp", self.tp, 64)
        positive("recompute_num_layers", self.recompute_num_layers)
        at_most("recompute_num_layers", self.recompute_num_layers, 1024, "(layers)")
        if self.pp != 1:
            raise FieldError("pp", "pipeline parallelism is not supported yet; use pp=1 (and tp for large models)")


@dataclass(kw_only=True)
class TrainConfig(Section):
    engine: TrainEngine = TrainEngine.TORCH
    """torch (transformers model; gradients all-reduced across ranks) or megatron (Megatron-core
    GPTModel; CUDA only)."""
    ranks: int = 1
    """Data-parallel trainer processes (torch.distributed, gloo on CPU); at most 16,384 (TRAIN_BOUNDS)."""
    cpus: list[int] = field(default_factory=list)
    """Pin trainer ranks to these CPU cores (empty = no pinning)."""
    device: Device = Device.CPU
    """cpu or cuda (rank r uses cuda:r when there are enough GPUs)."""
    gpus: list[int] = field(default_factory=list)
    """Local launcher, device cuda: the GPUs the ranks use (rank r on gpus[r % len]); empty = cuda:r.
    Give trainers and servers different GPUs for a disaggregated run on one multi-GPU host."""
    lr: float = 1e-3
    """AdamW learning rate of the policy, in (0, 1]."""
    weight_decay: float = 0.0
    """AdamW weight decay of the policy, in [0, 1]."""
    groups_per_batch: int = 8
    """Groups per train batch (one optimizer step); must divide rollout.batch_size."""
    grad_clip: float = 1.0
    """The gradient's L2 norm is clipped to this before each optimizer step; in (0, 10^6]."""
    micro_batch_tokens: int = 8192
    """Most padded tokens per forward/backward; a train batch is split by length to fit."""
    sync_bucket_mb: float = 512.0
    """Size of one weight-sync bucket in MiB; at most 16,384 (TRAIN_BOUNDS). Each bucket is one
    HTTP announce (and one broadcast, or one IPC handle) per server; the sender keeps two pack
    buffers, grown to the largest bucket it packed (none for a broadcast of a bucket that is a
    slice of the trainer's parameters as they lie: rlctl/engines/weightsync/flat.py; IPC always
    packs, into a buffer tagged for the server's check: docs/security.md)."""
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    sync_backend: SyncBackend = SyncBackend.AUTO
    """How weights reach the servers: gloo (a broadcast from host memory), nccl (a broadcast GPU to
    GPU, one GPU per rank), ipc (handed over in place to servers on the trainer's own GPU or, on
    CPU, host: CUDA IPC or shared memory; TP-1 servers), or auto: ipc when every server shares
    the trainer's GPU, nccl when trainers and servers are on GPUs of different nodes
    (launcher=slurm), else gloo."""

    def check(self) -> None:
        for name in ("ranks", "groups_per_batch", "micro_batch_tokens", "sync_bucket_mb"):
            positive(name, getattr(self, name))
        for name, high in TRAIN_BOUNDS.items():
            at_most(name, getattr(self, name), high)
        within("lr", self.lr, 0.0, 1.0, open_low=True)
        within("weight_decay", self.weight_decay, 0.0, 1.0)
        within("grad_clip", self.grad_clip, 0.0, 1e6, open_low=True)
        if any(g < 0 for g in self.gpus):
            raise FieldError("gpus", f"GPU indices are >= 0, got {self.gpus}")
        if self.engine is not TrainEngine.MEGATRON:
            return
        divides("megatron.tp", self.megatron.tp, "train.ranks", self.ranks, "ranks = tp x data parallel")
        if self.device is not Device.CUDA:
            raise FieldError("device", "Megatron trains on GPUs only; set train.device=cuda (or train.engine=torch on CPU)")


@dataclass(kw_only=True)
class PipelineConfig(Section):
    mode: PipelineMode = PipelineMode.SYNC
    """sync: generate the rollout batch, then train, then broadcast weights.
    rolloutpipe: weights fixed per rollout batch, but each complete group goes to the trainer at
    once and a train batch starts as soon as it is full. async: rollout never stops; samples carry
    their weight version and at most max_staleness versions of lag are trained."""
    admission: Admission = Admission.FIFO
    """Order and amount of requests sent to the servers. fifo: the whole rollout batch at once,
    in group order (the servers queue what they cannot run). frontier: at most
    rollout.concurrency per server, groups needed for the next train batch first. longest:
    frontier, and within a train batch the requests whose prompts ran longest before first
    (a dataset read for several epochs; a prompt never seen, as a built-in task's are, is
    expected at the run's mean, so the order is frontier's). frontier and longest order only
    what waits: with rollout.concurrency x servers at least a step's requests, all go out at once."""
    stream_train: bool = True
    """rolloutpipe: the trainer runs forward and backward on each complete group as soon as it
    is free (gradient accumulation) and takes the optimizer step when the train batch is full,
    instead of waiting for the whole train batch first. The step is the same either way."""
    max_staleness: int = 1
    """async: the most weight versions a trained sample may lag behind the trainer."""
    sync_every: int = 1
    """async: optimizer steps between weight broadcasts."""
    check_weights: bool = False
    """After every weight sync, compare the sha256 of every tensor on each server with the
    trainer's, and fail the run on a difference (built-in servers; slow: for tests)."""
    inflight_at_update: InflightAtUpdate = InflightAtUpdate.FINISH
    """async: what happens to requests in flight at a weight update. finish: they complete on the
    old weights (tagged with that version). abort_resume: they are aborted and resumed on the new
    weights from where they stopped (partial rollout; a sample then spans versions)."""

    def check(self) -> None:
        positive("max_staleness", self.max_staleness, zero_ok=True)
        at_most("max_staleness", self.max_staleness, 1024, "(versions of lag)")
        positive("sync_every", self.sync_every)
        at_most("sync_every", self.sync_every, 10_000_000)
