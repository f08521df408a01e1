"""`rlctl compare RUN_A RUN_B [RUN ...]`: what differs between runs, what it did to learning and to
time. Runs are ids, names or run directories, local and Slurm alike; the first is the baseline."""

from __future__ import annotations

import json
from itertools import accumulate
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from rlctl.errors import RunError, UsageError

if TYPE_CHECKING:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

TIME_LABELS = {
    "seconds_per_1k_samples": "s per 1k samples", "step_time": "step time s", "rollout_time": "rollout s", "train_time": "train s", "sync_time": "weight sync s",
    "trainer_wait_ratio": "trainer waiting", "rollout_to_train_end": "rollout->train end s",
    "efficiency": "eff. vs bound", "tokens_per_s": "tokens/s",
}


def _fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}g}" if abs(v) < 1e4 else f"{v:.0f}"
    return str(v)


def _table(title: str, **options: Any) -> Table:
    """A borderless table under a bold title, the look every part shares."""
    from rich.table import Table

    return Table(box=None, pad_edge=False, title=title, title_justify="left", title_style="bold", **options)


def _cells(*values: Any) -> list[Text]:
    """Table cells as Text: what a run directory says is shown as it is (control characters
    escaped), never read as markup."""
    from rich.text import Text

    from rlctl.run.check import one_line

    return [Text(one_line(str(v), 2000)) for v in values]


def _runs_table(runs: list[dict[str, Any]], unreadable: list[dict[str, Any]] = ()) -> Table:
    t = _table("runs", show_header=False)
    t.add_column("")
    t.add_column("", no_wrap=True)  # a run id stays whole: it is what the user copies
    t.add_column("", overflow="fold")
    t.add_column("", no_wrap=True)
    for r in runs:
        code = r["code"].get("commit", "")[:8] + ("+dirty" if r["code"].get("dirty") else "") if r["code"] else "-"
        dropped = sum(v for v in r.get("dropped", {}).values() if isinstance(v, int))
        drops = f", dropped {dropped / r['groups']:.0%} of groups" if dropped and r.get("groups") else ""
        t.add_row(*_cells(r["label"], r["id"], f"{r['state']} {r['mode']}/{r['launcher']} {r['steps']} steps{drops}",
                          code or "-"))
        for problem in r.get("problems", []):
            t.add_row(*_cells("", "", f"damaged: {problem}", ""))
    for r in unreadable:  # left out of the comparison
        t.add_row(*_cells("-", r["id"], f"unreadable: {r['why']}", ""))
    return t


def _config_table(config: dict[str, Any], labels: list[str]) -> Table:
    t = _table(f"config: {config['keys_differ']} of {config['keys_total']} keys differ")
    t.add_column("key", overflow="fold")
    for label in labels:
        t.add_column(label, overflow="fold")
    for key, values in config["differ"].items():
        t.add_row(*_cells(key, *("(absent)" if v is None else json.dumps(v) if isinstance(v, (list, dict)) else v
                                 for v in values)))
    return t


def _learning_table(comp: dict[str, Any], labels: list[str]) -> Table:
    from rlctl.run.compare import sparkline

    t = _table("learning (mean of the last records; best; vs A)")
    for col, justify in (("metric", "left"), ("run", "left"), ("last", "right"), ("best", "right"),
                         ("diff", "right"), ("%", "right")):
        t.add_column(col, justify=justify)  # type: ignore[arg-type]
    t.add_column("reward curve", no_wrap=True)
    for name, rows in comp["metrics"].items():
        for i, row in enumerate(rows):
            within = [v for v, x in zip(comp["curves"][labels[i]], comp["curves_x"][labels[i]])
                      if v is not None and x <= comp["x"]["end"] * (1 + 1e-9)]
            curve = sparkline(within) if name == "reward_mean" else ""
            pct = f"{row['pct']:+.1f}" if row["pct"] is not None and i else ""
            diff = f"{row['diff']:+.3g}" if row["diff"] is not None and i else ""
            t.add_row(name if i == 0 else "", labels[i], _fmt(row["last_mean"]), _fmt(row["best"]), diff, pct, curve)
    return t


def _time_table(times: dict[str, Any], labels: list[str]) -> Table:
    t = _table("time (medians; ratio to A)")
    t.add_column("metric")
    for i, label in enumerate(labels):
        t.add_column(label, justify="right")
        if i:
            t.add_column(f"{label}/A", justify="right")
    for name, rows in times.items():
        cells = []
        for i, row in enumerate(rows):
            cells.append(_fmt(row["median"]))
            if i:
                cells.append(f"{row['ratio']:.2f}x" if row["ratio"] is not None else "-")
        t.add_row(TIME_LABELS.get(name, name), *cells)
    return t


def _eval_table(rows: dict[str, Any], labels: list[str]) -> Table:
    t = _table("eval (held-out sets: first -> latest evaluation; vs A)")
    for col, justify in (("set and number", "left"), ("run", "left"), ("first", "right"), ("latest", "right"),
                         ("after steps", "right"), ("diff", "right")):
        t.add_column(col, justify=justify)  # type: ignore[arg-type]
    for name, cells in rows.items():
        for i, c in enumerate(cells):
            if c is None:
                t.add_row(*_cells(name if i == 0 else "", labels[i], "-", "-", "-", ""))
                continue
            diff = f"{c['diff']:+.3f}" if c["diff"] is not None and i else ""
            t.add_row(*_cells(name if i == 0 else "", labels[i], f"{c['first']:.3f}", f"{c['last']:.3f}", c["steps"],
                              diff))
    return t


def _interval(m: dict[str, Any] | None) -> str:
    if m is None:
        return "-"
    return f"{m['mean']:.3g} [{m['lo']:.3g}, {m['hi']:.3g}]" if m["lo"] is not None else f"{m['mean']:.3g}"


def _groups_parts(groups: dict[str, Any]) -> list[Table | Text]:
    """The --group-by table, and a note naming the groups too small for an interval."""
    from rich.text import Text

    t = _table(f"by {groups['key']} (mean over runs, 95% bootstrap interval)")
    for col in ("value", "runs", "reward", "step s", "r2t end s"):
        t.add_column(col, overflow="fold")
    for grp in groups["groups"]:
        t.add_row(str(grp["value"]), ",".join(grp["runs"]), _interval(grp["reward_mean"]), _interval(grp["step_time"]),
                  _interval(grp["rollout_to_train_end"]))
    small = [str(grp["value"]) for grp in groups["groups"] if grp["n"] < 3]
    if not small:
        return [t]
    return [t, Text(f"no interval for {', '.join(small)}: fewer than 3 runs (run more seeds)")]


def render(comp: dict[str, Any]) -> Group:
    """The three parts (config diff, learning, time), with --group-by the groups, and why a
    failed run failed."""
    from rich.console import Group
    from rich.text import Text

    labels = [r["label"] for r in comp["runs"]]
    x = comp["x"]
    parts: list[Any] = [_runs_table(comp["runs"], comp.get("unreadable", [])), _config_table(comp["config"], labels)]
    parts.append(Text(f"compared over 0 .. {x['end']:,.0f} {x['unit']} (--x {x['by']})", style="bold"))
    parts += [Text(f"note: {n}", style="yellow") for n in x["notes"]]
    parts += [_learning_table(comp, labels), _time_table(comp["time"], labels)]
    if comp.get("eval"):
        parts.append(_eval_table(comp["eval"], labels))
    if "groups" in comp:
        parts += _groups_parts(comp["groups"])
    parts += [Text(f"{r['label']} failed: {r['exit_reason']}", style="red") for r in comp["runs"] if r["state"] == "failed"]
    parts += [Text(f"left out, unreadable: {r['id']}: {r['why']}", style="red") for r in comp.get("unreadable", [])]
    return Group(*parts)


def plot(comp: dict[str, Any], path: Path) -> None:
    """--plot: reward against step and against the time the steps took, the step-time parts, and
    the trainer's waiting ratio, one line or bar per run (the runs of the comparison: those that
    could be read)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'rlctl[plot]'") from None
    from rlctl.run.compare import progress_x
    from rlctl.run.step_records import finite, metrics_by_step
    from rlctl.run.dir import RunDir

    labels = [r["label"] for r in comp["runs"]]
    by, unit = comp["x"]["by"], comp["x"]["unit"]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    for label, run in zip(labels, comp["runs"]):
        ms = [m for m in metrics_by_step(RunDir(Path(run["path"]))) if finite(m.get("reward_mean"))]
        xs = progress_x(ms, by)
        rewards = [m["reward_mean"] for m in ms]
        wall = list(accumulate(m["step_time"] if finite(m.get("step_time")) else 0.0 for m in ms))
        axes[0][0].plot(xs, rewards, label=label)
        axes[0][1].plot(wall, rewards, label=label)
        axes[1][1].plot(xs, [m["trainer_wait_ratio"] if finite(m.get("trainer_wait_ratio")) else 0.0 for m in ms],
                        label=label)
    axes[0][0].axvline(comp["x"]["end"], color="grey", linewidth=0.8)  # the range every run covers
    axes[0][0].set(title=f"reward vs {unit}", xlabel=unit, ylabel="mean reward")
    axes[0][1].set(title="reward vs wall time", xlabel="seconds of steps", ylabel="mean reward")
    axes[1][1].set(title="trainer waiting ratio", xlabel=unit, ylabel="waiting / rollout-to-train-end")
    bottom = [0.0] * len(labels)
    for name in ("rollout_time", "train_time", "sync_time"):
        values = [row["median"] or 0.0 for row in comp["time"][name]]
        axes[1][0].bar(labels, values, bottom=bottom, label=name.replace("_", " "))
        bottom = [b + v for b, v in zip(bottom, values)]
    axes[1][0].plot(labels, [row["median"] or 0.0 for row in comp["time"]["step_time"]], "k_", markersize=30,
                    label="step time")
    axes[1][0].set(title="median step-time parts (rollout and train overlap when pipelined)", ylabel="seconds")
    for ax in (axes[0][0], axes[0][1], axes[1][0], axes[1][1]):
        ax.legend(fontsize=8)
    fig.suptitle(" vs ".join(f"{r['label']}={r['id']}" for r in comp["runs"]), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def compare(
    runs: list[str] = typer.Argument(..., help="Two or more run ids, names or run directories; the first is the baseline."),
    runs_dir: Path = typer.Option(Path("runs"), "--runs-dir", help="Where the run directories are."),
    last: int = typer.Option(5, "--last", help="Steps averaged for the learning table."),
    group_by: str | None = typer.Option(None, "--group-by", help="A recipe key, e.g. pipeline.mode: mean and 95% interval per value."),
    x_axis: str = typer.Option("samples", "--x", help="Align runs on samples, tokens, optimizer_steps, time or steps "
                                                      "(a step is a different unit in each mode)."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output (stable keys)."),
    plot_file: Path | None = typer.Option(None, "--plot", help="Write reward, step-time and waiting plots to this PNG."),
    fail_if: str | None = typer.Option(None, "--fail-if", help="Exit 1 when it holds for a run, e.g. 'rollout_to_train_end.ratio > 0.8'."),
) -> None:
    """Compare runs: config diff, learning, time breakdown."""
    from rich.console import Console

    from rlctl.run.compare import comparison, failing
    from rlctl.run.find import find_run
    from rlctl.run.sweep import find_sweep

    if len(runs) < 2 and not (runs and find_sweep(runs[0], runs_dir)):
        raise UsageError("compare needs at least two runs, or a sweep")
    if last < 1:
        raise UsageError("--last must be >= 1")
    if plot_file:  # said before any output, not after the whole table
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError("--plot needs matplotlib: pip install 'rlctl[plot]'") from None
    dirs = []
    for ref in runs:  # a sweep id stands for every run it started
        sweep = find_sweep(ref, runs_dir)
        dirs += sweep.runs() if sweep is not None else [find_run(ref, runs_dir)]
    if len(dirs) < 2:
        raise UsageError("compare needs at least two runs (a sweep counts as the runs it started)")
    comp = comparison(dirs, last=last, group_by=group_by, by=x_axis)
    hits = failing(comp, fail_if) if fail_if else []
    if as_json:
        # every key docs/commands.md lists is there: groups is null without --group-by
        print(json.dumps({"groups": None, **comp, "fail_if": {"expr": fail_if, "hits": hits} if fail_if else None}, indent=2))
    else:
        Console().print(render(comp))
    if plot_file:
        plot(comp, plot_file)
    if hits:
        raise RunError(f"--fail-if {fail_if!r} holds: " + "; ".join(hits))
    if comp.get("unreadable"):  # shown above, left out of the comparison: not a clean result
        from rlctl.run.check import one_line

        first, *more = comp["unreadable"]
        raise RunError(f"{one_line(first['id'], 120)}: unreadable: {first['why']} (left out of the comparison"
                       + (f"; {len(more)} more unreadable runs)" if more else ")"))
