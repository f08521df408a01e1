"""`train.engine: torch`: a transformers causal LM trained with GRPO, data parallel over ranks.

Each rank holds the whole model (DDP over gloo on CPU, NCCL on GPUs). A train batch is split
across ranks sample by sample; every rank normalizes its loss by the token count of the whole
train batch, so the averaged gradient is the token-mean gradient of the batch whatever the split.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Iterable

import torch
import torch.distributed as dist

from rlctl.algos.grpo import clipped_policy_loss, k3_kl, token_logprobs
from rlctl.engines.train.base import TrainSample, padded_batch, split_by_tokens
from rlctl.recipe import TrainConfig


class TorchTrainEngine:
    def __init__(self, model_path: str, cfg: TrainConfig, temperature: float, rank: int, world_size: int,
                 device: str = "cpu") -> None:
        from transformers import AutoModelForCausalLM

        self.cfg = cfg
        self.temperature = temperature
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(self.device)
        self.model.train()
        self.ref_model = None
        if cfg.kl_coef > 0:
            self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.pad_id = self.model.config.pad_token_id or 0
        self.ddp = None
        if world_size > 1:
            ids = [self.device.index] if self.device.type == "cuda" else None
            self.ddp = torch.nn.parallel.DistributedDataParallel(self.model, device_ids=ids)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.version = 0

    def _forward_model(self):
        return self.ddp if self.ddp is not None else self.model

    def _batch_tensors(self, samples: list[TrainSample]):
        """Right-padded ids, attention mask, response mask, behaviour logprobs, advantages."""
        ids, mask, old, adv, lengths = padded_batch(samples, self.pad_id)
        attn = (torch.arange(ids.shape[1])[None, :] < lengths[:, None]).long()
        return ids.to(self.device), attn.to(self.device), mask.to(self.device), old.to(self.device), adv.to(self.device)

    def logprobs(self, samples: list[TrainSample]) -> list[list[float]]:
        """Per response token log-probs under the current weights (no grad)."""
        ids, attn, mask, _, _ = self._batch_tensors(samples)
        with torch.no_grad():
            lp = token_logprobs(self.model(input_ids=ids, attention_mask=attn).logits[:, :-1], ids[:, 1:], self.temperature)
        out = []
        for i, s in enumerate(samples):
            start = len(s.prompt_ids) - 1
            out.append(lp[i, start : start + len(s.response_ids)].tolist())
        return out

    def micro_batches(self, samples: list[TrainSample]) -> list[list[TrainSample]]:
        return split_by_tokens(samples, self.cfg.micro_batch_tokens)

    def train_batch(self, samples: list[TrainSample]) -> dict[str, float]:
        start = time.monotonic()
        total_tokens = sum(len(s.response_ids) for s in samples)
        # DDP averages gradients over ranks; scale back up so the result is the batch's token mean.
        normalizer = total_tokens / self.world_size
        micro = self.micro_batches(samples[self.rank :: self.world_size])
        self.optimizer.zero_grad(set_to_none=True)
        sums = {"loss": 0.0, "clip_tokens": 0.0, "kl": 0.0, "logprob_diff": 0.0, "tokens": 0.0}
        for i, mb in enumerate(micro):
            last = i == len(micro) - 1
            # Gradients are all-reduced once, after the last micro-batch.
            sync = self.ddp.no_sync() if (self.ddp is not None and not last) else contextlib.nullcontext()
            with sync:
                ids, attn, mask, old, adv = self._batch_tensors(mb)
                logits = self._forward_model()(input_ids=ids, attention_mask=attn).logits[:, :-1]
                lp = token_logprobs(logits, ids[:, 1:], self.temperature)
                loss, pstats = clipped_policy_loss(lp, old, adv, mask, self.cfg.clip_eps, normalizer)
                if self.ref_model is not None:
                    with torch.no_grad():
                        ref_logits = self.ref_model(input_ids=ids, attention_mask=attn).logits[:, :-1]
                        ref_lp = token_logprobs(ref_logits, ids[:, 1:], self.temperature)
                    kl = (k3_kl(lp, ref_lp) * mask).sum() / normalizer
                    loss = loss + self.cfg.kl_coef * kl
                    sums["kl"] += kl.item() / self.world_size
                loss.backward()
            n = float(mask.sum())
            sums["loss"] += loss.item() / self.world_size  # per-rank share; the all-reduce sums them
            sums["clip_tokens"] += pstats["clip_frac"] * n
            sums["logprob_diff"] += float(((lp.detach() - old).abs() * mask).sum())
            sums["tokens"] += n
        if not micro and self.ddp is not None:
            # A rank with no samples must still join DDP's gradient all-reduce.
            (sum(p.sum() for p in self.model.parameters()) * 0.0).backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        self.version += 1
        packed = torch.tensor([sums["loss"], sums["kl"], sums["clip_tokens"], sums["logprob_diff"], sums["tokens"]],
                              device=self.device)
        if self.world_size > 1:
            dist.all_reduce(packed)
        loss, kl, clip_tokens, diff, tokens = packed.tolist()
        return {
            "loss": loss, "kl": kl, "clip_frac": clip_tokens / max(tokens, 1.0), "logprob_diff": diff / max(tokens, 1.0),
            "grad_norm": float(grad_norm), "tokens": float(total_tokens), "samples": float(len(samples)),
            "micro_batches": float(len(micro)), "seconds": time.monotonic() - start, "version": float(self.version),
        }

    def hf_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        # named_parameters() lists a tied lm_head once, under the embedding's name: the server's
        # state_dict shares that storage, so one copy updates both.
        return [(n, p.detach()) for n, p in self.model.named_parameters()]
