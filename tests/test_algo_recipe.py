"""The algo section: impossible settings are one line naming the key and the fix, and the
controller's side of the knobs (advantages, overlong handling) shapes the trainer's rows."""

from __future__ import annotations

import math

import pytest

from conftest import QUICKSTART
from rlctl.data import Prompt
from rlctl.engines.train.base import TrainSample, with_group_advantages
from rlctl.errors import RecipeError
from rlctl.pipelines.build import shaping
from rlctl.pipelines.groups import Group, Sample
from rlctl.recipe import load_recipe


@pytest.mark.parametrize("overrides,key,message", [
    (["train.clip_eps=0.3"], "train.clip_eps",
     "unknown key; the clip moved to algo.clip_eps_low and algo.clip_eps_high"),
    (["train.kl_coef=0.1"], "train.kl_coef",
     "unknown key; the KL penalty moved to algo.kl_coef (with algo.kl_estimator and algo.kl_in)"),
    (["algo.clip_eps_high=1.5"], "algo.clip_eps_high", "must be in (0, 1), got 1.5"),
    (["algo.dual_clip=0.5"], "algo.dual_clip", "must be > 1 (3.0 is usual) or 0 for off, got 0.5"),
    (["algo.tis_cap=2"], "algo.tis_cap",
     "the importance weight is p_trainer / p_server: set algo.recompute_logprobs=true"),
    (["algo.overlong=penalty"], "algo.overlong_buffer",
     "overlong=penalty needs a buffer of tokens before the cap (DAPO: 4096 of 20480)"),
    (["algo.overlong=penalty", "algo.overlong_buffer=9"], "algo.overlong_buffer",
     "9 tokens is more than rollout.sampling.max_new_tokens (4); lower it"),
    (["algo.kl_estimator=k4"], "algo.kl_estimator", "'k4' is not one of k1, k2, k3, low-var"),
    (["algo.gae_lambda=1.5"], "algo.gae_lambda", "must be in [0, 1], got 1.5"),
    (["algo.name=ppo", "launcher=pool", "pool.name=p"], "algo.name",
     "a pool moves a trainer's policy and optimizer, not a critic or behaviour copies; run PPO and recomputed "
     "log-probs outside a pool"),
])
def test_algo_errors_name_the_key_and_the_fix(overrides, key, message):
    with pytest.raises(RecipeError) as info:
        load_recipe(QUICKSTART, overrides)
    assert (info.value.key, info.value.message) == (key, message)


def sample(index: int, reward: float, n_tokens: int, reason: str = "stop") -> Sample:
    return Sample(group=0, index=index, prompt_ids=[1, 2], output_ids=[5] * n_tokens, logprobs=[-1.0] * n_tokens,
                  text="", reward=reward, versions=[0], n_tokens=n_tokens, server="s", t_start=0.0, t_end=1.0,
                  finish_reason=reason)


def group() -> Group:
    g = Group(7, 0, Prompt(0, "p", "a"), [1, 2])
    g.samples = [sample(0, 1.0, 2), sample(1, 0.0, 3), sample(2, 1.0, 4, "length"), sample(3, 0.0, 1)]
    return g


def test_rows_carry_rewards_and_group_and_follow_the_advantage_knobs():
    rows = group().train_samples(shaping(load_recipe(QUICKSTART, [])))
    assert [r["reward"] for r in rows] == [1.0, 0.0, 1.0, 0.0] and {r["group"] for r in rows} == {7}
    std = math.sqrt(1 / 3)  # the sample std of [1, 0, 1, 0]
    assert [r["advantage"] for r in rows] == pytest.approx([0.5 / std, -0.5 / std, 0.5 / std, -0.5 / std], rel=1e-5)
    dr = group().train_samples(shaping(load_recipe(QUICKSTART, ["algo.norm_adv_by_std=false"])))
    assert [r["advantage"] for r in dr] == [0.5, -0.5, 0.5, -0.5]


def test_overlong_penalty_and_filter_shape_the_rows():
    # max_new_tokens 4, buffer 2: lengths 2 (no penalty), 3 (half of it), 4 (all of it), 1.
    rows = group().train_samples(shaping(load_recipe(QUICKSTART, ["algo.overlong=penalty", "algo.overlong_buffer=2",
                                                                 "algo.overlong_penalty=0.4"])))
    assert [r["reward"] for r in rows] == pytest.approx([1.0, -0.2, 0.6, 0.0])
    kept = group().train_samples(shaping(load_recipe(QUICKSTART, ["algo.overlong=filter"])))
    assert [len(r["response_ids"]) for r in kept] == [2, 3, 1]  # the truncated sample left out
    plain = group().train_samples()  # ...after the advantages, which still count it
    assert [r["advantage"] for r in kept] == [plain[i]["advantage"] for i in (0, 1, 3)]


def test_grpo_with_the_kl_in_the_reward_renormalizes_each_group():
    samples = [TrainSample([1], [2], 0.0, [0.0], 0, reward=r, group=g)
               for g, r in ((0, 1.0), (0, 1.0), (1, 0.0), (1, 1.0))]
    out = with_group_advantages(samples, kl_sums=[0.0, 2.0, 0.0, 0.0], kl_coef=0.25, norm_by_std=False)
    # group 0: shaped rewards 1.0 and 0.5 -> +-0.25; group 1 untouched by the KL: -0.5, +0.5
    assert [s.advantage for s in out] == pytest.approx([0.25, -0.25, -0.5, 0.5])
    assert [s.reward for s in out] == [1.0, 1.0, 0.0, 1.0]  # the rows' own rewards stay
