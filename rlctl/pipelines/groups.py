"""A run's samples as the scheduler holds them: a Sample (one response, or one trajectory of
turns), a Group (the G samples of a prompt) and the Shaping that turns a group into the
trainer's rows."""

from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import Any

from rlctl.algos.losses import group_advantages, overlong_penalty
from rlctl.data import Prompt


@dataclass
class Sample:
    group: int
    index: int
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    text: str
    reward: float
    versions: list[int]
    """Weight version of each generated segment (more than one after an abort-and-resume)."""
    n_tokens: int
    """Generated tokens (a simulated server generates counts, not token ids)."""
    server: str
    t_start: float
    t_end: float
    finish_reason: str
    scores: dict[str, float] = field(default_factory=dict)
    """The named scores the reward function returned (empty when it returned a number)."""
    loss_mask: list[int] | None = None
    """A trajectory (rollout.multi_turn): per token of output_ids, 1 for the model's, 0 for the
    environment's (tool results), which the trainer leaves out of the loss. None: all trained."""
    turns: list[dict[str, Any]] = field(default_factory=list)
    """A trajectory's model turns, in order: server, versions, t_start, t_end, tokens."""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    """A trajectory's tool calls, in order: name, ok, seconds, t_start."""
    trajectory: str = ""
    """A trajectory's whole text after the prompt, the model's turns and the tools' (`text` is
    its last model turn, which the reward scores)."""

    @property
    def weight_version(self) -> int:
        """The oldest weights that produced any of its tokens: what staleness is measured from."""
        return min(self.versions)


@dataclass(frozen=True)
class Shaping:
    """How a group's samples become the trainer's rows: the algo section's controller-side knobs."""

    norm_by_std: bool = True
    """GRPO advantages divided by the group's standard deviation (false: Dr. GRPO)."""
    max_new_tokens: int = 0
    overlong_buffer: int = 0
    """> 0: DAPO's soft overlong penalty over this many tokens before max_new_tokens."""
    overlong_penalty: float = 0.0
    filter_truncated: bool = False
    """Samples cut at the length cap are left out of the rows (after the advantages)."""

    def reward(self, s: Sample) -> float:
        if not self.overlong_buffer:
            return s.reward
        return s.reward + overlong_penalty(s.n_tokens, self.max_new_tokens, self.overlong_buffer, self.overlong_penalty)


@dataclass
class Group:
    """The G samples of one prompt; complete when all are generated and scored."""

    id: int
    step: int
    prompt: Prompt
    prompt_ids: list[int]
    samples: list[Sample] = field(default_factory=list)
    cancelled: bool = False
    admitted: bool = False
    """A request of it has gone to a server (group_admitted): from then on it ends in an event."""

    @property
    def rewards(self) -> list[float]:
        return [s.reward for s in self.samples]

    @property
    def all_equal(self) -> bool:
        return len(set(self.rewards)) <= 1

    @property
    def weight_version(self) -> int:
        return min(s.weight_version for s in self.samples)

    def train_samples(self, shaping: Shaping = Shaping()) -> list[dict[str, Any]]:
        """JSON rows for the trainer: each sample with its (shaped) reward and its group-relative
        advantage; truncated samples left out when shaping.filter_truncated."""
        rewards = [shaping.reward(s) for s in self.samples]
        advantages = group_advantages(rewards, shaping.norm_by_std)
        return [
            {"prompt_ids": s.prompt_ids, "response_ids": s.output_ids, "response_tokens": s.n_tokens,
             "advantage": a, "reward": r, "group": self.id, "logprobs": s.logprobs, "weight_version": s.weight_version,
             **({"loss_mask": s.loss_mask} if s.loss_mask is not None else {})}
            for s, a, r in zip(self.samples, advantages, rewards)
            if not (shaping.filter_truncated and s.finish_reason == "length")
        ]


@dataclass
class Generated:
    """One model turn as the servers returned it."""

    server: str
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    """The weight version of each segment (more than one after an abort-and-resume)."""
    n_tokens: int
    finish_reason: str
    t_start: float
    t_end: float


def trajectory_fields(samples: list[Sample]) -> Mapping[str, Any]:
    """group_completed's fields for trajectories (none for single responses): each sample's model
    turns as [server, start, end, tokens, versions] and tool calls as [name, start, seconds, ok]."""
    if not any(s.turns for s in samples):
        return {}
    return {
        "turns": [[[t["server"], t["t_start"], t["t_end"], t["tokens"], t["versions"]] for t in s.turns] for s in samples],
        "tools": [[[c["name"], c["t_start"], c["seconds"], c["ok"]] for c in s.tool_calls] for s in samples],
        "finish_reasons": [s.finish_reason for s in samples],
    }
