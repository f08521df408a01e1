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
(train.ranks = tp x dp).

The objective is the torch engine's (rlctl/algos/objective.py), every algo knob of it. The KL
reference and the behaviour copies (recompute_logprobs) are further GPTModels loaded from the
same HF weights, frozen and outside DDP; PPO's critic is rlctl/engines/train/megatron_critic.py. The
weight version counts optimizer steps that updated the weights: a step Megatron's optimizer skips
(a non-finite gradient) leaves it, and the weights, as they were.

Pipeline parallelism is not supported yet: the forward-backward here runs one model chunk per
rank, the reference and log-prob passes read the logits on every rank, and the HF export and
checkpoint gather TP shards only; a PP stage would need each of those split by stage.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from rlctl.algos.losses import kl_penalty, loss_normalizer
from rlctl.algos.objective import SUM_KEYS, Objective, Prepared
from rlctl.engines.train.base import PieceTraining, TrainSample, new_accumulator, padded_batch
from rlctl.engines.train.megatron_ckpt import MegatronCheckpoint
from rlctl.engines.train.megatron_layers import layer_spec, recompute_options, transformer_engine_note
from rlctl.engines.train.megatron_memory import MegatronMemory
from rlctl.engines.train.megatron_optim import optimizer_step, wrap_for_training
from rlctl.engines.train.behaviour import Behaviour
from rlctl.engines.train.megatron_convert import (BACKBONE_ONLY, Layout, check_mcore_names, gather, hf_to_mcore, iter_mcore_to_hf,
                                                  shard, tp_dim)
from rlctl.errors import RunError
from rlctl.recipe import AlgoConfig, KlIn, MegatronDtype, TrainConfig

ENTROPY_CHUNK = 4096
"""Positions per entropy pass: 4096 x a 152k vocabulary is 2.5 GB of fp32 temporaries."""

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


class MegatronTrainEngine(PieceTraining, MegatronMemory, MegatronCheckpoint):
    def __init__(self, model_path: str, cfg: TrainConfig, temperature: float, rank: int, world_size: int,
                 device: str = "cuda", init_method: str | None = None, algo: AlgoConfig | None = None,
                 behaviour_versions: int = 1) -> None:
        from transformers import AutoConfig

        self.cfg, self.temperature = cfg, temperature
        self.algo = algo = algo or AlgoConfig()
        self.objective = Objective(algo)
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
        if note := transformer_engine_note(cfg.megatron.attention):
            logging.getLogger("rlctl.trainer").info(note)
        model = self._build_model(hf_cfg)
        hf_state = load_hf_state(model_path)
        self._load_hf(model, hf_state)
        self._wrap_for_training(model)
        self._build_companions(hf_cfg, hf_state, behaviour_versions)
        del hf_state
        self.pad_id = hf_cfg.pad_token_id or 0
        self.collective_export = self.tp_size > 1  # hf_weights() all-gathers over the TP group
        self.version = 0
        self._acc = new_accumulator()
        self.ddp.zero_grad_buffer()
        self.mark_behaviour(0)

    def _build_companions(self, hf_cfg: PretrainedConfig, hf_state: dict[str, torch.Tensor], keep: int) -> None:
        """What the algo needs besides the policy, each a model of its own on this GPU: the KL's
        reference (the initial weights, frozen), the policy's behaviour copies
        (recompute_logprobs), PPO's critic (with its own behaviour copies)."""
        from rlctl.engines.train.megatron_critic import MegatronCritic

        self.ref_model = self.behaviour = self.critic = None
        if self.algo.needs_reference:
            self.ref_model = self._frozen(hf_cfg, hf_state)
        if self.algo.recompute_logprobs:
            self.behaviour = Behaviour(self.model, keep, shadow=self._frozen(hf_cfg, hf_state))
        if self.algo.ppo:
            self.critic = MegatronCritic(self, hf_cfg, hf_state, self.algo.critic_lr, keep)

    def _frozen(self, hf_cfg: PretrainedConfig, hf_state: dict[str, torch.Tensor]) -> GPTModel:
        model = self._build_model(hf_cfg)
        self._load_hf(model, hf_state)
        return model.eval().requires_grad_(False)

    # -- construction -------------------------------------------------------------------------

    def _init_parallel(self, device: str, init_method: str | None) -> None:
        """The NCCL default group (unless the caller made one) and Megatron's TP x DP groups."""
        from megatron.core import parallel_state, tensor_parallel

        torch.cuda.set_device(torch.device(device).index or 0)
        self.device = torch.device("cuda", torch.cuda.current_device())
        """This rank's GPU: where the service measures peak_gib and a vLLM weight group sends from."""
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
            **recompute_options(self.cfg.megatron, L.num_layers),
        )

    def _build_model(self, hf_cfg: PretrainedConfig, post_process: bool = True) -> GPTModel:
        """An uninitialized GPTModel on this GPU with the local layer spec (no Transformer Engine)
        and train.megatron.attention's core attention; post_process=False: without its final norm
        and output layer (a critic's backbone). The policy, its reference and behaviour copies
        and the critic are all built here, so all of them attend and recompute alike."""
        from megatron.core.models.gpt import GPTModel

        L = self.layout
        return GPTModel(
            config=self.tconfig,
            transformer_layer_spec=layer_spec(L.qk_norm, self.cfg.megatron.attention),
            vocab_size=L.vocab_size, max_sequence_length=hf_cfg.max_position_embeddings,
            pre_process=True, post_process=post_process, parallel_output=True,
            share_embeddings_and_output_weights=L.tied and post_process, position_embedding_type="rope",
            rotary_base=int(getattr(hf_cfg, "rope_theta", None) or hf_cfg.rope_parameters["rope_theta"]),
        ).cuda()

    def _wrap_for_training(self, model: GPTModel) -> None:
        self.model = model
        self.ddp, self.optimizer = wrap_for_training(model, self.tconfig, self.cfg, self.dtype, self.cfg.lr)

    # -- weights ------------------------------------------------------------------------------

    def _load_hf(self, model, hf: dict[str, torch.Tensor], backbone_only: bool = False) -> None:
        """Every parameter of the model from the HF tensors; hf_to_mcore refuses HF tensors it does
        not use, and every Megatron parameter must be filled (and every mapped tensor used)."""
        full = hf_to_mcore(hf, self.layout)
        params = dict(model.named_parameters())
        without = BACKBONE_ONLY if backbone_only else ()
        check_mcore_names(params, self.layout, "the Megatron model built from the HF config", without)
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

    # -- compute ------------------------------------------------------------------------------

    def _batch(self, samples: list[TrainSample]):
        ids, mask, old, adv, _, rewards = padded_batch(samples, self.pad_id)  # right padding: the causal mask suffices
        return ids.cuda(), mask.cuda(), old.cuda(), adv.cuda(), rewards.cuda()

    def _logits(self, ids: torch.Tensor, model=None) -> torch.Tensor:
        """Logits at the sampling temperature, [B, T-1, V / tp] (each TP rank a vocabulary slice)."""
        positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand_as(ids)
        logits = (model or self.ddp)(ids, positions, None)[:, :-1].float()  # causal mask, right padding
        # In place: the fp32 copy is new, and dividing by a number needs no saved input. At 32k
        # tokens and a 152k vocabulary one fp32 copy of the logits is 20 GB.
        return logits.div_(self.temperature) if self.temperature not in (0.0, 1.0) else logits

    def _token_logprobs(self, ids: torch.Tensor, logits: torch.Tensor | None = None) -> torch.Tensor:
        """log p(ids[:, t+1] | ids[:, :t+1]), [B, T-1], via the vocab-parallel cross entropy."""
        from megatron.core import tensor_parallel

        logits = self._logits(ids) if logits is None else logits
        return -tensor_parallel.vocab_parallel_cross_entropy(logits.contiguous(), ids[:, 1:].contiguous())

    def _entropy(self, logits: torch.Tensor) -> torch.Tensor:
        """Per-position entropy over the whole vocabulary: log Z - E_p[z], from the TP slices,
        ENTROPY_CHUNK positions at a time (the temporaries of the whole sequence at once would be
        two more fp32 copies of the logits)."""
        with torch.no_grad():
            flat = logits.reshape(-1, logits.shape[-1])
            out = torch.empty(flat.shape[0], device=logits.device, dtype=torch.float32)
            for start in range(0, flat.shape[0], ENTROPY_CHUNK):
                out[start : start + ENTROPY_CHUNK] = self._entropy_rows(flat[start : start + ENTROPY_CHUNK])
            return out.view(logits.shape[:-1])

    def _entropy_rows(self, rows: torch.Tensor) -> torch.Tensor:
        top = rows.max(-1, keepdim=True).values
        if self.tp_size > 1:
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=self.tp_group)
        e = torch.exp(rows - top)
        parts = torch.cat([e.sum(-1, keepdim=True), (e * rows).sum(-1, keepdim=True)], -1)
        if self.tp_size > 1:
            dist.all_reduce(parts, group=self.tp_group)
        return top.squeeze(-1) + parts[..., 0].log() - parts[..., 1] / parts[..., 0]

    def _ref_logprobs(self, ids: torch.Tensor) -> torch.Tensor | None:
        if self.ref_model is None:
            return None
        with torch.no_grad():
            return self._token_logprobs(ids, self._logits(ids, self.ref_model))

    def logprobs(self, samples: list[TrainSample]) -> list[list[float]]:
        ids = self._batch(samples)[0]
        with torch.no_grad():
            lp = self._token_logprobs(ids)
        return [lp[i, len(s.prompt_ids) - 1 : len(s.prompt_ids) - 1 + len(s.response_ids)].tolist()
                for i, s in enumerate(samples)]

    def _reward_kl(self, samples: list[TrainSample]) -> list[float]:
        """Each sample's KL to the reference, summed over its response tokens, for kl_shaped()."""
        ids, mask, server, _, _ = self._batch(samples)
        kl = kl_penalty(server, self._ref_logprobs(ids), self.algo.kl_estimator)
        return (kl * mask).sum(-1).tolist()

    def _prepare(self, mb: list[TrainSample], ids, mask, server, adv, rewards) -> Prepared:
        """The micro-batch's fixed loss inputs (no gradients): the reference's log-probs, the
        behaviour weights' (recompute_logprobs), the behaviour critic's values (PPO)."""
        recomputed = old_values = None
        with torch.no_grad():
            if self.behaviour is not None:
                recomputed = self.at_versions(self.behaviour, mb, lambda m, r: self._token_logprobs(
                    ids[r], self._logits(ids[r], m)), "cuda")
            if self.critic is not None:
                old_values = self.at_versions(self.critic.behaviour, mb, lambda m, r: m(ids[r]), "cuda")
        return self.objective.prepare(mask, server, adv, rewards, recomputed, self._ref_logprobs(ids), old_values)

    def accumulate(self, samples: list[TrainSample]) -> dict[str, float]:
        """Forward and backward through Megatron's schedule on this DP rank's share of the samples.
        The loss is a sum (rlctl/algos/objective.py); gradients stay in the DDP grad buffers until
        step(). A DP rank with no share skips the call: without overlapped reduction, DP ranks do
        not talk in backward, and TP peers hold the same share, so they skip together."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        start = time.monotonic()
        if self.ref_model is not None and self.algo.kl_in is KlIn.REWARD:
            samples = self.kl_shaped(samples)
        mine = samples[self.dp_rank :: self.dp_size]
        micro = self.micro_batches(mine)
        acc = self._acc

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            ids, mask, server, adv, rewards = self._batch(mb)
            prep = self._prepare(mb, ids, mask, server, adv, rewards)
            if self.critic is not None:  # its own forward and backward, into its own DDP buffers
                self.objective.value_loss(self.critic.values(ids), prep, acc).backward()
            logits = self._logits(ids)
            lp = self._token_logprobs(ids, logits)
            entropy = self._entropy(logits)

            def loss_func(_output):
                loss = self.objective.policy_loss(lp, prep, acc, entropy)
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
        the distributed optimizer, scaled by 1/dp), rescale them to the batch's loss normalizer,
        and take the optimizer step. A step whose gradients are not finite anywhere is skipped on every
        rank (weights, optimizer state and version stay; update_ok 0)."""
        start = time.monotonic()
        acc, self._acc = self._acc, new_accumulator()
        normalizer = loss_normalizer(self.algo.loss_agg, acc["batch_tokens"], acc["samples"])
        ok, grad_norm = optimizer_step(self.model, self.ddp, self.optimizer, self.dp_size / normalizer)
        if ok:
            self.version += 1
        extra = {"critic_grad_norm": self.critic.step(normalizer)} if self.critic is not None else {}
        packed = torch.tensor([acc[k] for k in SUM_KEYS], device="cuda", dtype=torch.float64)
        if self.dp_size > 1:
            from megatron.core import parallel_state

            dist.all_reduce(packed, group=parallel_state.get_data_parallel_group())
        stats = self.objective.finish(dict(zip(SUM_KEYS, packed.tolist())), normalizer)
        return {
            **stats, **extra, "grad_norm": grad_norm, "tokens": acc["batch_tokens"],
            "samples": acc["samples"], "micro_batches": acc["micro_batches"],
            "seconds": acc["seconds"] + time.monotonic() - start, "version": float(self.version),
            "update_ok": float(bool(ok)),
        }

