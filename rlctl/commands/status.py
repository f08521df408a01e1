"""`rlctl status [RUN] [--json] [--watch]`: runs and their state. What is shown comes from
rlctl/status.py; this module parses the command line and renders it."""

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


STATE_STYLE = {"running": "cyan", "starting": "cyan", "completed": "green", "failed": "red", "cancelled": "yellow"}


def render_table(rows: list[dict[str, Any]]) -> Text:
    """Aligned columns as one Text: far cheaper than a rich Table for hundreds of runs."""
    from rich.text import Text

    header: tuple[str, ...] = ("RUN", "MODE", "LAUNCHER", "STATE", "STEP", "REWARD", "ELAPSED")
    right = {4, 5, 6}
    cells = [
        (r["id"], r["mode"] or "-", r["launcher"] or "-", r["state"], f"{r['step']}/{r['steps_total']}",
         "-" if r["reward"] is None else f"{r['reward']:.3f}", _fmt_duration(r["elapsed_s"]))
        for r in rows
    ]
    if any(r.get("slurm") for r in rows):
        header += ("SLURM JOB",)  # the state word only; `rlctl status RUN` says more
        cells = [(*c, f"{r['slurm']['job_id']} {r['slurm'].get('state', 'SUBMITTED')}" if r.get("slurm") else "-")
                 for c, r in zip(cells, rows)]
    widths = [max(len(row[i]) for row in [header, *cells]) for i in range(len(header))]

    def line(row: tuple[str, ...], state_style: str = "") -> Text:
        out = Text()
        for i, (cell, width) in enumerate(zip(row, widths)):
            if i:
                out.append(" ")
            padded = cell.rjust(width) if i in right else cell.ljust(width)
            out.append(padded, style=state_style if i == 3 else "")
        return out

    text = line(header)
    text.stylize("bold")
    for row in cells:
        text.append("\n")
        text.append_text(line(row, STATE_STYLE.get(row[3], "")))
    return text


def _event_line(e: dict[str, Any]) -> str:
    """An event as recorded: `t` is shown as the number its writer put there, whatever clock that
    was, and every other scalar field (a host, a role, a step) goes beside the kind."""
    t = e.get("t")
    when = f"{t:.3f}" if isinstance(t, (int, float)) else str(t)
    extra = {k: v for k, v in e.items() if k not in ("t", "event") and not isinstance(v, list)}
    return f"  {when} {e.get('event')} {extra}"


def render_detail(d: dict[str, Any]) -> Group:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    head = Text.from_markup(
        f"[bold]{d['id']}[/]  {d['mode']} / {d['launcher']}  [{STATE_STYLE.get(d['state'], '')}]{d['state']}[/]"
        f"  step {d['step']}/{d['steps_total']}  elapsed {_fmt_duration(d['elapsed_s'])}\n{d['path']}"
    )
    parts: list[Any] = [head]
    if d.get("slurm"):
        parts.append(Text(f"slurm job {d['slurm']['job_id']}: {d['slurm']['describe']}"))
    if d["exit_reason"]:
        parts.append(Text(f"reason: {d['exit_reason']}"))
    wb = d.get("wandb")
    if wb:
        parts.append(Text(f"wandb ({wb['mode']}): run {wb['id']} " + (wb["url"] or f"in {wb['dir']}")))
    m = d["last_metrics"]
    if m:
        parts.append(Text(
            f"last step {m['step']}: reward {m['reward_mean']:.3f}, step {m['step_time']:.2f} s "
            f"(rollout {m['rollout_time']:.2f}, train {m['train_time']:.2f}, sync {m['sync_time']:.2f}), "
            f"trainer waiting {m['trainer_wait_ratio']:.0%}"))
        if "critical_path_bound" in m:
            parts.append(Text(
                f"rollout-to-train-end {m['rollout_to_train_end']:.2f} s, efficiency {m['efficiency']:.2f} of the "
                f"critical-path bound, servers idle {m.get('rollout_idle_ratio', 0.0):.0%}, "
                f"{m['tokens_per_s']:.0f} tokens/s, staleness max {m.get('staleness_max', 0)}"))
    procs = Table("ROLE", "PID", "HOST", "PORT", "ALIVE", "LOG", box=None, pad_edge=False, title_justify="left")
    for p in d["processes"]:
        procs.add_row(p["role"], str(p["pid"] or "-"), p["host"] or "-", str(p["port"] or "-"),
                      "-" if p["alive"] is None else "yes" if p["alive"] else "no", p["log"])
    parts.append(procs)
    if d["last_events"]:
        parts.append(Text("last events:"))
        parts.extend(Text(_event_line(e)) for e in d["last_events"])
    return Group(*parts)


def status(
    run: str | None = typer.Argument(None, help="A run id, name or run directory; all runs if omitted."),
    runs_dir: Path = typer.Option(Path("runs"), "--runs-dir", help="Where the run directories are."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    watch: bool = typer.Option(False, "--watch", "-w", help="Refresh every 2 s until Ctrl-C."),
) -> None:
    """Show runs, or one run in detail."""
    from rich.console import Console

    from rlctl.status import run_detail, summaries

    def build() -> Any:
        return run_detail(run, runs_dir) if run else summaries(runs_dir)

    def render(data: Any) -> Any:
        return render_detail(data) if run else render_table(data)

    if as_json:
        print(json.dumps(build(), indent=2, default=str))
        return
    console = Console()
    if not watch:
        if run:
            console.print(render(build()))
        elif console.is_terminal:  # a narrow terminal crops rows, never breaks them
            console.print(render(build()), no_wrap=True, overflow="crop")
        else:  # piped: whole lines, for grep and friends
            console.print(render(build()), soft_wrap=True)
        return
    from rich.live import Live

    try:
        with Live(render(build()), console=console, refresh_per_second=1) as live:
            while True:
                time.sleep(2)
                live.update(render(build()))
    except KeyboardInterrupt:
        pass
