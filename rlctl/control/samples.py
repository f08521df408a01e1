"""The controller's samples.jsonl: what the model wrote and what the reward made of it, for the
first run.sample_groups groups to complete in each step (rlctl/run/samples.py reads it back)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rlctl.run.dir import RunDir, append_jsonl

if TYPE_CHECKING:
    from rlctl.pipelines.groups import Group


class SampleWriter:
    """Appends one line per sample of each chosen group, as it completes."""

    def __init__(self, rd: RunDir, groups_per_step: int) -> None:
        self.path = rd.samples_path
        self.groups_per_step = groups_per_step
        self._written: dict[int, int] = {}
        """Groups written so far, per step."""

    def __call__(self, group: Group) -> None:
        done = self._written.get(group.step, 0)
        if done >= self.groups_per_step:
            return
        self._written[group.step] = done + 1
        for line in sample_lines(group):
            append_jsonl(self.path, line)


def sample_lines(group: Group) -> list[dict[str, Any]]:
    p = group.prompt
    return [{"step": group.step, "group": group.id, "sample": s.index, "source": p.source, "prompt": p.prompt,
             "answer": p.answer, "response": s.text, "reward": s.reward, "scores": s.scores,
             "version": s.weight_version, "finish_reason": s.finish_reason, "prompt_tokens": len(group.prompt_ids),
             "response_tokens": s.n_tokens, **trajectory(s)} for s in group.samples]


def trajectory(s: Any) -> dict[str, Any]:
    """A trajectory's whole text, its model turns and its tool calls (nothing for a single response)."""
    if not s.turns:
        return {}
    return {"trajectory": s.trajectory, "turns": len(s.turns), "tool_calls": len(s.tool_calls),
            "tool_calls_ok": sum(1 for c in s.tool_calls if c["ok"])}
