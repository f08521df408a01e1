"""The RL objectives' formulas, as pure functions on tensors (every knob of the `algo` section).

Shapes follow the trainer's batch layout: [B, T] per token position, where position t scores
token t+1 and `mask` marks the response tokens. Losses are returned as SUMS over tokens,
weighted by token_weights(): the engines add them up over micro-batches, pieces and ranks and
divide once, at the optimizer step, by loss_normalizer(). That is what lets a train batch arrive
in pieces (rolloutpipe) and be cut into micro-batches by length without changing the step.

References for the formulas: PPO (Schulman et al. 2017) for the clipped surrogate and value
clipping; GAE (Schulman et al. 2016); dual clip (Ye et al. 2020); clip-higher, token-mean and
the overlong penalty (DAPO, Yu et al. 2025); the sequence-mean aggregation and std
normalization (GRPO, Shao et al. 2024) and their removal (Dr. GRPO, Liu et al. 2025); the KL
estimators k1, k2, k3 (Schulman, "Approximating KL divergence", 2020); truncated importance
sampling for rollout/trainer mismatch (Yao et al. 2025).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from rlctl.recipe.choices import KlEstimator, LossAgg

if TYPE_CHECKING:
    import torch


def group_advantages(rewards: Sequence[float], norm_by_std: bool = True, eps: float = 1e-6) -> list[float]:
    """GRPO: r - mean within one group, divided by (sample std + eps) unless norm_by_std is False
    (Dr. GRPO); all-equal rewards give all zeros. Plain floats: a simulated step scores
    thousands of groups, and statistics.stdev's exact arithmetic costs ~100 us a group."""
    n = len(rewards)
    mean = sum(rewards) / n
    if not norm_by_std:
        return [r - mean for r in rewards]
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (n - 1)) if n > 1 else 0.0
    return [(r - mean) / (std + eps) for r in rewards]


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(target) per position, from logits [B, T, V] and targets [B, T], with the logits
    divided by the sampling temperature: the trainer scores tokens under the distribution the
    rollout server sampled them from."""
    import torch

    logits = logits.float()
    if temperature not in (0.0, 1.0):
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def overlong_penalty(n_tokens: int, max_new_tokens: int, buffer: int, penalty: float) -> float:
    """DAPO's soft length penalty: 0 up to max_new_tokens - buffer tokens, then falling linearly to
    -penalty at the cap."""
    over = n_tokens - (max_new_tokens - buffer)
    return 0.0 if over <= 0 or buffer <= 0 else -penalty * min(over / buffer, 1.0)


def token_weights(mask: torch.Tensor, agg: LossAgg) -> torch.Tensor:
    """Per-token weights w such that the batch loss is sum(w * l) / loss_normalizer(): 1 per
    response token for token-mean and seq-mean-token-sum, 1/len(sample) for seq-mean-token-mean."""
    if agg is LossAgg.SEQ_MEAN_TOKEN_MEAN:
        return mask / mask.sum(-1, keepdim=True).clamp(min=1)
    return mask


def loss_normalizer(agg: LossAgg, batch_tokens: float, batch_samples: float) -> float:
    """What the summed loss of a whole train batch is divided by: its response tokens
    (token-mean) or its samples (the two sequence means)."""
    return max(batch_tokens if agg is LossAgg.TOKEN_MEAN else batch_samples, 1.0)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: KlEstimator) -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from samples of pi, with d = log ref - log pi:
    k1 = -d, k2 = d^2 / 2, k3 = e^d - d - 1; low-var is k3 with d clamped to [-20, 20] and the
    result to [-10, 10]."""
    import torch

    d = ref_logprobs - logprobs
    if estimator is KlEstimator.K1:
        return -d
    if estimator is KlEstimator.K2:
        return 0.5 * d * d
    if estimator is KlEstimator.LOW_VAR:
        d = d.clamp(-20.0, 20.0)
        return (torch.exp(d) - d - 1).clamp(-10.0, 10.0)
    return torch.exp(d) - d - 1


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                weights: torch.Tensor, eps_low: float, eps_high: float, dual_clip: float = 0.0,
                is_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped surrogate, summed: sum(w * l) with, per token, r = exp(logprobs - old),
    l = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)); with dual_clip c, for A < 0
    l = min(l, -c A); times the importance weight when given (no gradient through it).
    advantages: [B] (one per sample) or [B, T].

    Stats are sums over the weighted-in tokens (w > 0) for the caller to divide:
    clip_tokens where the clip binds (the clipped term is the one taken, so the token gives no
    gradient), dual_clip_tokens where the dual clip binds, approx_kl the k3 estimate of
    KL(old || new) = (r - 1) - log r, tokens the count."""
    import torch

    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    per_token = torch.maximum(unclipped, clipped)
    dual_binds = torch.zeros_like(per_token, dtype=torch.bool)
    if dual_clip:
        bound = -adv * dual_clip
        dual_binds = (adv < 0) & (per_token > bound)
        per_token = torch.where(adv < 0, torch.minimum(per_token, bound), per_token)
    if is_weights is not None:
        per_token = per_token * is_weights.detach()
    loss = (weights * per_token).sum()
    with torch.no_grad():
        on = (weights > 0).float()
        stats = {
            "clip_tokens": float(((clipped > unclipped) & ~dual_binds).float().mul(on).sum()),
            "dual_clip_tokens": float((dual_binds.float() * on).sum()),
            "approx_kl": float((((ratio - 1) - log_ratio) * on).sum()),
            "tokens": float(on.sum()),
        }
    return loss, stats


def truncated_is_weights(trainer_logprobs: torch.Tensor, server_logprobs: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance sampling: min(p_trainer / p_server, cap) per token, where both score
    the same tokens with the same weights; the mismatch is the servers' numerics."""
    import torch

    return torch.exp(trainer_logprobs - server_logprobs).clamp(max=cap)


def gae(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation along each row's response tokens (mask 1; a row's
    response is one contiguous run). The state after the last response token is terminal
    (value 0). Returns (advantages, returns = advantages + values), zero outside the mask."""
    import torch

    B, T = values.shape
    adv = torch.zeros_like(values)
    running = torch.zeros(B, dtype=values.dtype, device=values.device)
    next_value = torch.zeros(B, dtype=values.dtype, device=values.device)
    next_on = torch.zeros(B, dtype=values.dtype, device=values.device)
    for t in range(T - 1, -1, -1):
        on = mask[:, t]
        delta = token_rewards[:, t] + gamma * next_value * next_on - values[:, t]
        running = (delta + gamma * lam * next_on * running) * on
        adv[:, t] = running
        next_value = torch.where(on > 0, values[:, t], next_value)
        next_on = on
    return adv, (adv + values) * mask


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, weights: torch.Tensor,
               clip: float) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's critic loss, summed: sum(w * max((V - R)^2, (V_clip - R)^2) / 2) with
    V_clip = V_old + clip(V - V_old, -clip, clip); clip 0 = no clipping. Stats: clip_tokens
    where the clipped error is the larger (the clip binds), and tokens."""
    import torch

    err = (values - returns) ** 2
    if clip:
        clipped = old_values + (values - old_values).clamp(-clip, clip)
        err_clipped = (clipped - returns) ** 2
        per_token = 0.5 * torch.maximum(err, err_clipped)
        binds = err_clipped > err
    else:
        per_token, binds = 0.5 * err, torch.zeros_like(err, dtype=torch.bool)
    loss = (weights * per_token).sum()
    with torch.no_grad():
        on = (weights > 0).float()
        stats = {"clip_tokens": float((binds.float() * on).sum()), "tokens": float(on.sum())}
    return loss, stats


def outcome_token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] sample rewards placed on each row's last response token, [B, T]."""
    import torch

    T = mask.shape[1]
    last = (mask * torch.arange(T, device=mask.device)).argmax(-1)
    out = torch.zeros_like(mask)
    out[torch.arange(mask.shape[0], device=mask.device), last] = rewards.to(mask.dtype)
    return out * mask


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Per-position entropy of softmax(logits), [B, T]."""
    import torch

    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)
