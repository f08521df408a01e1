"""`train.engine: megatron`: a Megatron-core GPTModel trained with the same GRPO loss as the torch
engine (pip install 'rlctl[megatron]'; needs CUDA: Megatron's DDP and optimizer refuse CPU tensors).

The model is built from the HF config (local layer spec: RMSNorm, SwiGLU, GQA, rope, tied
embeddings; qk-norm for Qwen3, q/k/v biases for Qwen2 through add_qkv_bias), loaded from the HF
safetensors through rlctl/engines/train/megatron_convert.py, wrapped in Megatron's
DistributedDataParallel with the distributed optimizer, and trained through Megatron's
forward-backward schedule. Per-token log-probs come from vocab-parallel cross entropy. Loading is
strict: an HF tensor the mapping does not use, or a Megatron parameter no HF tensor fills, stops
the trainer with one line naming them; so does a model feature the mapping cannot express
(Layout.from_hf_config: o_proj or MLP biases, sliding-window attention, rope scaling, an
activation other than SiLU). `hf_weights()` gathers TP shards and returns HF names for the weight
broadcast, on the (dp 0, tp 0) rank. Tensor parallel and data parallel sizes come from the recipe
(train.ranks = tp x dp); pipeline parallelism is not supported yet.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from rlctl.algos.grpo import clipped_policy_loss
from rlctl.engines.train import ckpt_files
from rlctl.engines.train.base import PieceTraining, TrainSample, new_accumulator, padded_batch
from rlctl.engines.train.megatron_memory import MegatronMemory
from rlctl.engines.train.megatron_convert import (Layout, check_mcore_names, gather, hf_to_mcore, iter_mcore_to_hf,
                                                  shard, tp_dim)
from rlctl.errors import RunError
from rlctl.recipe import MegatronDtype, TrainConfig

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig
    from transformers import PretrainedConfig


def load_hf_state(model_path: str) -> dict[str, torch.Tensor]:
    """Every tensor of the model directory's safetensors files, by HF name (on the CPU)."""
    from pathlib import Path

    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in sorted(Path(model_path).glob("*.safetensors")):
        state.update(load_file(str(f)))
    if not state:
        raise RunError(f"{model_path}: no *.safetensors files; train.engine=megatron loads the weights from them")
    return state


class MegatronTrainEngine(PieceTraining, MegatronMemory):
    def __init__(self, model_path: str, cfg: TrainConfig, temperature: float, rank: int, world_size: int,
                 device: str = "cuda", init_method: str | None = None) -> None:
        from transformers import AutoConfig

        self.cfg, self.temperature = cfg, temperature
        self.model_path = model_path
        self.rank, self.world_size = rank, world_size
        hf_cfg = AutoConfig.from_pretrained(model_path)
        self.layout = Layout.from_hf_config(hf_cfg)  # refuses what it cannot map, before any GPU work
        self._init_parallel(device, init_method)
        if self.layout.vocab_size % self.tp_size:
            raise RunError(f"vocab size {self.layout.vocab_size} does not split over {self.tp_size} TP ranks; "
                           "set train.megatron.tp to a divisor of it")
        self.dtype = torch.bfloat16 if cfg.megatron.dtype is MegatronDtype.BFLOAT16 else torch.float32
        self.tconfig = self._transformer_config(hf_cfg)
        model = self._build_model(hf_cfg)
        self._load_hf(model, load_hf_state(model_path))
        self._wrap_for_training(model)
        self.pad_id = hf_cfg.pad_token_id or 0
        self.collective_export = self.tp_size > 1  # hf_weights() all-gathers over the TP group
        self.version = 0
        self._acc = new_accumulator()
        self.ddp.zero_grad_buffer()

    # -- construction -------------------------------------------------------------------------

    def _init_parallel(self, device: str, init_method: str | None) -> None:
        """The NCCL default group (unless the caller made one) and Megatron's TP x DP groups."""
        from megatron.core import parallel_state, tensor_parallel

        torch.cuda.set_device(torch.device(device).index or 0)
        if not dist.is_initialized():
            dist.init_process_group("nccl", init_method=init_method or "env://", rank=self.rank,
                                    world_size=self.world_size)
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=self.cfg.megatron.tp,
                                                 pipeline_model_parallel_size=1)
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.tp_size = self.cfg.megatron.tp
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()

    def _transformer_config(self, hf_cfg: PretrainedConfig) -> TransformerConfig:
        """The HF architecture in Megatron's terms; fusions and dropout off, so that the forward
        pass computes what the HF model (and the rollout server) computes."""
        from megatron.core.transformer import TransformerConfig

        L = self.layout
        return TransformerConfig(
            num_layers=L.num_layers, hidden_size=L.hidden_size, num_attention_heads=L.num_heads,
            num_query_groups=L.num_kv_heads, kv_channels=L.head_dim, ffn_hidden_size=L.ffn_hidden_size,
            normalization="RMSNorm", layernorm_epsilon=hf_cfg.rms_norm_eps, gated_linear_unit=True,
            activation_func=torch.nn.functional.silu, add_bias_linear=False, add_qkv_bias=L.qkv_bias,
            qk_layernorm=L.qk_norm, hidden_dropout=0.0, attention_dropout=0.0, bf16=self.dtype == torch.bfloat16,
            params_dtype=self.dtype, pipeline_dtype=self.dtype, tensor_model_parallel_size=self.tp_size,
            attention_softmax_in_fp32=True, apply_rope_fusion=False, bias_dropout_fusion=False,
            masked_softmax_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        )

    def _build_model(self, hf_cfg: PretrainedConfig) -> GPTModel:
        """An uninitialized GPTModel on this GPU with the local layer spec (no Transformer Engine)."""
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        L = self.layout
        return GPTModel(
            config=self.tconfig,
            transformer_layer_spec=get_gpt_layer_local_spec(qk_layernorm=L.qk_norm, normalization="RMSNorm"),
            vocab_size=L.vocab_size, max_sequence_length=hf_cfg.max_position_embeddings,
            pre_process=True, post_process=True, parallel_output=True,
            share_embeddings_and_output_weights=L.tied, position_embedding_type="rope",
            rotary_base=int(getattr(hf_cfg, "rope_theta", None) or hf_cfg.rope_parameters["rope_theta"]),
        ).cuda()

    def _wrap_for_training(self, model: GPTModel) -> None:
        """Megatron's DDP with the distributed optimizer around the loaded model."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        cfg, bf16 = self.cfg, self.dtype == torch.bfloat16
        self.ddp = DistributedDataParallel(
            self.tconfig, DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True,
                                                        overlap_grad_reduce=False), module=model)
        self.model = model
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=cfg.lr, weight_decay=cfg.weight_decay, bf16=bf16,
                            params_dtype=self.dtype, use_distributed_optimizer=True, clip_grad=cfg.grad_clip,
                            adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8),
            [self.ddp])
        # Gradients are reduced once per optimizer step, in step(), not at the end of every
        # forward-backward call: a train batch may arrive in several accumulate() calls.
        self.tconfig.finalize_model_grads_func = None
        self.tconfig.no_sync_func = self.ddp.no_sync
        self.tconfig.grad_scale_func = self.optimizer.scale_loss

    # -- weights ------------------------------------------------------------------------------

    def _load_hf(self, model, hf: dict[str, torch.Tensor]) -> None:
        """Every parameter of the model from the HF tensors; hf_to_mcore refuses HF tensors it does
        not use, and every Megatron parameter must be filled (and every mapped tensor used)."""
        full = hf_to_mcore(hf, self.layout)
        params = dict(model.named_parameters())
        check_mcore_names(params, self.layout, "the Megatron model built from the HF config")
        with torch.no_grad():
            for name, p in params.items():
                part = shard(name, full[name], self.tp_rank, self.tp_size)
                if part.shape != p.shape:
                    raise RunError(f"{name}: HF gives {tuple(part.shape)}, the model has {tuple(p.shape)}")
                p.copy_(part.to(p.dtype))

    def _full(self, name: str, p: torch.Tensor) -> torch.Tensor:
        """One full Megatron tensor: its TP shards all-gathered (every TP rank takes part)."""
        t = p.detach()
        if self.tp_size > 1 and tp_dim(name) is not None:
            parts = [torch.empty_like(t) for _ in range(self.tp_size)]
            dist.all_gather(parts, t.contiguous(), group=self.tp_group)
            t = gather(name, parts)
        return t

    def hf_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """HF-named full tensors, gathered one layer at a time as they are iterated (no full copy
        of the model at any time); every TP rank must iterate it to the end."""
        params = dict(self.model.named_parameters())
        check_mcore_names(params, self.layout, "the Megatron model")
        return iter_mcore_to_hf(lambda name: self._full(name, params[name]), self.layout)

    # -- checkpoints ---------------------------------------------------------------------------
    # Model and distributed optimizer through megatron.core.dist_checkpointing (every rank writes
    # its shards; the optimizer's dp_reshardable format: no gathers, same TP on load), plus the
    # policy exported as an HF directory for serving and `rlctl export`. Written against
    # megatron-core 0.19.2; needs CUDA, so it is exercised on GPU machines only.

    DIST_OPTIM = {"distrib_optim_sharding_type": "dp_reshardable"}

    def _sharded_state(self, is_loading: bool) -> dict[str, Any]:
        """Megatron-LM's layout: {"model": ..., "optimizer": ...}; the optimizer's sharded state is
        matched to the model's ShardedTensors (which hold the parameters themselves)."""
        state: dict[str, Any] = {"model": self.model.sharded_state_dict()}
        if is_loading:  # a fresh distributed optimizer has no Adam state to load into yet (without
            # Apex/TE its state_dict() needs a step): Megatron's own dummy step makes it; the load
            # then replaces it, and the parameters, in place.
            for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
                if not opt.optimizer.state:
                    opt._init_optimizer_states_with_dummy_values()
        state["optimizer"] = self.optimizer.sharded_state_dict(state, is_loading=is_loading, metadata=self.DIST_OPTIM)
        return state

    def save_checkpoint(self, path: str) -> dict[str, float]:
        from megatron.core import dist_checkpointing, tensor_parallel

        root = Path(path)
        dist_dir = root / ckpt_files.TRAINER_DIR / "megatron"
        if self.dp_rank == 0:  # rank 0's TP group rebuilds the full tensors; rank 0 writes them
            weights = list(self.hf_weights())
            if self.rank == 0:
                ckpt_files.write_safetensors(weights, root / ckpt_files.HF_DIR)
                ckpt_files.copy_model_files(self.model_path, root / ckpt_files.HF_DIR, with_config=True)
                dist_dir.mkdir(parents=True, exist_ok=True)
            del weights
        dist.barrier()
        dist_checkpointing.save(self._sharded_state(is_loading=False), str(dist_dir))
        ckpt_files.save_rng(root, self.rank, megatron_cuda=tensor_parallel.get_cuda_rng_tracker().get_states())
        if self.rank == 0:
            ckpt_files.write_engine_info(root, engine="megatron", version=self.version, ranks=self.world_size,
                                         tp=self.tp_size, dp=self.dp_size)
        dist.barrier()
        return {"version": float(self.version)}

    def load_checkpoint(self, path: str) -> dict[str, float]:
        from megatron.core import dist_checkpointing, tensor_parallel

        root = Path(path)
        info = ckpt_files.read_engine_info(root)
        if info.get("engine") != "megatron" or info.get("tp") != self.tp_size:
            raise RunError(f"{root}: written by the {info.get('engine')} engine with TP {info.get('tp')}; "
                           f"this trainer is megatron with TP {self.tp_size}")
        with torch.no_grad():  # the optimizer's fp32 shards are views of parameters that need grad
            loaded = dist_checkpointing.load(self._sharded_state(is_loading=True),
                                             str(root / ckpt_files.TRAINER_DIR / "megatron"))
            self.model.load_state_dict(loaded["model"])
            self.optimizer.load_state_dict(loaded["optimizer"])
            _own_step_counters(self.optimizer)
        rng = ckpt_files.load_rng(root, self.rank)
        tensor_parallel.get_cuda_rng_tracker().set_states(rng["megatron_cuda"])
        self.version = int(info["version"])
        self._acc = new_accumulator()
        self.ddp.zero_grad_buffer()
        return {"version": float(self.version)}

    # -- compute ------------------------------------------------------------------------------

    def _batch(self, samples: list[TrainSample]):
        ids, mask, old, adv, _ = padded_batch(samples, self.pad_id)  # right padding: the causal mask suffices
        return ids.cuda(), mask.cuda(), old.cuda(), adv.cuda()

    def _token_logprobs(self, ids: torch.Tensor) -> torch.Tensor:
        """log p(ids[:, t+1] | ids[:, :t+1]) under the current weights, [B, T-1], via the
        vocab-parallel cross entropy (each TP rank holds a slice of the vocabulary)."""
        from megatron.core import tensor_parallel

        positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand_as(ids)
        logits = self.ddp(ids, positions, None)  # [B, T, V / tp]; causal mask, right padding
        logits = logits[:, :-1].float()
        if self.temperature not in (0.0, 1.0):
            logits = logits / self.temperature
        return -tensor_parallel.vocab_parallel_cross_entropy(logits.contiguous(), ids[:, 1:].contiguous())

    def logprobs(self, samples: list[TrainSample]) -> list[list[float]]:
        ids, mask, _, _ = self._batch(samples)
        with torch.no_grad():
            lp = self._token_logprobs(ids)
        return [lp[i, len(s.prompt_ids) - 1 : len(s.prompt_ids) - 1 + len(s.response_ids)].tolist()
                for i, s in enumerate(samples)]

    def accumulate(self, samples: list[TrainSample]) -> dict[str, float]:
        """Forward and backward through Megatron's schedule on this DP rank's share of the samples.
        The loss is the token sum; gradients stay in the DDP grad buffers until step(). A DP rank
        with no share skips the call: without overlapped reduction, DP ranks do not talk in
        backward, and TP peers hold the same share, so they skip together."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        start = time.monotonic()
        mine = samples[self.dp_rank :: self.dp_size]
        micro = self.micro_batches(mine)
        acc = self._acc

        def forward_step(data_iterator, model):
            ids, mask, old, adv = self._batch(next(data_iterator))
            lp = self._token_logprobs(ids)

            def loss_func(_output):
                loss, pstats = clipped_policy_loss(lp, old, adv, mask, self.cfg.clip_eps, 1.0)
                n = float(mask.sum())
                acc["loss"] += float(loss.detach())
                acc["clip_tokens"] += pstats["clip_frac"] * n
                acc["logprob_diff"] += float(((lp.detach() - old).abs() * mask).sum())
                acc["tokens"] += n
                # The schedule divides by the number of micro-batches; undo it, the loss is a sum.
                return loss * len(micro), {"loss": loss.detach()}

            return lp, loss_func

        if micro:
            get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter(micro), model=[self.ddp],
                num_microbatches=len(micro), seq_length=max(s.length for s in mine),
                micro_batch_size=max(len(m) for m in micro), forward_only=False)
        return self._piece_done(samples, micro, start)

    def step(self) -> dict[str, float]:
        """Reduce the accumulated gradients over DP ranks (Megatron's finalize: reduce-scatter for
        the distributed optimizer, scaled by 1/dp), rescale them to the token mean of the whole
        batch, and take the optimizer step."""
        from megatron.core.distributed import finalize_model_grads

        start = time.monotonic()
        acc, self._acc = self._acc, new_accumulator()
        total_tokens = max(acc["batch_tokens"], 1.0)
        finalize_model_grads([self.ddp])
        self.ddp.scale_gradients(self.dp_size / total_tokens)
        ok, grad_norm, _ = self.optimizer.step()
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        self.version += 1
        packed = torch.tensor([acc["loss"], acc["clip_tokens"], acc["logprob_diff"], acc["tokens"]], device="cuda")
        if self.dp_size > 1:
            from megatron.core import parallel_state

            dist.all_reduce(packed, group=parallel_state.get_data_parallel_group())
        loss, clip_tokens, diff, tokens = packed.tolist()
        return {
            "loss": loss / total_tokens, "kl": 0.0, "clip_frac": clip_tokens / max(tokens, 1.0),
            "logprob_diff": diff / max(tokens, 1.0), "grad_norm": float(grad_norm or 0.0), "tokens": acc["batch_tokens"],
            "samples": acc["samples"], "micro_batches": acc["micro_batches"],
            "seconds": acc["seconds"] + time.monotonic() - start, "version": float(self.version),
            "update_ok": float(bool(ok)),
        }


def _own_step_counters(optimizer) -> None:
    """Give every parameter's Adam state its own `step` tensor. Without Apex or Transformer Engine,
    megatron-core's DistributedOptimizer.load_state_dict (0.19.2) puts ONE step tensor into every
    parameter's state; torch's Adam then adds 1 to it once per parameter in each step, so the
    bias correction of a resumed run is off (19 parameters: step 1 counted as 20, updates about a
    third smaller; scripts/gpu_checks.py --only checkpoint measures the next step against a run
    that never stopped)."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in opt.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()
