"""Experiment trackers fed from the controller: the run directory stays the source of truth, a
tracker gets a copy of what is written there (the resolved recipe, each step's metrics with the
names of metrics.jsonl and its samples.jsonl lines as a table, each evaluation of eval.jsonl, a
summary at the end). wandb is imported only when the tracker is on."""

from __future__ import annotations

import json
import os
import statistics
from typing import Any, Protocol

from rlctl.recipe import Recipe, WandbMode, recipe_to_dict
from rlctl.run.dir import RunDir

SUMMARY_KEYS = ("step_time", "rollout_time", "train_time", "sync_time", "trainer_wait_ratio", "rollout_to_train_end",
                "efficiency", "tokens_per_s", "reward_mean")


class Tracker(Protocol):
    """What the recorder (rlctl/metrics/recorder.py) tells a tracker."""

    def log_step(self, metrics: dict[str, Any]) -> None:
        """One step's record, as written to metrics.jsonl."""

    def log_eval(self, record: dict[str, Any]) -> None:
        """One set's evaluation, as written to eval.jsonl."""

    def finish(self, ok: bool) -> None:
        """The run ended; `ok` when every step was recorded."""


def loggable(metrics: dict[str, Any]) -> dict[str, float]:
    """The numbers of a metrics.jsonl record; a histogram {lag: count} becomes name/lag keys."""
    out: dict[str, float] = {}
    for k, v in metrics.items():
        if isinstance(v, bool) or k in ("step", "time"):
            continue
        if isinstance(v, (int, float)):
            out[k] = v
        elif isinstance(v, dict):
            out.update({f"{k}/{kk}": vv for kk, vv in v.items() if isinstance(vv, (int, float))})
    return out


EVAL_NUMBERS = ("prompts", "response_len_mean", "truncated", "errors", "seconds", "version")


def eval_loggable(record: dict[str, Any]) -> dict[str, float]:
    """An eval.jsonl record's numbers under eval/<set>/ (its sources' under eval/<set>/<source>/)."""
    prefix = f"eval/{record.get('set', 'eval')}"
    out = {f"{prefix}/{k}": v for k, v in record.items()
           if (k.startswith(("mean@", "pass@")) or k in EVAL_NUMBERS) and isinstance(v, (int, float))}
    for source, numbers in (record.get("by_source") or {}).items():
        out.update({f"{prefix}/{source}/{k}": v for k, v in numbers.items() if isinstance(v, (int, float))})
    return out


class WandbTracker:
    def __init__(self, rd: RunDir, recipe: Recipe) -> None:
        import wandb

        cfg = recipe.tracking.wandb
        os.environ.setdefault("WANDB_SILENT", "true")
        config = recipe_to_dict(recipe)  # holds no secret: the run's token is a file of its own (rlctl/process/auth.py)
        self.run = wandb.init(
            project=cfg.project, entity=cfg.entity or None, group=cfg.group or None, tags=list(cfg.tags) or None,
            mode=cfg.mode, id=rd.id, name=rd.id, dir=str(rd.path), resume="allow",
            config=config,
        )
        info = {"id": self.run.id, "mode": cfg.mode, "project": cfg.project, "dir": self.run.dir,
                "url": self.run.url if cfg.mode is WandbMode.ONLINE else None}
        rd.update(lambda d: d.setdefault("tracking", {}).update(wandb=info))
        # A resumed run (`rlctl resume`) continues the same wandb run (id = run id, resume="allow");
        # its summary covers the steps of the earlier attempts that metrics.jsonl kept too.
        self.history: list[dict[str, Any]] = rd.metrics()
        self.samples = SamplesTail(rd)

    def log_step(self, metrics: dict[str, Any]) -> None:
        import wandb

        self.history.append(metrics)
        logged: dict[str, Any] = loggable(metrics)
        rows = self.samples.new()
        if rows:  # the samples written since the last step, as a table (run.sample_groups groups a step)
            logged["samples"] = wandb.Table(columns=list(SAMPLE_COLUMNS),
                                            data=[[_cell(row.get(c)) for c in SAMPLE_COLUMNS] for row in rows])
        self.run.log(logged, step=int(metrics["step"]))

    def log_eval(self, record: dict[str, Any]) -> None:
        """At the wandb step of the steps trained before it (0: before training), so that it sits
        after the record of the step it follows: eval/<set>/<metric>, eval/<set>/<source>/<metric>."""
        logged = eval_loggable(record)
        self.run.log(logged, step=int(record["steps"]))

    def finish(self, ok: bool) -> None:
        summary = {f"median/{k}": statistics.median(m[k] for m in self.history)
                   for k in SUMMARY_KEYS if self.history and all(k in m for m in self.history)}
        summary["steps"] = len(self.history)
        self.run.summary.update(summary)
        self.run.finish(exit_code=0 if ok else 1)


SAMPLE_COLUMNS = ("step", "group", "sample", "source", "prompt", "response", "answer", "reward", "scores",
                  "finish_reason", "response_tokens", "version")


def _cell(value: Any) -> Any:
    """A table cell: numbers and text as they are, chat messages and named scores as JSON text."""
    return value if value is None or isinstance(value, (int, float, str)) else json.dumps(value)


class SamplesTail:
    """The lines appended to a run's samples.jsonl since the last read (whole lines only)."""

    def __init__(self, rd: RunDir) -> None:
        self.path = rd.samples_path
        self.offset = self.path.stat().st_size if self.path.exists() else 0
        """A resumed run's earlier samples were logged by its earlier attempt."""

    def new(self) -> list[dict[str, Any]]:
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        whole = data[: data.rfind(b"\n") + 1]
        self.offset += len(whole)
        rows = []
        for line in whole.splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict):
                rows.append(row)
        return rows


def make_tracker(rd: RunDir, recipe: Recipe) -> Tracker | None:
    return WandbTracker(rd, recipe) if recipe.tracking.wandb.mode is not WandbMode.DISABLED else None
