"""The GRPO loss on hand-computed values: clipping, clip_frac, log-probs at a temperature."""

from __future__ import annotations

import math

import pytest
import torch

from rlctl.algos.losses import group_advantages, kl_penalty, policy_loss, token_logprobs
from rlctl.recipe import KlEstimator


def clipped_policy_loss(lp, old, adv, mask, clip_eps, normalizer):
    """The symmetric clip, as a token mean over `normalizer` tokens, with clip_frac as a share."""
    loss, stats = policy_loss(lp, old, adv, mask, clip_eps, clip_eps)
    return loss / normalizer, {"clip_frac": stats["clip_tokens"] / max(stats["tokens"], 1.0)}


def k3_kl(lp, ref):
    return kl_penalty(lp, ref, KlEstimator.K3)


def test_group_advantages_normalize_within_the_group():
    adv = group_advantages([1.0, 0.0, 0.0, 1.0])
    std = math.sqrt(1 / 3)  # sample std of [1, 0, 0, 1]
    assert adv == pytest.approx([0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std], rel=1e-5)
    assert group_advantages([1.0, 1.0, 1.0]) == [0.0, 0.0, 0.0]


def test_token_logprobs_match_log_softmax_at_temperature():
    logits = torch.tensor([[[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]]])
    targets = torch.tensor([[2, 0]])
    lp = token_logprobs(logits, targets, temperature=0.5)
    expected0 = 6.0 - math.log(math.exp(2) + math.exp(4) + math.exp(6))
    assert lp[0, 0].item() == pytest.approx(expected0, rel=1e-6)
    assert lp[0, 1].item() == pytest.approx(-math.log(3), rel=1e-6)


def test_clipped_loss_on_policy_is_minus_mean_advantage():
    lp = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    adv = torch.tensor([2.0, -1.0])
    loss, stats = clipped_policy_loss(lp, lp, adv, mask, clip_eps=0.2, normalizer=3.0)
    assert loss.item() == pytest.approx(-(2.0 + 2.0 - 1.0) / 3.0)
    assert stats["clip_frac"] == 0.0


def test_clipping_caps_the_gain_of_a_positive_advantage():
    lp = torch.log(torch.tensor([[1.5]]))  # ratio 1.5 > 1 + eps
    loss, stats = clipped_policy_loss(lp, torch.zeros(1, 1), torch.tensor([1.0]), torch.ones(1, 1), 0.2, 1.0)
    assert loss.item() == pytest.approx(-1.2)
    assert stats["clip_frac"] == 1.0
    # The clipped branch has no gradient: the ratio cannot be pushed further this step.
    lp.requires_grad_(True)
    loss, _ = clipped_policy_loss(lp, torch.zeros(1, 1), torch.tensor([1.0]), torch.ones(1, 1), 0.2, 1.0)
    loss.backward()
    assert lp.grad.abs().sum().item() == 0.0


def test_clip_frac_counts_tokens_where_the_clip_binds_not_tokens_outside_the_band():
    # Per sample, one token: ratio 3 and 0.5 with a positive advantage, then with a negative one.
    # Outside the band, the clip binds only where the advantage pushes the ratio further out
    # (3 with A > 0, 0.5 with A < 0); the other two keep their unclipped term and its gradient.
    ratio = torch.tensor([[3.0], [0.5], [3.0], [0.5]])
    lp = torch.log(ratio).requires_grad_(True)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    loss, stats = clipped_policy_loss(lp, torch.zeros(4, 1), adv, torch.ones(4, 1), 0.2, 4.0)
    assert stats["clip_frac"] == 0.5
    assert loss.item() == pytest.approx(-(1.2 + 0.5 - 3.0 - 0.8) / 4)
    loss.backward()
    assert [g != 0 for g in lp.grad[:, 0].tolist()] == [False, True, True, False]


def test_clip_frac_ignores_masked_tokens():
    lp = torch.log(torch.tensor([[3.0, 3.0]]))
    stats = clipped_policy_loss(lp, torch.zeros(1, 2), torch.tensor([1.0]), torch.tensor([[1.0, 0.0]]), 0.2, 1.0)[1]
    assert stats["clip_frac"] == 1.0
    lp = torch.log(torch.tensor([[3.0, 1.0]]))
    stats = clipped_policy_loss(lp, torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2), 0.2, 1.0)[1]
    assert stats["clip_frac"] == 0.5


def test_k3_kl_is_zero_on_equal_policies_and_positive_otherwise():
    lp = torch.tensor([-1.0, -2.0])
    assert torch.all(k3_kl(lp, lp) == 0)
    assert torch.all(k3_kl(lp, lp + 0.3) > 0)
