"""The train-engine contract: what the trainer service needs from torch or Megatron trainers."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol
from collections.abc import Iterable

if TYPE_CHECKING:
    import torch


@dataclass
class TrainSample:
    """One generated sample, as the controller sends it to the trainer."""

    prompt_ids: list[int]
    response_ids: list[int]
    advantage: float
    logprobs: list[float]
    """Per response token, from the rollout server: the behaviour policy in the PPO ratio."""
    weight_version: int
    reward: float = 0.0
    """The sample's (shaped) reward: PPO's outcome reward, and GRPO's when the KL is in the reward."""
    group: int = -1
    """Its group: the trainer recomputes GRPO advantages per group when the KL is in the reward."""
    loss_mask: list[int] | None = None
    """Per response token, 1 where the loss counts it: a trajectory's tool results are 0 (the
    model did not write them). None: every response token counts."""

    @property
    def length(self) -> int:
        """Prompt plus response tokens: the sequence the trainer runs."""
        return len(self.prompt_ids) + len(self.response_ids)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TrainSample:
        mask = d.get("loss_mask")
        return cls(list(d["prompt_ids"]), list(d["response_ids"]), float(d["advantage"]),
                   [float(x) for x in d["logprobs"]], int(d["weight_version"]), float(d.get("reward", 0.0)),
                   int(d.get("group", -1)), None if mask is None else [1 if x else 0 for x in mask])

    @property
    def trained_tokens(self) -> int:
        """Response tokens the loss counts."""
        return len(self.response_ids) if self.loss_mask is None else sum(self.loss_mask)


def split_by_tokens(samples: list[TrainSample], budget: int) -> list[list[TrainSample]]:
    """Micro-batches of samples sorted by length, each holding at most `budget` padded tokens
    (one over-long sample goes alone), cut where they cost least.

    A micro-batch costs its padded tokens (count x longest) plus a fixed overhead for launching
    it, taken as budget/64 tokens. Greedily filling each micro-batch to the budget pads seven
    30-token samples to the length of a 260-token one whenever they fit together, which is
    exactly what a single GRPO group with one long-tail sample looks like; cutting at the best
    places instead is a small dynamic program over the sorted lengths. The cut does not change
    the step: the loss is a token sum."""
    ordered = sorted(samples, key=lambda s: s.length)
    lengths = [s.length for s in ordered]
    overhead = budget / 64
    # cost[j]: cheapest split of the first j samples; start[j]: where its last micro-batch begins.
    cost = [0.0] + [math.inf] * len(ordered)
    start = [0] * (len(ordered) + 1)
    for j in range(1, len(ordered) + 1):
        longest = lengths[j - 1]
        for i in range(j - 1, -1, -1):
            padded = (j - i) * longest
            if padded > budget and i < j - 1:
                break  # a longer micro-batch ending at j only pads more
            if cost[i] + padded + overhead < cost[j]:
                cost[j], start[j] = cost[i] + padded + overhead, i
    batches: list[list[TrainSample]] = []
    j = len(ordered)
    while j:
        batches.append(ordered[start[j] : j])
        j = start[j]
    return batches[::-1]


def padded_batch(samples: list[TrainSample], pad_id: int):
    """Right-padded token ids [B, T], and per position t (predicting token t+1): the response
    mask, the behaviour log-probs [B, T-1]; the advantages [B]; the true lengths [B]; the rewards
    [B]. CPU tensors."""
    import torch

    lengths = [s.length for s in samples]
    n, length = len(samples), max(lengths)
    ids = torch.full((n, length), pad_id, dtype=torch.long)
    mask = torch.zeros((n, length - 1))
    old = torch.zeros((n, length - 1))
    for i, s in enumerate(samples):
        ids[i, : lengths[i]] = torch.tensor(s.prompt_ids + s.response_ids)
        start = len(s.prompt_ids) - 1  # logits at position p predict token p+1
        if s.loss_mask is None:
            mask[i, start : start + len(s.response_ids)] = 1
        else:
            mask[i, start : start + len(s.response_ids)] = torch.tensor(s.loss_mask[: len(s.response_ids)], dtype=mask.dtype)
        old[i, start : start + len(s.response_ids)] = torch.tensor(s.logprobs[: len(s.response_ids)])
    adv = torch.tensor([s.advantage for s in samples])
    rewards = torch.tensor([s.reward for s in samples])
    return ids, mask, old, adv, torch.tensor(lengths), rewards


def new_accumulator() -> dict[str, float]:
    """Running sums over the accumulate() calls of one train batch, for step()'s statistics: the
    objective's per-token sums (rlctl/algos/objective.py: SUM_KEYS, this rank's tokens), and
    batch_tokens and samples, which count every rank's (each rank sees the whole piece)."""
    from rlctl.algos.objective import SUM_KEYS

    return dict.fromkeys((*SUM_KEYS, "batch_tokens", "samples", "micro_batches", "seconds"), 0.0)


def with_group_advantages(samples: list[TrainSample], kl_sums: list[float], kl_coef: float,
                          norm_by_std: bool) -> list[TrainSample]:
    """GRPO with the KL in the reward: each sample's reward less kl_coef x its summed KL, then
    advantages normalized within each group again (a piece holds whole groups)."""
    import dataclasses

    from rlctl.algos.losses import group_advantages

    shaped = [s.reward - kl_coef * k for s, k in zip(samples, kl_sums)]
    by_group: dict[int, list[int]] = {}
    for i, s in enumerate(samples):
        by_group.setdefault(s.group, []).append(i)
    out = list(samples)
    for members in by_group.values():
        for i, a in zip(members, group_advantages([shaped[i] for i in members], norm_by_std)):
            out[i] = dataclasses.replace(samples[i], advantage=a)
    return out


class PieceTraining:
    """What both engines share about a train batch that arrives in pieces: micro-batching, the
    running sums of new_accumulator() in self._acc, and train_batch() as accumulate() + step()."""

    cfg: Any
    algo: Any
    version: int
    _acc: dict[str, float]

    def micro_batches(self, samples: list[TrainSample]) -> list[list[TrainSample]]:
        return split_by_tokens(samples, self.cfg.micro_batch_tokens)

    def train_batch(self, samples: list[TrainSample]) -> dict[str, float]:
        """One optimizer step on one whole train batch: accumulate() then step()."""
        self.accumulate(samples)
        return self.step()

    def kl_shaped(self, samples: list[TrainSample]) -> list[TrainSample]:
        """GRPO with the KL in the reward: every rank scores the whole piece under the reference
        model (the engine's _reward_kl: each sample's summed KL), so that each group's advantages
        are normalized over all its samples."""
        where = {id(s): i for i, s in enumerate(samples)}
        by_sample = [0.0] * len(samples)
        for mb in self.micro_batches(samples):
            for s, k in zip(mb, self._reward_kl(mb)):
                by_sample[where[id(s)]] = k
        return with_group_advantages(samples, by_sample, self.algo.kl_coef, self.algo.norm_adv_by_std)

    def _reward_kl(self, samples: list[TrainSample]) -> list[float]:
        raise NotImplementedError

    def mark_behaviour(self, version: int) -> None:
        """The servers now hold the live weights as `version`: keep them for the old log-probs
        and values of that version's samples (rlctl/engines/train/behaviour.py)."""
        critic = getattr(self, "critic", None)
        for b in (getattr(self, "behaviour", None), critic.behaviour if critic is not None else None):
            if b is not None:
                b.mark(int(version))

    def at_versions(self, behaviour: Any, samples: list[TrainSample], fn, device: Any) -> torch.Tensor:
        """fn(module, rows) for each weight version among the samples, under that version's
        weights (behaviour.module_at), gathered back into one [B, ...] tensor."""
        import torch

        out = None
        for v in sorted({s.weight_version for s in samples}):
            rows = torch.tensor([i for i, s in enumerate(samples) if s.weight_version == v], device=device)
            part = fn(behaviour.module_at(v, self.version), rows)
            out = torch.zeros((len(samples), *part.shape[1:]), device=device) if out is None else out
            out[rows] = part
        assert out is not None
        return out

    def _piece_done(self, samples: list[TrainSample], micro: list[list[TrainSample]], start: float) -> dict[str, float]:
        """Count one accumulate() call (all ranks' samples, this rank's micro-batches) in self._acc."""
        seconds = time.monotonic() - start
        acc = self._acc
        acc["batch_tokens"] += sum(s.trained_tokens for s in samples)
        acc["samples"] += len(samples)
        acc["micro_batches"] += len(micro)
        acc["seconds"] += seconds
        return {"seconds": seconds, "samples": float(len(samples)), "micro_batches": float(len(micro))}


class TrainEngine(Protocol):
    """One data-parallel rank of a trainer. Every rank gets every call, with the same arguments."""

    version: int
    """Weight version of the trainer's working copy: 0 at start, +1 per optimizer step."""

    def accumulate(self, samples: list[TrainSample]) -> dict[str, float]:
        """Forward and backward on part of a train batch (this rank uses its share of the
        samples), adding to the gradients; no optimizer step."""

    def step(self) -> dict[str, float]:
        """One optimizer step on everything accumulated since the last step: the token-mean
        gradient of that train batch, however it was split into accumulate() calls."""

    def train_batch(self, samples: list[TrainSample]) -> dict[str, float]:
        """accumulate(samples) then step(): one optimizer step on one whole train batch."""

    def hf_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """Full weights with Hugging Face names, in a fixed order (meaningful on rank 0)."""

    def save_checkpoint(self, path: str) -> dict[str, float]:
        """Write this trainer's part of a checkpoint into the directory `path` (every rank is
        called; rlctl/engines/train/ckpt_files.py has the files); returns {"version": ...}."""

    def save_policy(self, path: str) -> dict[str, float]:
        """Write the policy alone as a Hugging Face model directory, `path`/hf (config, safetensors,
        tokenizer files): a completed run's final policy. Every rank is called (Megatron's TP
        group rebuilds the full tensors); rank 0 writes. Returns {"version": ...}."""

    def load_checkpoint(self, path: str) -> dict[str, float]:
        """Continue from a checkpoint: weights, optimizer state, RNG states, weight version."""

    # Memory, for a pool that multiplexes several runs' models on one device (rlctl/engines/memory.py).
    # Tags: `weights` (parameters and gradients), `optimizer` (its state); None = both.

    def memory(self) -> dict[str, Any]:
        """{"weights_bytes", "optimizer_bytes", "resident": {"weights": bool, "optimizer": bool}}."""

    def memory_resident(self) -> dict[str, bool]:
        """Which tags are on the device now (cheap: asked before every command)."""

    def check_memory_tags(self, tags: list[str] | None) -> None:
        """RunError for a tag this engine does not have, or an engine that cannot release at all:
        rank 0 asks before it tells the other ranks to move anything."""

    def release_memory(self, tags: list[str] | None) -> dict[str, Any]:
        """Move those tags' memory to the host: {"released": [tags moved], "bytes", "seconds"};
        every rank is called, and each returns once all have moved theirs."""

    def resume_memory(self, tags: list[str] | None) -> dict[str, Any]:
        """Bring it back, bit for bit: {"resumed": [tags moved], "bytes", "seconds"}."""
