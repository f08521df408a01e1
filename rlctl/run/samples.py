"""A run's samples.jsonl read back and chosen: by step, best or worst reward first, or holding a
text (`rlctl samples`). A line that is not a sample is skipped, never fatal."""

from __future__ import annotations

import textwrap
from typing import Any

from rlctl.run.dir import RunDir

FIELDS = {"step": int, "group": int, "sample": int, "reward": (int, float), "response": str, "answer": str}
"""What a line must hold to be shown."""


def read_samples(rd: RunDir) -> list[dict[str, Any]]:
    if not rd.samples_path.exists():
        return []
    lines, _ = rd.jsonl(rd.samples_path)
    return [x for x in lines if all(isinstance(x.get(k), t) and not isinstance(x.get(k), bool) for k, t in FIELDS.items())]


def choose(samples: list[dict[str, Any]], *, step: int | None = None, order: str | None = None,
           grep: str | None = None, limit: int = 8) -> list[dict[str, Any]]:
    """The samples of `step` (all steps: None; the last step the file holds: -1), holding `grep`
    in their prompt, response or answer (case-insensitive), best or worst reward first (order
    "best" / "worst"; else in the order written), at most `limit`."""
    if step == -1 and samples:
        step = max(x["step"] for x in samples)
    chosen = [x for x in samples if step is None or x["step"] == step]
    if grep:
        needle = grep.lower()
        chosen = [x for x in chosen if needle in f"{prompt_text(x.get('prompt'))}\n{x['response']}\n{x['answer']}".lower()]
    if order in ("best", "worst"):
        chosen = sorted(chosen, key=lambda x: x["reward"], reverse=order == "best")
    return chosen[:limit]


def prompt_text(prompt: Any) -> str:
    """A prompt as text: itself, or chat messages as `role: content` lines."""
    if isinstance(prompt, list):
        return "\n".join(f"{m.get('role', '?')}: {m.get('content', '')}" for m in prompt if isinstance(m, dict))
    return str(prompt or "")


def render(sample: dict[str, Any], width: int = 100, max_lines: int = 12) -> str:
    """One sample as a few readable lines: a header, then the prompt, the response and the answer."""
    scores = sample.get("scores") or {}
    named = f" ({', '.join(f'{k} {v:g}' for k, v in scores.items() if isinstance(v, int | float))})" if scores else ""
    source = f" · {sample['source']}" if sample.get("source") else ""
    header = (f"step {sample['step']} · group {sample['group']} · sample {sample['sample']}{source} · "
              f"reward {sample['reward']:g}{named} · {sample.get('response_tokens', '?')} tokens · "
              f"{sample.get('finish_reason') or '?'} · weights v{sample.get('version', '?')}")
    parts = [header]
    shown = [("prompt", prompt_text(sample.get("prompt")))]
    if isinstance(sample.get("trajectory"), str):  # a trajectory of turns: all of it, then its scored last turn
        shown.append((f"trajectory ({sample.get('turns', '?')} turns, {sample.get('tool_calls', '?')} tool calls, "
                      f"{sample.get('tool_calls_ok', '?')} ok)", sample["trajectory"]))
    for label, text in [*shown, ("response", sample["response"]), ("answer", sample["answer"])]:
        parts.append(f"  {label}:")
        lines = [w for line in text.splitlines() or [""] for w in textwrap.wrap(line, width - 4) or [""]]
        if len(lines) > max_lines:
            lines = [*lines[: max_lines // 2], f"... ({len(lines) - max_lines + 1} lines cut) ...",
                     *lines[-(max_lines // 2 - 1):]]
        parts += [f"    {line}" for line in lines]
    return "\n".join(parts)
