"""`rlctl status [RUN] [--json] [--watch]`: runs and their state. What is shown comes from
rlctl/launchers/status.py; this module parses the command line and renders it."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

if TYPE_CHECKING:
    from rich.console import Group
    from rich.text import Text


def _fmt_duration(seconds: float) -> str:
    seconds = int(seconds)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


STATE_STYLE = {"running": "cyan", "starting": "cyan", "completed": "green", "failed": "red", "cancelled": "yellow",
               "unreadable": "red"}


def render_table(rows: list[dict[str, Any]]) -> Text:
    """Aligned columns as one Text: plain lines with a style span per state cell, far cheaper than
    a rich Table (or a Text appended cell by cell) for thousands of runs."""
    from rich.text import Span, Text

    text, styles = table_text(rows)
    return Text(text, spans=[Span(*s) for s in styles])


def table_text(rows: list[dict[str, Any]]) -> tuple[str, list[tuple[int, int, str]]]:
    """The runs table as plain text, and its styles as (start, end, style)."""
    from rlctl.run.check import one_line

    header: tuple[str, ...] = ("RUN", "MODE", "LAUNCHER", "STATE", "STEP", "REWARD", "ELAPSED")
    right = {4, 5, 6}
    cells = [
        (one_line(r["id"], 120), "-", "-", r["state"], "-", "-", "-") if r.get("unreadable") else
        (one_line(r["id"], 120), (r["mode"] or "-") + (" colocated" if r.get("colocated") else ""), r["launcher"] or "-",
         r["state"], f"{r['step']}/{r['steps_total']}",
         "-" if r["reward"] is None else f"{r['reward']:.3f}", _fmt_duration(r["elapsed_s"]))
        for r in rows
    ]
    # Why a run cannot be read, or what is damaged in it: after the row, outside the columns.
    notes = [f"  unreadable: {r['unreadable']}" if r.get("unreadable") else
             f"  damaged: {'; '.join(r['problems'])}" if r.get("problems") else "" for r in rows]
    if any(r.get("slurm") for r in rows):
        header += ("SLURM JOB",)  # the state word only; `rlctl status RUN` says more
        cells = [(*c, f"{r['slurm']['job_id']} {r['slurm'].get('state', 'SUBMITTED')}" if r.get("slurm") else "-")
                 for c, r in zip(cells, rows)]
    widths = [max(len(row[i]) for row in [header, *cells]) for i in range(len(header))]
    state_at = sum(widths[:3]) + 3  # where the STATE column starts in a line

    def line(row: tuple[str, ...]) -> str:
        return " ".join(cell.rjust(w) if i in right else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths)))

    lines = [line(header)]
    styles = [(0, len(lines[0]), "bold")]
    at = len(lines[0]) + 1
    for row, note in zip(cells, notes):
        body = line(row)
        style = STATE_STYLE.get(row[3])
        if style:
            styles.append((at + state_at, at + state_at + widths[3], style))
        if note:
            styles.append((at + len(body), at + len(body) + len(note), "red"))
        lines.append(body + note)
        at += len(lines[-1]) + 1
    return "\n".join(lines), styles


def _event_cells(e: dict[str, Any]) -> tuple[str, str, str]:
    """An event as a row: its time of day (a `t` that is no Unix time is shown as written), its
    kind, and every scalar field as key=value, numbers to 4 significant digits (lists and objects
    are left to `rlctl status RUN --json`)."""
    from datetime import datetime

    t = e.get("t")
    number = isinstance(t, (int, float)) and not isinstance(t, bool)
    when = datetime.fromtimestamp(t).strftime("%H:%M:%S.%f")[:-3] if number and 1e9 < t < 1e10 else (
        f"{t:.3f}" if number else str(t))
    fields = [f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in e.items()
              if k not in ("t", "event") and not isinstance(v, (list, dict))]
    return when, str(e.get("event")), " ".join(fields)


def _metrics_lines(m: dict[str, Any]) -> list[str]:
    """The last step's numbers, when they are all there; else the record as it is, cut."""
    from rlctl.run.check import one_line

    def nums(*keys: str) -> bool:
        return all(isinstance(m.get(k), (int, float)) and not isinstance(m.get(k), bool) for k in keys)

    if not nums("step", "reward_mean", "step_time", "rollout_time", "train_time", "sync_time", "trainer_wait_ratio"):
        return [f"last metrics record: {one_line(json.dumps(m, default=str), 160)}"]
    out = [f"last step {m['step']}: reward {m['reward_mean']:.3f}, step {m['step_time']:.2f} s "
           f"(rollout {m['rollout_time']:.2f}, train {m['train_time']:.2f}, sync {m['sync_time']:.2f}), "
           f"trainer waiting {m['trainer_wait_ratio']:.0%}"]
    if nums("critical_path_bound", "rollout_to_train_end", "efficiency", "tokens_per_s"):
        idle = m["rollout_idle_ratio"] if nums("rollout_idle_ratio") else 0.0
        out.append(f"rollout-to-train-end {m['rollout_to_train_end']:.2f} s, efficiency {m['efficiency']:.2f} of the "
                   f"critical-path bound, servers idle {idle:.0%}, {m['tokens_per_s']:.0f} tokens/s")
        out.append(f"samples trained up to {m.get('staleness_max', 0)} optimizer steps and "
                   f"{m.get('sync_lag_max', 0)} weight syncs behind the trainer")
    if nums("turns_per_sample", "tool_calls", "tool_call_ok_ratio", "tool_seconds", "rollout_idle_tool_ratio"):
        out.append(f"tools: {m['turns_per_sample']:.2f} model turns a sample, {m['tool_calls']} calls "
                   f"({m['tool_call_ok_ratio']:.0%} ok, {m['tool_seconds']:.2f} s in all), servers idle while tools ran "
                   f"{m['rollout_idle_tool_ratio']:.0%}")
    if nums("turn_time") and m["turn_time"] > 0:
        out.append(f"colocated: the servers and the trainer took turns for {m['turn_time']:.2f} s of the step")
    return out


def progress_lines(metrics: list[dict[str, Any]]) -> list[str]:
    """What a run did, in units every mode shares, and what it threw away (the launch's last
    lines and `status RUN`): each line fits 80 columns."""
    if not metrics:
        return []
    last = metrics[-1]
    out = []
    if all(isinstance(last.get(k), (int, float)) for k in ("optimizer_steps", "samples_total", "elapsed_s")):
        out.append(f"{last['optimizer_steps']:,} optimizer steps, {last['samples_total']:,} samples, "
                   f"{last.get('tokens_total', 0):,} tokens, {_fmt_duration(last['elapsed_s'])} from run start")
    dropped = last.get("groups_dropped_by_reason")
    completed = sum(m.get("groups", 0) for m in metrics if isinstance(m.get("groups"), int))
    if isinstance(dropped, dict) and dropped and completed:
        total = sum(v for v in dropped.values() if isinstance(v, int))
        why = ", ".join(f"{k} {v}" for k, v in sorted(dropped.items(), key=lambda kv: -kv[1]))
        out.append(f"dropped {total:,} of {completed:,} completed groups ({total / completed:.0%}): {why}")
    return out


def _attempt_line(a: dict[str, Any]) -> str:
    """  2  from step 44   job 250 (restart 1)  19:45:54 -> 19:46:56  requeued: why"""
    start = "the start" if a.get("resumed_from") is None else f"step {a['resumed_from']}"
    job = f"  job {a['slurm_job']} (restart {a.get('slurm_restart')})" if a.get("slurm_job") else ""
    times = f"{_clock(a.get('started'))} -> {_clock(a.get('ended')) or '...'}"
    end = f"  {a.get('state')}" + (f": {a['exit_reason']}" if a.get("exit_reason") else "")
    return f"  {a.get('attempt')}  from {start}{job}  {times}{end}"


def _clock(iso: Any) -> str:
    """The time of day of an ISO timestamp in run.json ('' if none)."""
    return str(iso)[11:19] if isinstance(iso, str) and len(iso) >= 19 else ""


def render_detail(d: dict[str, Any]) -> Group:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    from rlctl.run.check import one_line
    from rlctl.run.evals import eval_lines

    head = Text()  # built from parts, never markup: ids and paths are the run directory's, not ours
    head.append(one_line(d["id"], 120), style="bold")
    head.append(f"  {d['mode']} / {d['launcher']}{', colocated' if d.get('colocated') else ''}  ")
    head.append(d["state"], style=STATE_STYLE.get(d["state"], ""))
    head.append(f"  step {d['step']}/{d['steps_total']}  elapsed {_fmt_duration(d['elapsed_s'])}\n{d['path']}")
    parts: list[Any] = [head]
    if d.get("slurm"):
        parts.append(Text(f"slurm job {d['slurm']['job_id']}: {d['slurm']['describe']}"))
    if d["exit_reason"]:
        parts.append(Text(f"reason: {d['exit_reason']}"))
    wb = d.get("wandb")
    if wb:
        where = wb.get("url") or f"in {wb.get('dir')}"
        parts.append(Text(f"wandb ({wb.get('mode')}): run {wb.get('id')} {where}"))
    pool = d.get("pool")
    if pool and isinstance(pool.get("usage"), dict) and pool["usage"]:
        u = pool["usage"]
        try:
            parts.append(Text(f"pool {one_line(str(pool['name']), 60)}: used {float(u['used_device_s']):.1f} device-s "
                              f"(moves {float(u['moved_device_s']):.1f}) of {float(u['dedicated_device_s']):.1f} a "
                              f"dedicated placement holds ({int(u['devices'])} devices x {float(u['wall_s']):.1f} s), "
                              f"share {u['share']}"))
        except (KeyError, TypeError, ValueError):
            parts.append(Text("pool: usage unreadable", style="red"))
    parts.extend(Text(f"damaged: {p}", style="red") for p in d.get("problems", []))
    if d["last_metrics"]:
        parts.extend(Text(line) for line in _metrics_lines(d["last_metrics"]))
        parts.extend(Text(line) for line in progress_lines([d["last_metrics"]]))
    parts.extend(Text(one_line(line, 300)) for line in eval_lines(d.get("evals") or []))
    procs = Table("ROLE", "PID", "HOST", "PORT", "ALIVE", "LOG", box=None, pad_edge=False, title_justify="left")
    for p in d["processes"]:
        cells = (one_line(str(p["role"]), 60), str(p["pid"] or "-"), one_line(str(p["host"] or "-"), 60),
                 str(p["port"] or "-"), "-" if p["alive"] is None else "yes" if p["alive"] else "no",
                 one_line(str(p["log"]), 200))
        procs.add_row(*(Text(c) for c in cells))  # Text: no markup is read in what run.json says
    parts.append(procs)
    if len(d.get("attempts") or []) > 1:
        parts.append(Text("attempts:"))
        parts.extend(Text(one_line(_attempt_line(a), 300)) for a in d["attempts"])
    if d.get("checkpoints"):  # rlctl/run/checkpoint.py: step, size, when it was completed
        parts.append(Text(f"checkpoints/ (attempt {len(d.get('attempts') or [1])} of the run):"))
        parts.extend(Text(f"  step {c['step']:>6}  {c['bytes'] / 2**20:9.1f} MiB  {c['time']}  {Path(c['path']).name}")
                     for c in d["checkpoints"])
    if d["last_events"]:
        events = Table("TIME", "EVENT", "DETAILS", box=None, pad_edge=False, title="last events", title_justify="left")
        for e in d["last_events"]:
            events.add_row(*(Text(one_line(c, 300)) for c in _event_cells(e)))
        parts.append(events)
    return Group(*parts)


def _sweep_status(sweep: Any, as_json: bool) -> None:
    """A sweep: each point's values, and its run's row as `rlctl status` gives it."""
    from rich.console import Console
    from rich.text import Text

    from rlctl.run.dir import RunDir
    from rlctl.run.check import one_line
    from rlctl.launchers.status import safe_summary

    data = sweep.read()
    rows = []
    for p in data["points"]:
        row = safe_summary(RunDir(sweep.output_dir / p["run"])) if p["run"] else None
        rows.append({"values": p["values"], "run": row})
    if as_json:
        print(json.dumps({"sweep": data["id"], "recipe": data["recipe"], "grid": data["grid"], "points": rows},
                         indent=2, default=str))
        return
    states = [r["run"]["state"] if r["run"] else "not started" for r in rows]
    counts = ", ".join(f"{n} {s}" for s, n in sorted({s: states.count(s) for s in states}.items()))
    console = Console()
    console.print(Text(f"{one_line(data['id'], 120)}: {len(rows)} runs of {one_line(data['recipe'], 200)} ({counts})"))
    started = [r["run"] for r in rows if r["run"]]
    if started:
        console.print(render_table(started), no_wrap=True, overflow="crop")
    keys = list(data["grid"])
    for r in rows:
        values = one_line(" ".join(f"{k}={r['values'].get(k)}" for k in keys), 300)
        console.print(Text(f"  {r['run']['id'] if r['run'] else '(not started)'}  {values}"), soft_wrap=True)


def render_sweeps(sweeps: list[dict[str, Any]]) -> str:
    """The sweeps under the runs table, one line each (`rlctl status SWEEP` shows one whole)."""
    from rlctl.run.check import one_line

    lines = [f"sweeps ({len(sweeps)}; `rlctl status SWEEP` shows one):"]
    for s in sweeps:
        if s.get("unreadable"):
            lines.append(f"  {one_line(s['id'], 120)}  unreadable: {s['unreadable']}")
            continue
        counts = ", ".join(f"{n} {state}" for state, n in s["states"].items())
        lines.append(f"  {one_line(s['id'], 120)}  {s['points']} runs of {one_line(str(s['recipe']), 200)}"
                     f" over {', '.join(s['grid']) or '-'} ({counts})")
    return "\n".join(lines)


def render_list(rows: list[dict[str, Any]], sweeps: list[dict[str, Any]]) -> Text:
    """`rlctl status`: the runs table, then the sweeps."""
    text = render_table(rows)
    if sweeps:
        text.append("\n" + render_sweeps(sweeps))
    return text


def _piped_plain() -> bool:
    """stdout is no terminal and nothing asks for one (FORCE_COLOR, TTY_COMPATIBLE=1): rich would
    write the text as it is, so it is written without loading rich."""
    import os
    import sys

    return not sys.stdout.isatty() and "FORCE_COLOR" not in os.environ and os.environ.get("TTY_COMPATIBLE") != "1"


def json_rows(rows: list[dict[str, Any]]) -> str:
    """`rlctl status --json`: a JSON list with a run per line (json's C encoder takes no indent,
    and is many times faster than the indenting one at thousands of runs)."""
    return "[\n" + ",\n".join(json.dumps(r, default=str) for r in rows) + "\n]" if rows else "[]"


def _print_list(rows: list[dict[str, Any]], sweeps: list[dict[str, Any]]) -> None:
    """The runs and sweeps: cropped to a terminal's width (rows never break), whole lines when
    piped (for grep and friends). Piped without colour, the text goes out as it is: rich would
    only copy it, line by line, at thousands of rows."""
    import sys

    if _piped_plain():
        sys.stdout.write(table_text(rows)[0] + ("\n" + render_sweeps(sweeps) if sweeps else "") + "\n")
        sys.stdout.flush()
        return
    from rich.console import Console

    console = Console()
    if console.is_terminal:
        console.print(render_list(rows, sweeps), no_wrap=True, overflow="crop")
    else:
        console.print(render_list(rows, sweeps), soft_wrap=True)


def _say_no_runs(runs_dir: Path, sweeps: list[dict[str, Any]]) -> None:
    """Where it looked, not an empty table (and the sweeps, none of whose runs has started)."""
    from rich.console import Console
    from rich.text import Text

    console = Console()
    console.print(Text(f"no runs in {runs_dir.resolve()}: launch one, or give --runs-dir (runs are made "
                       "in run.output_dir, ./runs by default, of the directory rlctl launch ran in)"))
    if sweeps:
        console.print(Text(render_sweeps(sweeps)))


def status(
    run: str | None = typer.Argument(None, help="A run id, name or run directory; all runs (and sweeps) if omitted."),
    runs_dir: Path = typer.Option(Path("runs"), "--runs-dir", help="Where the run directories are."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    watch: bool = typer.Option(False, "--watch", "-w", help="Refresh every 2 s until Ctrl-C."),
) -> None:
    """Show runs and sweeps, or one run (or sweep) in detail."""
    from rlctl.launchers.status import run_detail, summaries, sweep_summaries
    from rlctl.run.sweep import find_sweep

    sweep = find_sweep(run, runs_dir) if run else None
    if sweep is not None:
        _sweep_status(sweep, as_json)
        return
    if as_json:
        print(json.dumps(run_detail(run, runs_dir), indent=2, default=str) if run else json_rows(summaries(runs_dir)))
        return
    if not run and not watch:
        rows = summaries(runs_dir)
        sweeps = sweep_summaries(runs_dir, rows)
        if rows:
            _print_list(rows, sweeps)
        else:
            _say_no_runs(runs_dir, sweeps)
        return
    from rich.console import Console
    from rich.text import Text

    console = Console()
    if not watch:
        console.print(render_detail(run_detail(run, runs_dir)))
        return

    def build() -> Any:
        if run:
            return render_detail(run_detail(run, runs_dir))
        listed = summaries(runs_dir)
        return render_list(listed, sweep_summaries(runs_dir, listed)) if listed else Text("no runs yet")

    from rich.live import Live

    try:
        with Live(build(), console=console, refresh_per_second=1) as live:
            while True:
                time.sleep(2)
                live.update(build())
    except KeyboardInterrupt:
        pass
