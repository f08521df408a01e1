"""What differs between runs and what it did: pure functions over run directories.

`rlctl compare` (rlctl/commands/compare.py) renders what `comparison()` returns; `--json` prints
it as is, so the keys below are stable:

    runs     [{label, id, state, exit_reason, launcher, mode, code: {commit, dirty}, steps,
              optimizer_steps_per_step, samples_per_step, groups, dropped: {reason: n}, path}]
    x        {by, end, unit, covered: [per run], notes: [...], last_from}: what runs are aligned
             on (--x), up to `end`, the most every run covers; notes say when runs differ in length
             or in what a step means; "last" means are over (last_from, end]
    config   {keys_total, keys_differ, differ: {dotted key: [value per run]}}
    metrics  {name: [{last_mean, best, diff, pct} per run]}          reward_mean, response_len_mean
    time     {name: [{median, ratio} per run]}                       step_time, rollout_time, ...
    eval     {"<set> <number>": [{first, last, steps, diff} or None per run]}  eval.jsonl: the first and
             latest evaluation of each held-out set, mean@k, pass@1, pass@k (diff: the latest vs A's)
    curves   {label: [reward per step]}
    curves_x {label: [x per step]}
    groups   (with group_by) {key, groups: [{value, runs, n, <metric>: {mean, lo, hi}}]}
    unreadable  (only when a run cannot be read) [{id, path, why}]: left out of everything above

A run whose run.json cannot be read is left out (and listed under `unreadable`); one whose
recipe.yaml or metrics.jsonl is damaged stays in, with `problems` in its `runs` entry saying what
was skipped. Lines of metrics.jsonl that are not JSON objects (or longer than 1 MiB), steps that
are not integers and values that are not finite numbers are skipped; metrics.jsonl is read line by
line, and only the fields compare shows are kept (KEPT).

Requeued or resumed runs can write a step twice: the last record of a step wins.

A step is not the same unit in every run (a sync step is batch_size / groups_per_batch optimizer
steps, an async step one), so runs are aligned on what they did: samples generated (the
default), tokens, optimizer steps or seconds since the start, and compared over the range every
run covers. Learning is the mean over the last part of that range (where the baseline's last K
records lie, the same work for every run); times are medians over the records in range, and
seconds per 1,000 samples is comparable across modes.
"""

from __future__ import annotations

import json
import random
import re
import statistics
from typing import Any

import yaml

from rlctl.run.dir import RunDir, UnreadableRun
from rlctl.run.evals import eval_comparison, evals_of
from rlctl.run.step_records import MAX_METRICS_LINE, QUALITY, TIME, finite, read_metrics

NOT_CONFIG = ("run.output_dir",)  # where a run was written is not what it was
SPARK = "▁▂▃▄▅▆▇█"
X_UNITS = {"samples": "samples", "tokens": "tokens", "optimizer_steps": "optimizer steps", "time": "s",
           "steps": "steps"}
"""--x: what the runs are aligned on, and its unit."""


def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists stay values."""
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        out.update(flatten(v, key) if isinstance(v, dict) and v else {key: v})
    return out


def _values(metrics: list[dict[str, Any]], name: str) -> list[float]:
    return [m[name] for m in metrics if finite(m.get(name))]


def sparkline(values: list[float], width: int = 16) -> str:
    values = [v for v in values if finite(v)]
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


def _recipe_config(rd: RunDir) -> tuple[dict[str, Any] | None, str | None]:
    """The run's resolved recipe flattened, or None and why it cannot be read. Parsed within
    the bounds of a recipe (rlctl/recipe/bounded_yaml.py): a damaged recipe.yaml (an alias bomb,
    50 MB, a FIFO) costs nothing."""
    from rlctl.recipe.bounded_yaml import MAX_RECIPE_BYTES, YamlLimit, parse_bounded
    from rlctl.run.check import one_line
    from rlctl.run.tail import describe_open_error, open_regular, read_capped

    try:
        with open_regular(rd.recipe_path) as f:
            raw = read_capped(f, MAX_RECIPE_BYTES)
        if raw is None:
            return None, f"recipe.yaml is larger than {MAX_RECIPE_BYTES >> 20} MiB"
        recipe = parse_bounded(raw.decode(), max_bytes=MAX_RECIPE_BYTES)
    except OSError as e:
        return None, describe_open_error("recipe.yaml", rd.recipe_path, e)
    except (UnicodeDecodeError, YamlLimit, yaml.YAMLError) as e:
        what = e.message if isinstance(e, YamlLimit) else one_line(str(e), 80)
        return None, f"recipe.yaml is not a readable recipe ({what})"
    if recipe is None or isinstance(recipe, dict):
        return flatten(recipe or {}), None
    return None, f"recipe.yaml holds {type(recipe).__name__}, not a mapping"


def load_run(rd: RunDir) -> dict[str, Any]:
    """run.json (UnreadableRun if it cannot be read), the recipe flattened and the metrics by
    step; `problems` says what else could not be read (then config or metrics are empty)."""
    info = rd.read()
    config, why = _recipe_config(rd)
    problems = [why] if why else []
    try:
        metrics, bad = read_metrics(rd)
    except UnreadableRun as e:
        metrics, bad, problems = [], 0, [*problems, e.why]
    if bad:
        problems.append(f"metrics.jsonl: {bad} line{'s' if bad > 1 else ''} skipped (not JSON objects, or "
                        f"longer than {MAX_METRICS_LINE >> 20} MiB)")
    evals, eval_problems = evals_of(rd)
    problems += eval_problems
    return {"rd": rd, "info": info, "config": config, "metrics": metrics, "evals": evals, "problems": problems}



def progress_x(metrics: list[dict[str, Any]], by: str) -> list[float]:
    """Each record's position on the --x axis: its cumulative field where the record has one
    (samples_total, ...), else summed from the per-step fields older records have."""
    cumulative, per_step = {"samples": ("samples_total", lambda m: m.get("samples", 0)),
                            "tokens": ("tokens_total", lambda m: m.get("samples", 0) * m.get("response_len_mean", 0)),
                            "optimizer_steps": ("optimizer_steps", lambda m: m.get("train_batches", 0)),
                            "time": ("elapsed_s", lambda m: m.get("step_time", 0))}.get(by, (None, None))
    if cumulative is None:
        return [float(m["step"] + 1) for m in metrics]
    out, total = [], 0.0
    for m in metrics:
        step = per_step(m)
        total += step if finite(step) else 0.0
        out.append(float(m[cumulative]) if finite(m.get(cumulative)) else total)
    return out


X_FIELDS = {"samples": ("samples_total", "samples"), "tokens": ("tokens_total", "response_len_mean"),
            "optimizer_steps": ("optimizer_steps", "train_batches"), "time": ("elapsed_s", "step_time")}


def _has_x(metrics: list[dict[str, Any]], by: str) -> bool:
    """Do the records hold what --x `by` is counted from (their cumulative field, or the per-step one)?"""
    return by == "steps" or all(any(finite(m.get(k)) for k in X_FIELDS[by]) for m in metrics)


def _within(r: dict[str, Any], end: float) -> list[dict[str, Any]]:
    """The run's records up to `end` on its axis (at least its first)."""
    kept = [m for m, x in zip(r["metrics"], r["x"]) if x <= end * (1 + 1e-9)]
    return kept or r["metrics"][:1]


def _alignment(loaded: list[dict[str, Any]], by: str) -> dict[str, Any]:
    """The range every run covers on the --x axis, and what the reader must know about it."""
    unit = X_UNITS[by]
    covered = [r["x"][-1] if r["x"] else 0.0 for r in loaded]
    with_data = [c for c in covered if c > 0]
    end = min(with_data) if with_data else 0.0
    notes = []
    if with_data and max(with_data) > end * 1.01:
        spans = ", ".join(f"{_label(i)} {c:,.0f}" for i, c in enumerate(covered))
        notes.append(f"runs differ in length ({unit}: {spans}): compared over the first {end:,.0f} {unit}, "
                     "which every run covers")
    per_step = [statistics.median(v) if (v := _values(r["metrics"], "train_batches")) else None for r in loaded]
    if len({v for v in per_step if v is not None}) > 1:
        what = ", ".join(f"{_label(i)} {v:g}" for i, v in enumerate(per_step) if v is not None)
        how = "by step, which is not the same unit here" if by == "steps" else f"by {unit}, not by step"
        notes.append(f"a step is a different number of optimizer steps ({what}): compared {how}")
    return {"by": by, "unit": unit, "end": end, "covered": covered, "notes": notes}


def comparison(runs: list[RunDir], last: int = 5, group_by: str | None = None, by: str = "samples") -> dict[str, Any]:
    loaded, unreadable = [], []
    for rd in runs:
        try:
            loaded.append(load_run(rd))
        except UnreadableRun as e:
            unreadable.append({"id": rd.id, "path": str(rd.path), "why": e.why})
    if not loaded:
        raise UnreadableRun(unreadable[0]["id"], unreadable[0]["why"])
    if by not in X_UNITS:
        from rlctl.errors import UsageError

        raise UsageError(f"--x {by}: one of {', '.join(X_UNITS)}")
    lacking = [_label(i) for i, r in enumerate(loaded) if r["metrics"] and not _has_x(r["metrics"], by)]
    asked = by
    if lacking:  # a run whose records cannot say (an older or damaged run): steps are all that is common
        by = "steps"
    for r in loaded:
        r["x"] = progress_x(r["metrics"], by)
    x = _alignment(loaded, by)
    if lacking:
        x["notes"].insert(0, f"the records of {', '.join(lacking)} do not count {X_UNITS[asked]}: aligned by step")
    out: dict[str, Any] = {"runs": [], "x": x, "config": _config_diff(loaded), "metrics": {}, "time": {},
                           "curves": {}, "curves_x": {}}
    for i, r in enumerate(loaded):
        info, metrics = r["info"], r["metrics"]
        out["runs"].append({
            "label": _label(i), "id": info["id"], "state": info["state"], "exit_reason": info.get("exit_reason"),
            "launcher": info.get("launcher"), "mode": info.get("mode"), "code": info.get("code") or {},
            "steps": len(metrics), "optimizer_steps_per_step": _median(metrics, "train_batches"),
            "samples_per_step": _median(metrics, "samples"), "path": str(r["rd"].path),
            "groups": sum(int(m["groups"]) for m in metrics if finite(m.get("groups"))),
            "dropped": (metrics[-1].get("groups_dropped_by_reason") or {}) if metrics else {},
            **({"problems": r["problems"]} if r["problems"] else {}),
        })
        out["curves"][_label(i)] = [m["reward_mean"] if finite(m.get("reward_mean")) else None for m in metrics]
        out["curves_x"][_label(i)] = r["x"]
        r["x"] = r["x"][:len(_within(r, x["end"]))]
        r["metrics"] = _within(r, x["end"])  # from here on: the range every run covers
    since = _window_start(loaded, last)
    x["last_from"] = since
    for name in QUALITY:
        out["metrics"][name] = _quality_rows([_since(r, since) for r in loaded], name)
    for name in TIME:
        out["time"][name] = _ratios([{"median": _median(r["metrics"], name)} for r in loaded])
    out["time"]["seconds_per_1k_samples"] = _ratios([{"median": _per_1k_samples(r["metrics"])} for r in loaded])
    out["eval"] = eval_comparison([r["evals"] for r in loaded])
    if group_by:
        out["groups"] = _groups(loaded, group_by, since)
    if unreadable:
        out["unreadable"] = unreadable
    return out


def _median(metrics: list[dict[str, Any]], name: str) -> float | None:
    values = _values(metrics, name)
    return statistics.median(values) if values else None


def _ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    base = rows[0]["median"]
    for row in rows:
        row["ratio"] = row["median"] / base if row["median"] is not None and base else None
    return rows


def _per_1k_samples(metrics: list[dict[str, Any]]) -> float | None:
    """Seconds per 1,000 samples generated over the records: comparable whatever a step is."""
    seconds, samples = sum(_values(metrics, "step_time")), sum(_values(metrics, "samples"))
    return seconds / samples * 1000 if samples else None


def _config_diff(loaded: list[dict[str, Any]]) -> dict[str, Any]:
    """The recipe keys whose values differ; a run whose recipe cannot be read counts as having
    none of them (its values are None) and does not by itself make a key differ."""
    readable = [r["config"] for r in loaded if r["config"] is not None]
    keys = sorted(set().union(*readable) - set(NOT_CONFIG))
    missing = object()
    differ = {}
    for k in keys:
        values = [missing if r["config"] is None else r["config"].get(k, missing) for r in loaded]
        known = [v for v, r in zip(values, loaded) if r["config"] is not None]
        if any(v != known[0] for v in known[1:]):
            differ[k] = [None if v is missing else v for v in values]
    return {"keys_total": len(keys), "keys_differ": len(differ), "differ": differ}


def _window_start(loaded: list[dict[str, Any]], last: int) -> float:
    """Where "the last records" begin on the axis: before the baseline's last `last` records in
    range, so that every run is averaged over the same work (10 sync steps are 40 async ones)."""
    xs = next((r["x"] for r in loaded if r["x"]), [])
    return xs[-last - 1] if len(xs) > last else 0.0


def _since(r: dict[str, Any], start: float) -> dict[str, Any]:
    """The run's records past `start` (its last one when none is), and all of them for "best"."""
    tail = [m for m, x in zip(r["metrics"], r["x"]) if x > start * (1 + 1e-9)] or r["metrics"][-1:]
    return {"tail": tail, "all": r["metrics"]}


def _quality_rows(loaded: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    rows = []
    for r in loaded:
        values, every = _values(r["tail"], name), _values(r["all"], name)
        rows.append({"last_mean": statistics.fmean(values) if values else None, "best": max(every) if every else None})
    base = rows[0]["last_mean"]
    for row in rows:
        ok = row["last_mean"] is not None and base is not None
        row["diff"] = row["last_mean"] - base if ok else None
        row["pct"] = (row["last_mean"] / base - 1) * 100 if ok and base else None
    return rows


def _groups(loaded: list[dict[str, Any]], key: str, since: float) -> dict[str, Any]:
    if not any(key in (r["config"] or {}) for r in loaded):
        from rlctl.errors import UsageError

        raise UsageError(f"--group-by {key}: no run has that recipe key (keys look like pipeline.mode, run.seed)")
    order: dict[str, list[int]] = {}
    for i, r in enumerate(loaded):
        order.setdefault(json.dumps((r["config"] or {}).get(key)), []).append(i)
    groups = []
    for value, members in order.items():
        g: dict[str, Any] = {"value": json.loads(value), "runs": [_label(i) for i in members], "n": len(members)}
        for name in ("reward_mean", "step_time", "rollout_to_train_end", "trainer_wait_ratio"):
            per_run = []
            for i in members:
                values = _values(_since(loaded[i], since)["tail"] if name == "reward_mean" else loaded[i]["metrics"], name)
                if values:
                    per_run.append(statistics.fmean(values) if name == "reward_mean" else statistics.median(values))
            if not per_run:
                g[name] = None
                continue
            lo, hi = bootstrap_ci(per_run) if len(per_run) >= 3 else (None, None)
            g[name] = {"mean": statistics.fmean(per_run), "lo": lo, "hi": hi}
        groups.append(g)
    return {"key": key, "groups": groups}


_CONDITION = re.compile(r"^\s*([a-z0-9_]+)\.(median|ratio|last_mean|best|diff|pct)\s*(<=|>=|==|!=|<|>)\s*(-?[\d.]+(?:e-?\d+)?)\s*$")
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
