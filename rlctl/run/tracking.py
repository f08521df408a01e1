"""Experiment trackers fed from the controller: the run directory stays the source of truth, a
tracker gets a copy of what is written there (the resolved recipe, each step's metrics with the
names of metrics.jsonl, a summary at the end). wandb is imported only when the tracker is on."""

from __future__ import annotations

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

    def log_step(self, metrics: dict[str, Any]) -> None:
        self.history.append(metrics)
        self.run.log(loggable(metrics), step=int(metrics["step"]))

    def finish(self, ok: bool) -> None:
        summary = {f"median/{k}": statistics.median(m[k] for m in self.history)
                   for k in SUMMARY_KEYS if self.history and all(k in m for m in self.history)}
        summary["steps"] = len(self.history)
        self.run.summary.update(summary)
        self.run.finish(exit_code=0 if ok else 1)


def make_tracker(rd: RunDir, recipe: Recipe) -> Tracker | None:
    return WandbTracker(rd, recipe) if recipe.tracking.wandb.mode is not WandbMode.DISABLED else None
