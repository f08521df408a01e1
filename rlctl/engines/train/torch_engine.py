"""`train.engine: torch`: a transformers causal LM trained with GRPO or PPO, data parallel over ranks.

Each rank holds the whole model. A train batch may arrive in pieces (rolloutpipe streams each
complete group to the trainer as it is ready): accumulate() runs forward and backward on a
piece, this rank taking every world_size-th sample, with the loss summed over tokens
(rlctl/algos/objective.py); step() flattens every gradient into one tensor, sums it over ranks
in a single all-reduce (gloo on CPU, NCCL on GPUs), divides the gradients by the whole batch's
loss normalizer (its response tokens, or its samples for the sequence means) and takes the
optimizer step. However the batch was cut into pieces and ranks, the step is the one the
objective defines on the whole batch.

PPO adds a critic (rlctl/engines/train/critic.py) trained in the same calls; algo.recompute_logprobs
and PPO's old values read the weights of the samples' versions (rlctl/engines/train/behaviour.py).

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

from rlctl.algos.losses import entropy_from_logits, kl_penalty, loss_normalizer, token_logprobs
from rlctl.algos.objective import SUM_KEYS, Objective, Prepared
from rlctl.engines.train import ckpt_files, rng_state
from rlctl.engines.memory import Gradients, MemoryTags, ModelWeights, OptimizerState
from rlctl.engines.train.base import PieceTraining, TrainSample, new_accumulator, padded_batch
from rlctl.engines.train.behaviour import Behaviour
from rlctl.engines.train.critic import Critic
from rlctl.engines.train.torch_grads import optimizer_step
from rlctl.errors import RunError
from rlctl.engines.weightsync.flat import flatten_parameters
from rlctl.recipe import AlgoConfig, KlIn, TrainConfig


class TorchTrainEngine(PieceTraining):
    def __init__(self, model_path: str, cfg: TrainConfig, temperature: float, rank: int, world_size: int,
                 device: str = "cpu", offload_dir: str | None = None, algo: AlgoConfig | None = None,
                 behaviour_versions: int = 1) -> None:
        from transformers import AutoModelForCausalLM

        self.cfg = cfg
        self.algo = algo = algo or AlgoConfig()
        self.objective = Objective(algo)
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
        if algo.needs_reference:
            self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)
            weights.insert(1, ModelWeights(self.ref_model, flatten_parameters(self.ref_model), "reference-weights"))
        self.behaviour = Behaviour(self.model, behaviour_versions) if algo.recompute_logprobs else None
        self.critic = Critic(model_path, algo.critic_lr, cfg.weight_decay, cfg.grad_clip, self.device, world_size,
                             behaviour_versions) if algo.ppo else None
        self.pad_id = self.model.config.pad_token_id or 0
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.memory_tags = MemoryTags({"weights": weights, "optimizer": [OptimizerState(self.optimizer)]},
                                      self.device, offload_dir)
        self.version = 0
        self._acc = new_accumulator()
        self.mark_behaviour(0)

    def _batch_tensors(self, samples: list[TrainSample]):
        """Right-padded ids, attention mask, response mask, behaviour logprobs, advantages, rewards."""
        ids, mask, old, adv, lengths, rewards = padded_batch(samples, self.pad_id)
        attn = (torch.arange(ids.shape[1])[None, :] < lengths[:, None]).long()
        return tuple(t.to(self.device) for t in (ids, attn, mask, old, adv, rewards))

    def _scores(self, model, ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        return token_logprobs(model(input_ids=ids, attention_mask=attn).logits[:, :-1], ids[:, 1:], self.temperature)

    def logprobs(self, samples: list[TrainSample]) -> list[list[float]]:
        """Per response token log-probs under the current weights (no grad)."""
        ids, attn, *_ = self._batch_tensors(samples)
        with torch.no_grad():
            lp = self._scores(self.model, ids, attn)
        out = []
        for i, s in enumerate(samples):
            start = len(s.prompt_ids) - 1
            out.append(lp[i, start : start + len(s.response_ids)].tolist())
        return out

    def _prepare(self, mb: list[TrainSample], ids, attn, mask, server, adv, rewards) -> Prepared:
        """The micro-batch's fixed loss inputs: recomputed old log-probs, the reference model's,
        the critic's old values (all without gradients)."""
        recomputed = ref = old_values = None
        with torch.no_grad():
            if self.behaviour is not None:
                recomputed = self.at_versions(self.behaviour, mb, lambda m, r: self._scores(m, ids[r], attn[r]), self.device)
            if self.ref_model is not None:
                ref = self._scores(self.ref_model, ids, attn)
            if self.critic is not None:
                old_values = self.at_versions(self.critic.behaviour, mb, lambda m, r: m(ids[r], attn[r]), self.device)
        return self.objective.prepare(mask, server, adv, rewards, recomputed, ref, old_values)

    def _reward_kl(self, samples: list[TrainSample]) -> list[float]:
        """Each sample's KL to the reference, summed over its response tokens, for kl_shaped()."""
        ids, attn, mask, server, _, _ = self._batch_tensors(samples)
        with torch.no_grad():
            kl = kl_penalty(server, self._scores(self.ref_model, ids, attn), self.algo.kl_estimator)
        return (kl * mask).sum(-1).tolist()

    def accumulate(self, samples: list[TrainSample]) -> dict[str, float]:
        """Forward and backward on these samples (this rank's share), adding to the gradients of
        the train batch being built. Losses are summed over tokens here (rlctl/algos/objective.py);
        step() divides the gradients by the train batch's loss normalizer, which is only known
        once it is complete, so a batch built from several calls takes exactly the step one call
        would."""
        start = time.monotonic()
        if self.ref_model is not None and self.algo.kl_in is KlIn.REWARD and not self.algo.ppo:
            samples = self.kl_shaped(samples)
        micro = self.micro_batches(samples[self.rank :: self.world_size])
        acc = self._acc
        if not acc["samples"]:  # the first piece of a new train batch (the last step's grads stay readable until now)
            self._zero_grad()
        for mb in micro:
            ids, attn, mask, server, adv, rewards = self._batch_tensors(mb)
            prep = self._prepare(mb, ids, attn, mask, server, adv, rewards)
            logits = self.model(input_ids=ids, attention_mask=attn).logits[:, :-1]
            lp = token_logprobs(logits, ids[:, 1:], self.temperature)
            with torch.no_grad():
                entropy = entropy_from_logits(logits / self.temperature if self.temperature not in (0.0, 1.0) else logits)
            self.objective.policy_loss(lp, prep, acc, entropy).backward()
            if self.critic is not None:
                self.objective.value_loss(self.critic.model(ids, attn), prep, acc).backward()
        return self._piece_done(samples, micro, start)

    def _zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        if self.critic is not None:
            self.critic.zero_grad()

    def step(self) -> dict[str, float]:
        """The optimizer step over everything accumulated since the last one: gradients summed
        over ranks (one all-reduce) and divided by the batch's loss normalizer; the critic's too.
        A step whose gradient is not finite is skipped: weights, optimizer state and version stay."""
        start = time.monotonic()
        acc, self._acc = self._acc, new_accumulator()
        if not acc["samples"]:
            self._zero_grad()  # nothing accumulated: no stale gradients
        normalizer = loss_normalizer(self.algo.loss_agg, acc["batch_tokens"], acc["samples"])
        ok, grad_norm = optimizer_step(self.model, self.optimizer, self.world_size, normalizer, self.cfg.grad_clip)
        if ok:
            self.version += 1
        extra = {"critic_grad_norm": self.critic.step(normalizer)} if self.critic is not None else {}
        packed = torch.tensor([acc[k] for k in SUM_KEYS], device=self.device, dtype=torch.float64)
        if self.world_size > 1:
            dist.all_reduce(packed)
        stats = self.objective.finish(dict(zip(SUM_KEYS, packed.tolist())), normalizer)
        return {
            **stats, **extra, "grad_norm": grad_norm, "update_ok": float(ok), "tokens": acc["batch_tokens"],
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
        """Rank 0 writes the policy as an HF directory and the optimizer state (and PPO's critic
        with its optimizer); every rank its RNG states. The ranks are replicas (the same all-reduced step on every rank), so one copy of
        the weights and optimizer serves all of them."""
        root = Path(path)
        if self.rank == 0:
            self._write_policy(root)
            torch.save(self.optimizer.state_dict(), ckpt_files.trainer_dir(root) / "optimizer.pt")
            ckpt_files.write_engine_info(root, engine="torch", version=self.version, ranks=self.world_size)
            if self.critic is not None:
                self.critic.save(root)
        rng_state.save_rng(root, self.rank)
        if self.world_size > 1:
            dist.barrier()
        return {"version": float(self.version)}

    def save_policy(self, path: str) -> dict[str, float]:
        if self.rank == 0:
            self._write_policy(Path(path))
        if self.world_size > 1:
            dist.barrier()
        return {"version": float(self.version)}

    def _write_policy(self, root: Path) -> None:
        self.model.save_pretrained(root / ckpt_files.HF_DIR)
        ckpt_files.copy_model_files(self.model_path, root / ckpt_files.HF_DIR)

    def load_checkpoint(self, path: str) -> dict[str, float]:
        """Weights, optimizer state, RNG states and weight version from a checkpoint (every rank
        reads rank 0's weights and optimizer). The KL reference model stays the initial model.
        Every file is read and checked before anything is set: a refused checkpoint leaves the
        engine as it was."""
        root = Path(path)
        rng = rng_state.read_rng(root, self.rank)
        version = int(ckpt_files.read_engine_info(root)["version"])
        state = ckpt_files.read_safetensors(root / ckpt_files.HF_DIR, device=str(self.device))
        expected = set(self.model.state_dict())
        tied = {"lm_head.weight"} if self.model.config.tie_word_embeddings else set()
        missing, unexpected = expected - set(state) - tied, set(state) - expected
        if unexpected or missing:
            raise RunError(f"{root}: the checkpoint does not fit the model (missing {sorted(missing)[:3]}, "
                           f"unexpected {sorted(unexpected)[:3]})")
        opt = torch.load(ckpt_files.trainer_dir(root) / "optimizer.pt", map_location=self.device, weights_only=True)
        critic = None
        if self.critic is not None:
            if not (ckpt_files.trainer_dir(root) / "critic.pt").exists():
                raise RunError(f"{root}: no critic in this checkpoint (trainer/critic.pt); it was not written by a PPO run")
            critic = self.critic.read(root, self.device)
        self.model.load_state_dict(state, strict=False)
        self.optimizer.load_state_dict(opt)
        if critic is not None:
            self.critic.set_state(critic)
        rng.apply()
        self.version = version
        self._acc = new_accumulator()
        self._zero_grad()
        self.mark_behaviour(self.version)
        return {"version": float(self.version)}
