"""A run's evaluations read back from eval.jsonl (written by rlctl/control/evaluation.py): per
held-out set, the first and the latest evaluation, as `rlctl status`, `rlctl compare` and the end
of `rlctl launch` show them.

Like metrics.jsonl, the file is read line by line and what cannot be used is skipped and counted:
a line that is not a JSON object (or longer than MAX_LINE), a record without a set name or an
integer `steps`, a value that is not a finite number. An evaluation written twice for the same
set and step (a resumed run) counts once, the later one.
"""

from __future__ import annotations

import math
from typing import Any

from rlctl.run.dir import RunDir, UnreadableRun
from rlctl.run.tail import describe_open_error, stream_jsonl

MAX_LINE = 1 << 20


def headline(record: dict[str, Any]) -> dict[str, float]:
    """mean@k, pass@1 and pass@k of a record (its finite numbers only)."""
    return {k: float(v) for k, v in record.items()
            if k.startswith(("mean@", "pass@")) and isinstance(v, (int, float)) and not isinstance(v, bool)
            and math.isfinite(v)}


def read_evals(rd: RunDir) -> tuple[dict[str, list[dict[str, Any]]], int]:
    """Each set's evaluations in step order, and how many lines were skipped. UnreadableRun when
    eval.jsonl exists and cannot be read at all."""
    by_set: dict[str, dict[int, dict[str, Any]]] = {}
    bad = 0
    if not rd.eval_path.exists():
        return {}, 0
    try:
        for record in stream_jsonl(rd.eval_path, MAX_LINE):
            if (record is None or not isinstance(record.get("set"), str) or isinstance(record.get("steps"), bool)
                    or not isinstance(record.get("steps"), int)):
                bad += 1
                continue
            by_set.setdefault(record["set"], {})[record["steps"]] = record
    except OSError as e:
        raise UnreadableRun(rd.id, describe_open_error("eval.jsonl", rd.eval_path, e)) from None
    return {name: [runs[s] for s in sorted(runs)] for name, runs in sorted(by_set.items())}, bad


def evals_of(rd: RunDir) -> tuple[dict[str, list[dict[str, Any]]], list[str]]:
    """read_evals(), and what could not be read as problems (`rlctl compare` lists them)."""
    try:
        evals, bad = read_evals(rd)
    except UnreadableRun as e:
        return {}, [e.why]
    return evals, [f"eval.jsonl: {bad} line{'s' if bad > 1 else ''} skipped (not evaluation records)"] if bad else []


def eval_comparison(runs: list[dict[str, list[dict[str, Any]]]]) -> dict[str, list[dict[str, Any] | None]]:
    """`rlctl compare`'s eval rows, of each run's read_evals(): per held-out set and number
    (`gsm8k pass@4`), per run: the first and the latest evaluation
    and the steps trained at it, and the latest's difference to A's (None: the run has none)."""
    names = sorted({(s, k) for evals in runs for s, records in evals.items() for k in headline(records[-1])})
    rows: dict[str, list[dict[str, Any] | None]] = {}
    for s, k in names:
        row: list[dict[str, Any] | None] = []
        for evals in runs:
            records = [x for x in evals.get(s, []) if k in headline(x)]
            row.append({"first": headline(records[0])[k], "last": headline(records[-1])[k],
                        "steps": records[-1]["steps"]} if records else None)
        base = row[0]["last"] if row[0] else None
        for cell in row:
            if cell is not None:
                cell["diff"] = cell["last"] - base if base is not None else None
        rows[f"{s} {k}"] = row
    return rows


def eval_summary(rd: RunDir) -> list[dict[str, Any]]:
    """Per set: its name, prompts, k, and the first and latest evaluation ({steps, version,
    numbers}); [] for a run without evaluations or whose eval.jsonl cannot be read."""
    try:
        sets, _ = read_evals(rd)
    except UnreadableRun:
        return []
    out = []
    for name, records in sets.items():
        first, last = records[0], records[-1]
        out.append({"set": name, "prompts": last.get("prompts"), "k": last.get("k"), "evaluations": len(records),
                    "first": _point(first), "last": _point(last)})
    return out


def _point(record: dict[str, Any]) -> dict[str, Any]:
    return {"steps": record["steps"], "version": record.get("version"), "numbers": headline(record)}


def eval_lines(summary: list[dict[str, Any]]) -> list[str]:
    """One line per set: `eval gsm8k (256 prompts x 4): pass@4 0.41 -> 0.57, ... (0 -> 100 steps)`."""
    lines = []
    for s in summary:
        first, last = s["first"], s["last"]
        size = f" ({s['prompts']} prompts x {s['k']})" if s.get("prompts") is not None else ""
        if s["evaluations"] > 1:
            numbers = ", ".join(f"{k} {first['numbers'].get(k, math.nan):.3f} -> {v:.3f}"
                                for k, v in last["numbers"].items())
            when = f"({first['steps']} -> {last['steps']} steps)"
        else:
            numbers = ", ".join(f"{k} {v:.3f}" for k, v in last["numbers"].items())
            when = f"(after {last['steps']} steps)"
        lines.append(f"eval {s['set']}{size}: {numbers} {when}")
    return lines
