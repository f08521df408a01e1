"""The trainer's objective for one micro-batch, shared by the torch and Megatron engines.

An engine computes what needs its model (log-probs with gradients, the old log-probs recomputed
under the behaviour weights, the reference model's log-probs, the critic's values) and hands the
tensors here; the algo section decides what they become (rlctl/algos/losses.py has the
formulas). Every loss and statistic is a SUM over tokens, added into the engine's accumulator;
finish() turns the train batch's sums (over micro-batches, pieces and ranks) into the reported
statistics, named as the field names them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rlctl.algos import losses
from rlctl.recipe.algo import AlgoConfig
from rlctl.recipe.choices import KlEstimator, KlIn

if TYPE_CHECKING:
    import torch

SUM_KEYS = ("loss", "kl", "clip_tokens", "dual_clip_tokens", "approx_kl", "entropy", "logprob_diff", "tokens",
            "is_weight", "is_capped", "mismatch_kl", "value_loss", "value_clip_tokens", "ret", "ret_sq", "res", "res_sq",
            "values")
"""Per-token sums an engine accumulates over a train batch and adds over ranks."""


@dataclass
class Prepared:
    """A micro-batch's fixed inputs to the loss (no gradients): the ratio's old log-probs, the
    per-token advantages, the loss weights, and what the KL, importance weights and critic need."""

    mask: torch.Tensor
    old: torch.Tensor
    server: torch.Tensor
    advantages: torch.Tensor
    weights: torch.Tensor
    ref: torch.Tensor | None = None
    is_weights: torch.Tensor | None = None
    old_values: torch.Tensor | None = None
    returns: torch.Tensor | None = None


class Objective:
    def __init__(self, algo: AlgoConfig) -> None:
        self.algo = algo

    def prepare(self, mask: torch.Tensor, server: torch.Tensor, advantages: torch.Tensor, rewards: torch.Tensor,
                recomputed: torch.Tensor | None = None, ref: torch.Tensor | None = None,
                old_values: torch.Tensor | None = None) -> Prepared:
        """advantages: [B] from the controller (GRPO); rewards: [B] (PPO's outcome rewards).
        recomputed: the trainer's own old log-probs (algo.recompute_logprobs); ref: the reference
        model's (kl_coef > 0); old_values: the behaviour critic's values (PPO)."""
        a = self.algo
        old = recomputed if recomputed is not None else server
        p = Prepared(mask=mask, old=old, server=server, advantages=advantages.unsqueeze(-1) * mask,
                     weights=losses.token_weights(mask, a.loss_agg), ref=ref)
        if a.tis_cap and recomputed is not None:
            p.is_weights = losses.truncated_is_weights(recomputed, server, a.tis_cap) * mask
        if a.ppo:
            assert old_values is not None, "PPO needs the critic's values"
            token_rewards = losses.outcome_token_rewards(rewards, mask)
            if ref is not None and a.kl_in is KlIn.REWARD:
                token_rewards = token_rewards - a.kl_coef * losses.kl_penalty(old, ref, a.kl_estimator) * mask
            p.advantages, p.returns = losses.gae(token_rewards, old_values * mask, mask, a.gamma, a.gae_lambda)
            p.old_values = old_values
        return p

    def policy_loss(self, logprobs: torch.Tensor, p: Prepared, acc: dict[str, float],
                    entropy: torch.Tensor | None = None) -> torch.Tensor:
        """The policy's summed loss for this micro-batch (what backward() takes); its
        statistics added into acc."""
        import torch

        a = self.algo
        loss, st = losses.policy_loss(logprobs, p.old, p.advantages, p.weights, a.clip_eps_low, a.clip_eps_high,
                                      a.dual_clip, p.is_weights)
        if p.ref is not None:
            kl = losses.kl_penalty(logprobs, p.ref, a.kl_estimator)
            if a.kl_in is KlIn.LOSS:
                loss = loss + a.kl_coef * (p.weights * kl).sum()
            acc["kl"] += float((kl.detach() * p.mask).sum())
        acc["loss"] += float(loss.detach())
        for key in ("clip_tokens", "dual_clip_tokens", "approx_kl", "tokens"):
            acc[key] += st[key]
        with torch.no_grad():
            m = p.mask
            acc["logprob_diff"] += float(((logprobs - p.server).abs() * m).sum())
            if entropy is not None:
                acc["entropy"] += float((entropy * m).sum())
            if p.is_weights is not None:
                acc["is_weight"] += float(p.is_weights.sum())
                acc["is_capped"] += float(((p.is_weights >= self.algo.tis_cap) * m).sum())
            if p.old is not p.server:
                acc["mismatch_kl"] += float((losses.kl_penalty(p.server, p.old, KlEstimator.K3) * m).sum())
        return loss

    def value_loss(self, values: torch.Tensor, p: Prepared, acc: dict[str, float]) -> torch.Tensor:
        """The critic's summed loss for this micro-batch; explained-variance sums into acc."""
        import torch

        assert p.old_values is not None and p.returns is not None
        loss, st = losses.value_loss(values, p.old_values, p.returns, p.weights, self.algo.value_clip)
        acc["value_loss"] += float(loss.detach())
        acc["value_clip_tokens"] += st["clip_tokens"]
        with torch.no_grad():
            m, residual = p.mask, (p.returns - values) * p.mask
            acc["ret"] += float(p.returns.sum())
            acc["ret_sq"] += float((p.returns ** 2).sum())
            acc["res"] += float(residual.sum())
            acc["res_sq"] += float((residual ** 2).sum())
            acc["values"] += float((values * m).sum())
        return loss

    def finish(self, sums: dict[str, float], normalizer: float) -> dict[str, float]:
        """A train batch's statistics from its summed accumulator (all ranks): losses are divided
        by the batch's normalizer (losses.loss_normalizer), the rest are per-token means."""
        a, n = self.algo, max(sums["tokens"], 1.0)
        out = {"loss": sums["loss"] / normalizer, "clip_frac": sums["clip_tokens"] / n,
               "approx_kl": sums["approx_kl"] / n, "logprob_diff": sums["logprob_diff"] / n,
               "entropy": sums["entropy"] / n}
        if a.dual_clip:
            out["dual_clip_frac"] = sums["dual_clip_tokens"] / n
        if a.needs_reference:
            out["kl"] = sums["kl"] / n
        if a.recompute_logprobs:
            out["mismatch_kl"] = sums["mismatch_kl"] / n
        if a.tis_cap:
            out["is_weight_mean"] = sums["is_weight"] / n
            out["is_capped_frac"] = sums["is_capped"] / n
        if a.ppo:
            var_ret = sums["ret_sq"] / n - (sums["ret"] / n) ** 2
            var_res = sums["res_sq"] / n - (sums["res"] / n) ** 2
            out.update(value_loss=sums["value_loss"] / normalizer, value_clip_frac=sums["value_clip_tokens"] / n,
                       values_mean=sums["values"] / n,
                       explained_var=1.0 - var_res / var_ret if var_ret > 1e-12 else 0.0)
        return out
