"""`train.engine: torch`: a transformers causal LM trained with GRPO, data parallel over ranks.

Each rank holds the whole model. A train batch may arrive in pieces (rolloutpipe streams each
complete group to the trainer as it is ready): accumulate() runs forward and backward on a
piece, this rank taking every world_size-th sample, with the loss summed over tokens; step()
flattens every gradient into one tensor, sums it over ranks in a single all-reduce (gloo on CPU,
NCCL on GPUs), divides the gradients by the whole batch's response-token count and takes the
optimizer step. However the batch was cut into pieces and ranks, the step is the token-mean GRPO
step of the batch.

The model is not wrapped in torch's DistributedDataParallel, which all-reduces in every
backward pass: here ranks run different numbers of micro-batches (their shares are cut by
tokens), and one reduction per optimizer step is all a step needs.

Between steps the engine can give its memory back (release_memory) and take it again, bit for
bit (resume_memory): tag `weights` moves the parameters (the policy's one flat buffer, the KL
reference model's) and the gradients held, tag `optimizer` the AdamW state
(rlctl/engines/memory.py: pinned host memory from a GPU, a private file from the CPU).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed as dist

from rlctl.algos.grpo import clipped_policy_loss, k3_kl, token_logprobs
from rlctl.engines.train import ckpt_files
from rlctl.engines.memory import Gradients, MemoryTags, ModelWeights, OptimizerState
from rlctl.engines.train.base import PieceTraining, TrainSample, new_accumulator, padded_batch
from rlctl.errors import RunError
from rlctl.engines.weightsync.flat import flatten_parameters
from rlctl.recipe import TrainConfig


class TorchTrainEngine(PieceTraining):
    def __init__(self, model_path: str, cfg: TrainConfig, temperature: float, rank: int, world_size: int,
                 device: str = "cpu", offload_dir: str | None = None) -> None:
        from transformers import AutoModelForCausalLM

        self.cfg = cfg
        self.model_path = model_path
        self.temperature = temperature
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(self.device)
        # Parameters as views of one buffer: a weight sync sends slices of it with no copy (weightsync/flat.py).
        flat = flatten_parameters(self.model)
        self.model.train()
        self.ref_model = None
        weights = [Gradients(self.model), ModelWeights(self.model, flat)]  # released in this order, resumed in reverse
        if cfg.kl_coef > 0:
            self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)
            weights.insert(1, ModelWeights(self.ref_model, flatten_parameters(self.ref_model), "reference-weights"))
        self.pad_id = self.model.config.pad_token_id or 0
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.memory_tags = MemoryTags({"weights": weights, "optimizer": [OptimizerState(self.optimizer)]},
                                      self.device, offload_dir)
        self.version = 0
        self._acc = new_accumulator()

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

    def accumulate(self, samples: list[TrainSample]) -> dict[str, float]:
        """Forward and backward on these samples (this rank's share), adding to the gradients of
        the train batch being built. The loss is summed over tokens here; step() divides the
        gradients by the train batch's token count, which is only known once it is complete, so
        a batch built from several calls takes exactly the step one call would."""
        start = time.monotonic()
        micro = self.micro_batches(samples[self.rank :: self.world_size])
        acc = self._acc
        if not acc["samples"]:  # the first piece of a new train batch (the last step's grads stay readable until now)
            self.optimizer.zero_grad(set_to_none=True)
        for mb in micro:
            ids, attn, mask, old, adv = self._batch_tensors(mb)
            logits = self.model(input_ids=ids, attention_mask=attn).logits[:, :-1]
            lp = token_logprobs(logits, ids[:, 1:], self.temperature)
            loss, pstats = clipped_policy_loss(lp, old, adv, mask, self.cfg.clip_eps, 1.0)
            if self.ref_model is not None:
                with torch.no_grad():
                    ref_logits = self.ref_model(input_ids=ids, attention_mask=attn).logits[:, :-1]
                    ref_lp = token_logprobs(ref_logits, ids[:, 1:], self.temperature)
                kl = (k3_kl(lp, ref_lp) * mask).sum()
                loss = loss + self.cfg.kl_coef * kl
                acc["kl"] += kl.item()
            loss.backward()
            n = float(mask.sum())
            acc["loss"] += loss.item()
            acc["clip_tokens"] += pstats["clip_frac"] * n
            acc["logprob_diff"] += float(((lp.detach() - old).abs() * mask).sum())
            acc["tokens"] += n
        return self._piece_done(samples, micro, start)

    def step(self) -> dict[str, float]:
        """The optimizer step over everything accumulated since the last one: gradients summed
        over ranks (one all-reduce) and divided by the batch's response tokens (a token mean)."""
        start = time.monotonic()
        acc, self._acc = self._acc, new_accumulator()
        if not acc["samples"]:
            self.optimizer.zero_grad(set_to_none=True)  # nothing accumulated: no stale gradients
        params = list(self.model.parameters())
        if self.world_size > 1:
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
            dist.all_reduce(flat)
            offset = 0
            for p in params:
                p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
                offset += p.numel()
        total_tokens = max(acc["batch_tokens"], 1.0)
        for p in params:
            if p.grad is not None:
                p.grad.div_(total_tokens)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip)
        self.optimizer.step()
        self.version += 1
        packed = torch.tensor([acc["loss"], acc["kl"], acc["clip_tokens"], acc["logprob_diff"], acc["tokens"]],
                              device=self.device)
        if self.world_size > 1:
            dist.all_reduce(packed)
        loss, kl, clip_tokens, diff, tokens = packed.tolist()
        return {
            "loss": loss / total_tokens, "kl": kl / total_tokens, "clip_frac": clip_tokens / max(tokens, 1.0),
            "logprob_diff": diff / max(tokens, 1.0), "grad_norm": float(grad_norm), "tokens": acc["batch_tokens"],
            "samples": acc["samples"], "micro_batches": acc["micro_batches"],
            "seconds": acc["seconds"] + time.monotonic() - start, "version": float(self.version),
        }

    def hf_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        # named_parameters() lists a tied lm_head once, under the embedding's name: the server's
        # state_dict shares that storage, so one copy updates both.
        return [(n, p.detach()) for n, p in self.model.named_parameters()]

    # -- memory (a shared pool multiplexes several runs' models on one device) --------------------

    def memory(self) -> dict:
        """The footprint: weights_bytes (parameters, the reference model's, gradients held),
        optimizer_bytes, and which of them are on the device now."""
        m = self.memory_tags
        return {"weights_bytes": m.nbytes("weights"), "optimizer_bytes": m.nbytes("optimizer"), "resident": m.resident()}

    def memory_resident(self) -> dict[str, bool]:
        return self.memory_tags.resident()

    def check_memory_tags(self, tags: list[str] | None) -> None:
        try:
            self.memory_tags.select(tags)
        except ValueError as e:
            raise RunError(str(e)) from None

    def release_memory(self, tags: list[str] | None) -> dict:
        """Move the memory under `tags` (weights, optimizer; None = both) off the device; tags
        already released are left as they are. A train batch half accumulated keeps its gradients.
        Returns once every rank has moved its own (this rank's bytes in the reply)."""
        moved = self.memory_tags.release(tags)
        if self.world_size > 1:
            dist.barrier()
        return {"released": moved.tags, "bytes": moved.bytes, "seconds": moved.seconds}

    def resume_memory(self, tags: list[str] | None) -> dict:
        moved = self.memory_tags.resume(tags)
        if self.world_size > 1:
            dist.barrier()
        return {"resumed": moved.tags, "bytes": moved.bytes, "seconds": moved.seconds}

    # -- checkpoints (rlctl/engines/train/ckpt_files.py has the files) ---------------------------

    def save_checkpoint(self, path: str) -> dict[str, float]:
        """Rank 0 writes the policy as an HF directory and the optimizer state; every rank its RNG
        states. The ranks are replicas (the same all-reduced step on every rank), so one copy of
        the weights and optimizer serves all of them."""
        root = Path(path)
        if self.rank == 0:
            self.model.save_pretrained(root / ckpt_files.HF_DIR)
            ckpt_files.copy_model_files(self.model_path, root / ckpt_files.HF_DIR)
            torch.save(self.optimizer.state_dict(), ckpt_files.trainer_dir(root) / "optimizer.pt")
            ckpt_files.write_engine_info(root, engine="torch", version=self.version, ranks=self.world_size)
        ckpt_files.save_rng(root, self.rank)
        if self.world_size > 1:
            dist.barrier()
        return {"version": float(self.version)}

    def load_checkpoint(self, path: str) -> dict[str, float]:
        """Weights, optimizer state, RNG states and weight version from a checkpoint (every rank
        reads rank 0's weights and optimizer). The KL reference model stays the initial model."""
        root = Path(path)
        state = ckpt_files.read_safetensors(root / ckpt_files.HF_DIR, device=str(self.device))
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        tied = {"lm_head.weight"} if self.model.config.tie_word_embeddings else set()
        if unexpected or set(missing) - tied:
            raise RunError(f"{root}: the checkpoint does not fit the model (missing {sorted(set(missing) - tied)[:3]}, "
                           f"unexpected {sorted(unexpected)[:3]})")
        opt = torch.load(ckpt_files.trainer_dir(root) / "optimizer.pt", map_location=self.device, weights_only=True)
        self.optimizer.load_state_dict(opt)
        ckpt_files.load_rng(root, self.rank)
        self.version = int(ckpt_files.read_engine_info(root)["version"])
        self._acc = new_accumulator()
        self.optimizer.zero_grad(set_to_none=True)
        return {"version": float(self.version)}
