"""What differs between runs and what it did: pure functions over run directories.

`rlctl compare` (rlctl/commands/compare.py) renders what `comparison()` returns; `--json` prints
it as is, so the keys below are stable:

    runs     [{label, id, state, exit_reason, launcher, mode, code: {commit, dirty}, steps, path}]
    config   {keys_total, keys_differ, differ: {dotted key: [value per run]}}
    metrics  {name: [{last_mean, best, diff, pct} per run]}          reward_mean, response_len_mean
    time     {name: [{median, ratio} per run]}                       step_time, rollout_time, ...
    curves   {label: [reward per step]}
    groups   (with group_by) {key, groups: [{value, runs, n, <metric>: {mean, lo, hi}}]}

Requeued or resumed runs can write a step twice: the last record of a step wins.
"""

from __future__ import annotations

import json
import random
import re
import statistics
from typing import Any

import yaml

from rlctl.rundir import RunDir, read_jsonl

QUALITY = ("reward_mean", "response_len_mean")
NOT_CONFIG = ("run.output_dir",)  # where a run was written is not what it was
TIME = ("step_time", "rollout_time", "train_time", "sync_time", "trainer_wait_ratio", "rollout_to_train_end",
        "efficiency", "tokens_per_s")
SPARK = "▁▂▃▄▅▆▇█"


def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists stay values."""
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        out.update(flatten(v, key) if isinstance(v, dict) and v else {key: v})
    return out


def metrics_by_step(rd: RunDir) -> list[dict[str, Any]]:
    """metrics.jsonl with one record per step, the last written winning, in step order."""
    by_step: dict[int, dict[str, Any]] = {}
    for m in read_jsonl(rd.metrics_path):
        if "step" in m:
            by_step[int(m["step"])] = m
    return [by_step[k] for k in sorted(by_step)]


def sparkline(values: list[float], width: int = 16) -> str:
    if not values:
        return ""
    if len(values) > width:  # mean of equal slices
        edges = [round(i * len(values) / width) for i in range(width + 1)]
        values = [statistics.fmean(values[a:b]) for a, b in zip(edges, edges[1:]) if b > a]
    lo, hi = min(values), max(values)
    span = hi - lo or 1.0
    return "".join(SPARK[min(len(SPARK) - 1, int((v - lo) / span * len(SPARK)))] for v in values)


def bootstrap_ci(values: list[float], n: int = 2000, level: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean."""
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(values, k=len(values))) for _ in range(n))
    a = (1 - level) / 2
    return means[int(a * n)], means[min(n - 1, int((1 - a) * n))]


def _label(i: int) -> str:
    return chr(ord("A") + i) if i < 26 else f"R{i}"


def load_run(rd: RunDir) -> dict[str, Any]:
    info = rd.read()
    try:
        recipe = yaml.safe_load(rd.recipe_path.read_text()) or {}
    except (OSError, yaml.YAMLError):
        recipe = {}
    return {"rd": rd, "info": info, "config": flatten(recipe), "metrics": metrics_by_step(rd)}


def comparison(runs: list[RunDir], last: int = 5, group_by: str | None = None) -> dict[str, Any]:
    loaded = [load_run(rd) for rd in runs]
    out: dict[str, Any] = {"runs": [], "config": {}, "metrics": {}, "time": {}, "curves": {}}
    for i, r in enumerate(loaded):
        info = r["info"]
        out["runs"].append({
            "label": _label(i), "id": info["id"], "state": info["state"], "exit_reason": info.get("exit_reason"),
            "launcher": info.get("launcher"), "mode": info.get("mode"), "code": info.get("code") or {},
            "steps": len(r["metrics"]), "path": str(r["rd"].path),
        })
        out["curves"][_label(i)] = [m.get("reward_mean") for m in r["metrics"]]

    keys = sorted(set().union(*(r["config"] for r in loaded)) - set(NOT_CONFIG))
    missing = object()
    differ = {}
    for k in keys:
        values = [r["config"].get(k, missing) for r in loaded]
        if any(v != values[0] for v in values[1:]):
            differ[k] = [None if v is missing else v for v in values]
    out["config"] = {"keys_total": len(keys), "keys_differ": len(differ), "differ": differ}

    for name in QUALITY:
        rows = []
        for r in loaded:
            values = [m[name] for m in r["metrics"] if isinstance(m.get(name), (int, float))]
            rows.append({"last_mean": statistics.fmean(values[-last:]) if values else None,
                         "best": max(values) if values else None})
        base = rows[0]["last_mean"]
        for row in rows:
            ok = row["last_mean"] is not None and base is not None
            row["diff"] = row["last_mean"] - base if ok else None
            row["pct"] = (row["last_mean"] / base - 1) * 100 if ok and base else None
        out["metrics"][name] = rows

    for name in TIME:
        rows = []
        for r in loaded:
            values = [m[name] for m in r["metrics"] if isinstance(m.get(name), (int, float))]
            rows.append({"median": statistics.median(values) if values else None})
        base = rows[0]["median"]
        for row in rows:
            row["ratio"] = row["median"] / base if row["median"] is not None and base else None
        out["time"][name] = rows

    if group_by:
        out["groups"] = _groups(loaded, group_by, last)
    return out


def _groups(loaded: list[dict[str, Any]], key: str, last: int) -> dict[str, Any]:
    if not any(key in r["config"] for r in loaded):
        from rlctl.errors import UsageError

        raise UsageError(f"--group-by {key}: no run has that recipe key (keys look like pipeline.mode, run.seed)")
    order: dict[str, list[int]] = {}
    for i, r in enumerate(loaded):
        order.setdefault(json.dumps(r["config"].get(key)), []).append(i)
    groups = []
    for value, members in order.items():
        g: dict[str, Any] = {"value": json.loads(value), "runs": [_label(i) for i in members], "n": len(members)}
        for name in ("reward_mean", "step_time", "rollout_to_train_end", "trainer_wait_ratio"):
            per_run = []
            for i in members:
                values = [m[name] for m in loaded[i]["metrics"] if isinstance(m.get(name), (int, float))]
                if values:
                    per_run.append(statistics.fmean(values[-last:]) if name == "reward_mean" else statistics.median(values))
            if not per_run:
                g[name] = None
                continue
            lo, hi = bootstrap_ci(per_run) if len(per_run) >= 3 else (None, None)
            g[name] = {"mean": statistics.fmean(per_run), "lo": lo, "hi": hi}
        groups.append(g)
    return {"key": key, "groups": groups}


_CONDITION = re.compile(r"^\s*([a-z_]+)\.(median|ratio|last_mean|best|diff|pct)\s*(<=|>=|==|!=|<|>)\s*(-?[\d.]+(?:e-?\d+)?)\s*$")
_OPS = {"<": float.__lt__, ">": float.__gt__, "<=": float.__le__, ">=": float.__ge__, "==": float.__eq__,
        "!=": float.__ne__}


def failing(comp: dict[str, Any], expr: str) -> list[str]:
    """--fail-if: the runs other than the first for which `METRIC.FIELD OP NUMBER` holds, e.g.
    "rollout_to_train_end.ratio > 0.8" or "reward_mean.pct < -5". Several conditions: comma-separated
    (any one holding fails)."""
    from rlctl.errors import UsageError

    hits = []
    for cond in expr.split(","):
        m = _CONDITION.match(cond)
        if not m:
            raise UsageError(f"--fail-if {cond.strip()!r}: write METRIC.FIELD OP NUMBER, e.g. 'rollout_to_train_end.ratio > 0.8'")
        metric, field, op, number = m.groups()
        table = comp["time"] if metric in comp["time"] else comp["metrics"] if metric in comp["metrics"] else None
        if table is None:
            raise UsageError(f"--fail-if: unknown metric {metric!r}; one of {', '.join([*QUALITY, *TIME])}")
        if field not in table[metric][0]:
            raise UsageError(f"--fail-if: {metric} has fields {', '.join(table[metric][0])}, not {field!r}")
        for run, row in list(zip(comp["runs"], table[metric]))[1:]:
            value = row[field]
            if value is not None and _OPS[op](float(value), float(number)):
                hits.append(f"{run['label']} {run['id']}: {metric}.{field} = {value:.4g} {op} {number}")
    return hits
