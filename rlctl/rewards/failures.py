"""Reward errors: a verifier that raised, or ran past reward.timeout_s, on one response.

The scorer (rlctl/pipelines/scoring.py) catches the failure where the verifier runs and raises
`VerifierFailed` with its traceback; the scheduler hands it to `RewardErrors`, which writes the
traceback and the sample (prompt, response, answer, each cut to a few lines) to the log and to a
`reward_error` event, and then either fails the run (`RewardError`, the run's exit reason) or
scores the response 0 (reward.on_error).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from rlctl.errors import RunError
from rlctl.recipe import RewardConfig, Verifier
from rlctl.recipe.checks import clip
from rlctl.recipe.choices import RewardOnError

log = logging.getLogger("rlctl.rewards")

EXCERPT_LINES = 4
"""Lines of a prompt, response or answer a report shows: its first two and last two."""
EXCERPT_WIDTH = 200
TRACEBACK_LINES = 40
"""The last lines of a traceback a report keeps (the innermost frames and the error)."""
ERROR_WIDTH = 160
"""A traceback's last line, as the run's exit reason quotes it."""


class VerifierFailed(Exception):
    """The verifier raised, or did not return in time, on one response."""

    def __init__(self, response: str, error: str, traceback: str = "") -> None:
        super().__init__(error)
        self.response = response
        self.error = clip(error, ERROR_WIDTH)
        """One line: the traceback's last line (`ZeroDivisionError: division by zero`) or what
        happened instead (`did not return within 60 s (reward.timeout_s)`)."""
        self.traceback = traceback


class RewardError(RunError):
    """A run ends on a reward error: on_error=fail, or more errors than reward.max_errors."""


def excerpt(text: str, lines: int = EXCERPT_LINES, width: int = EXCERPT_WIDTH) -> str:
    """`text` cut to its first and last lines (`lines` in all), each at most `width` characters."""
    rows = text.splitlines() or [""]
    if len(rows) > lines:
        head, tail = lines // 2, lines - lines // 2
        rows = [*rows[:head], f"... ({len(rows) - lines} lines cut) ...", *rows[-tail:]]
    return "\n".join(clip(row, width) for row in rows)


def last_lines(text: str, limit: int = TRACEBACK_LINES) -> str:
    rows = text.rstrip("\n").splitlines()
    return "\n".join(rows if len(rows) <= limit else [f"... ({len(rows) - limit} lines cut) ...", *rows[-limit:]])


def verifier_name(reward: RewardConfig) -> str:
    """The verifier as a message names it: `reward.function my_reward:score`, `reward.verifier math`."""
    return f"reward.function {reward.function}" if reward.verifier is Verifier.FUNCTION else \
        f"reward.verifier {reward.verifier}"


class RewardErrors:
    """What the scheduler does with a response its verifier failed on. Every error goes to a
    `reward_error` event and to the log: in full (traceback and sample) the first time its
    traceback's last line is seen, as one line after that. Then on_error=fail fails the run;
    on_error=zero scores the response 0, until the run's errors number more than max_errors."""

    def __init__(self, on_error: RewardOnError = RewardOnError.FAIL, max_errors: int = 0,
                 what: str = "the verifier") -> None:
        self.on_error, self.max_errors, self.what = on_error, max_errors, what
        self.count = 0
        """Reward errors so far in this run."""
        self._seen: set[str] = set()

    @classmethod
    def of(cls, reward: RewardConfig) -> RewardErrors:
        return cls(reward.on_error, reward.max_errors, verifier_name(reward))

    def failed(self, failure: VerifierFailed, emit: Callable[..., None], t: float, *, prompt: str, answer: str,
               step: int, group: int, sample: int) -> float:
        """The response's reward (0.0), or RewardError when the run is to fail."""
        self.count += 1
        zero = self.on_error is RewardOnError.ZERO and self.count <= self.max_errors
        sample_text = {"prompt": excerpt(prompt), "response": excerpt(failure.response), "answer": excerpt(answer)}
        trace = last_lines(failure.traceback)
        emit("reward_error", t, step=step, group=group, sample=sample, error=failure.error, errors=self.count,
             scored_zero=zero, traceback=trace, **sample_text)
        where = f"step {step}, group {group}, sample {sample}"
        if failure.error in self._seen:
            log.warning("reward error %d (%s): %s%s", self.count, where, failure.error, "; scored 0" if zero else "")
        else:
            self._seen.add(failure.error)
            log.error("%s", report(self.what, where, failure.error, trace, sample_text))
        if self.on_error is RewardOnError.FAIL:
            shown = "the traceback and the sample" if failure.traceback else "the sample"
            raise RewardError(f"{self.what} failed on a response of step {step}: {failure.error} (the controller's "
                              f"log has {shown}; reward.on_error: zero would score it 0)")
        if not zero:
            raise RewardError(f"{self.what}: {self.count} reward errors, more than reward.max_errors "
                              f"({self.max_errors}); the last: {failure.error}; tracebacks in the controller's log")
        return 0.0


def report(what: str, where: str, error: str, trace: str, sample: dict[str, Any]) -> str:
    """A reward error as the log shows it: what failed where, the traceback, then the sample."""
    lines = [f"reward error: {what} failed on a response ({where}): {error}"]
    if trace:
        lines += ["  " + row for row in trace.splitlines()]
    for key, text in sample.items():
        rows = str(text).splitlines() or [""]
        lines += [f"  {key}: {rows[0]}", *("  " + " " * (len(key) + 2) + row for row in rows[1:])]
    return "\n".join(lines)
