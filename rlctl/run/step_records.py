"""metrics.jsonl read back for comparison: one record per step (the last written winning), cut to
the fields `rlctl compare` reads, streamed so that a file of gigabytes costs only what is kept."""

from __future__ import annotations

import math
from typing import Any

from rlctl.run.dir import RunDir, UnreadableRun

QUALITY = ("reward_mean", "response_len_mean")
TIME = ("step_time", "rollout_time", "train_time", "sync_time", "trainer_wait_ratio", "rollout_to_train_end",
        "efficiency", "tokens_per_s")
MAX_METRICS_LINE = 1 << 20
"""A line of metrics.jsonl longer than this (1 MiB; a record is about 1 KiB) is skipped unread."""
KEPT = frozenset({"step", "samples", "samples_total", "tokens_total", "optimizer_steps", "train_batches",
                  "elapsed_s", "groups", "groups_dropped_by_reason", *QUALITY, *TIME})
"""The fields of a metrics record that compare reads (the tables, the alignment, --group-by, --plot)."""


def read_metrics(rd: RunDir) -> tuple[list[dict[str, Any]], int]:
    """metrics.jsonl with one record per step, the last written winning, in step order, each cut
    to the fields compare reads (KEPT); and how many lines were skipped: not JSON objects, or
    longer than MAX_METRICS_LINE. Streamed line by line, so a file of gigabytes costs the records
    kept, not the file (records whose step is not an integer >= 0 are left out). UnreadableRun if
    it cannot be read at all."""
    from rlctl.run.tail import describe_open_error, stream_jsonl

    by_step: dict[int, dict[str, Any]] = {}
    bad = 0
    try:
        for m in stream_jsonl(rd.metrics_path, MAX_METRICS_LINE):
            if m is None:
                bad += 1
                continue
            step = m.get("step")
            if isinstance(step, int) and not isinstance(step, bool) and step >= 0:
                by_step[step] = {k: v for k, v in m.items() if k in KEPT}
    except OSError as e:
        raise UnreadableRun(rd.id, describe_open_error("metrics.jsonl", rd.metrics_path, e)) from None
    return [by_step[k] for k in sorted(by_step)], bad


def metrics_by_step(rd: RunDir) -> list[dict[str, Any]]:
    """read_metrics' records."""
    return read_metrics(rd)[0]


def finite(value: Any) -> bool:
    """A number that can be averaged and drawn: not a bool, a string, nan or inf."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
