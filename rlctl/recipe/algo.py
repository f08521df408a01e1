"""The algo section: which RL objective the trainer optimizes, and each of its knobs.

rlctl/algos/losses.py has the formulas; every knob is named as the field's papers and
frameworks name it, with the default that reproduces rlctl's GRPO before these knobs existed.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlctl.recipe.checks import FieldError, Section, at_most, within
from rlctl.recipe.choices import AlgoName, KlEstimator, KlIn, LossAgg, Overlong
from rlctl.recipe.rollout import MAX_NEW_TOKENS


@dataclass(kw_only=True)
class AlgoConfig(Section):
    name: AlgoName = AlgoName.GRPO
    """grpo (group-relative advantages, no critic) or ppo (a critic and GAE)."""
    clip_eps_low: float = 0.2
    """The ratio's lower clip: 1 - clip_eps_low."""
    clip_eps_high: float = 0.2
    """The ratio's upper clip: 1 + clip_eps_high (DAPO's clip-higher: 0.28)."""
    dual_clip: float = 0.0
    """Dual clip c in (1, 100] (3.0 in the paper): for a negative advantage the loss is at most
    -c * A; 0 = off."""
    loss_agg: LossAgg = LossAgg.TOKEN_MEAN
    """token-mean, seq-mean-token-mean or seq-mean-token-sum."""
    norm_adv_by_std: bool = True
    """GRPO: divide a group's centred rewards by its standard deviation; false is Dr. GRPO."""
    kl_coef: float = 0.0
    """Weight of the KL to the initial model, in [0, 10] (0 = off, and no reference copy is kept)."""
    kl_estimator: KlEstimator = KlEstimator.K3
    """k1, k2, k3 or low-var."""
    kl_in: KlIn = KlIn.LOSS
    """loss (a penalty term) or reward (subtracted from the reward before advantages)."""
    recompute_logprobs: bool = False
    """Score the trained samples' tokens on the trainer, with the weights that generated them, and
    use those as the PPO ratio's old log-probs instead of the servers' (whose numerics differ:
    bf16 servers against an fp32 trainer). The trainer keeps a copy of the weights of each
    version still in flight (1, or pipeline.max_staleness + 1 in async)."""
    tis_cap: float = 0.0
    """Truncated importance sampling: weigh each token's loss by min(p_trainer_old / p_server, cap),
    correcting for the servers' numerics; needs recompute_logprobs; 0 = off, else in [1, 1000]
    (2.0 is usual)."""
    overlong: Overlong = Overlong.KEEP
    """keep, penalty (DAPO's soft length penalty) or filter (truncated samples leave the loss)."""
    overlong_buffer: int = 0
    """penalty: the last this-many tokens before rollout.sampling.max_new_tokens where the
    penalty grows from 0 to overlong_penalty."""
    overlong_penalty: float = 1.0
    """penalty: the most subtracted from a reward (at the cap and for truncated samples); in [0, 10]."""
    gamma: float = 1.0
    """PPO: GAE's discount per token."""
    gae_lambda: float = 1.0
    """PPO: GAE's lambda (1.0: advantages are returns minus values)."""
    value_clip: float = 0.2
    """PPO: the critic's values may move at most this far from the values it gave the samples'
    tokens when they were generated (0 = off); in [0, 10]."""
    critic_lr: float = 1e-3
    """PPO: the critic's AdamW learning rate, in (0, 1]."""

    @property
    def needs_reference(self) -> bool:
        return self.kl_coef > 0

    @property
    def ppo(self) -> bool:
        return self.name is AlgoName.PPO

    def check(self) -> None:
        for name in ("clip_eps_low", "clip_eps_high"):
            within(name, getattr(self, name), 0.0, 1.0, open_low=True, open_high=True)
        if self.dual_clip and self.dual_clip <= 1.0:
            raise FieldError("dual_clip", f"must be > 1 (3.0 is usual) or 0 for off, got {self.dual_clip}")
        at_most("dual_clip", self.dual_clip, 100)
        for name in ("kl_coef", "overlong_penalty", "value_clip"):  # rewards lie in [0, 1]
            within(name, getattr(self, name), 0.0, 10.0)
        within("tis_cap", self.tis_cap, 0.0, 1000.0)
        within("overlong_buffer", self.overlong_buffer, 0, MAX_NEW_TOKENS)
        if self.tis_cap and self.tis_cap < 1.0:
            raise FieldError("tis_cap", f"a cap below 1 down-weights every on-policy token; use >= 1 (2.0 is usual), got {self.tis_cap}")
        if self.tis_cap and not self.recompute_logprobs:
            raise FieldError("tis_cap", "the importance weight is p_trainer / p_server: set algo.recompute_logprobs=true")
        if self.overlong is Overlong.PENALTY and self.overlong_buffer == 0:
            raise FieldError("overlong_buffer", "overlong=penalty needs a buffer of tokens before the cap (DAPO: 4096 of 20480)")
        within("gamma", self.gamma, 0.0, 1.0)
        within("gae_lambda", self.gae_lambda, 0.0, 1.0)
        within("critic_lr", self.critic_lr, 0.0, 1.0, open_low=True)
