"""`rlctl status [RUN] [--json] [--watch]`: runs and their state, read from the run directories.

A run's state is what run.json says, unless run.json says it is still going while its
supervisor is gone: then it is shown as failed, with the supervisor's log to read. Slurm runs
are joined with Slurm's own state first: one batched squeue for all of them
(rlctl/launchers/slurm.py), and the job's state is shown beside the run's.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import time
from pathlib import Path
from typing import Any

import typer

from rlctl.rundir import RunDir, RunState, find_run, list_runs, pid_alive

STARTING_GRACE_S = 30.0


def effective_state(rd: RunDir, info: dict[str, Any]) -> tuple[RunState, str | None]:
    state = RunState(info["state"])
    if state.finished or info.get("launcher") == "slurm":
        return state, info.get("exit_reason")  # a Slurm run was joined with Slurm's state before
    supervisor = info.get("processes", {}).get("supervisor", {}).get("pid")
    if supervisor is None:
        created = dt.datetime.fromisoformat(info["created"])
        age = (dt.datetime.now(dt.UTC) - created).total_seconds()
        if age < STARTING_GRACE_S:
            return state, None
        return RunState.FAILED, f"no supervisor ever started; see {rd.log_path('supervisor')}"
    if not pid_alive(supervisor, expect_in_cmdline=rd.id):
        return RunState.FAILED, f"supervisor (pid {supervisor}) is gone; see {rd.log_path('supervisor')}"
    return state, None


def last_jsonl_record(path: Path) -> dict[str, Any] | None:
    """The last line of a JSONL file, reading only its end."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 65536))
            lines = f.read().splitlines()
    except FileNotFoundError:
        return None
    for line in reversed(lines):
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            continue
    return None


def _elapsed(info: dict[str, Any]) -> float:
    start = dt.datetime.fromisoformat(info["created"])
    end = dt.datetime.fromisoformat(info["ended"]) if info.get("ended") else dt.datetime.now(dt.UTC)
    return (end - start).total_seconds()


def _fmt_duration(seconds: float) -> str:
    seconds = int(seconds)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def summary(rd: RunDir, info: dict[str, Any] | None = None) -> dict[str, Any]:
    info = info if info is not None else rd.read()
    state, reason = effective_state(rd, info)
    last = last_jsonl_record(rd.metrics_path)
    return {
        "id": info["id"],
        "name": info["name"],
        "mode": info.get("mode"),
        "launcher": info.get("launcher"),
        "state": state.value,
        "step": (last["step"] + 1) if last else 0,
        "steps_total": info.get("steps_total"),
        "reward": last["reward_mean"] if last else None,
        "elapsed_s": _elapsed(info),
        "created": info["created"],
        "exit_reason": reason,
        "path": str(rd.path),
        "slurm": _slurm_summary(info),
    }


def _slurm_summary(info: dict[str, Any]) -> dict[str, Any] | None:
    sl = info.get("slurm")
    if not sl or not sl.get("job_id"):
        return None
    from rlctl.launchers.slurm import JobInfo

    last = sl.get("last")
    return {"job_id": sl["job_id"], **(last or {}),
            "describe": JobInfo(**last).describe() if last else "submitted, not yet seen by squeue"}


def _refresh_slurm(runs: list[RunDir], infos: dict[str, dict[str, Any]] | None = None) -> None:
    from rlctl.launchers.slurm import refresh

    refresh(runs, infos)  # asks Slurm only if some run is a Slurm run that needs it


def detail(rd: RunDir) -> dict[str, Any]:
    info = rd.read()
    out = summary(rd)
    procs = []
    for role, p in info.get("processes", {}).items():
        procs.append({"role": role, "pid": p.get("pid"), "host": p.get("host"), "port": p.get("port"),
                      # a Slurm run's processes live on other nodes: no pid to check from here
                      "alive": None if info.get("launcher") == "slurm" else
                      pid_alive(p.get("pid"), expect_in_cmdline=rd.id) if p.get("pid") else False,
                      "log": p.get("log", str(rd.log_path(role)))})
    out["processes"] = procs
    out["last_events"] = rd.events()[-10:]
    out["last_metrics"] = last_jsonl_record(rd.metrics_path)
    out["wandb"] = (info.get("tracking") or {}).get("wandb")
    out["logs"] = [str(p) for p in rd.log_files().values()]
    return out


STATE_STYLE = {"running": "cyan", "starting": "cyan", "completed": "green", "failed": "red", "cancelled": "yellow"}


def render_table(rows: list[dict[str, Any]]):
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


def render_detail(d: dict[str, Any]):
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
        for e in d["last_events"]:
            extra = {k: v for k, v in e.items() if k not in ("t", "event") and not isinstance(v, list)}
            parts.append(Text(f"  {e['t']:.3f} {e['event']} {extra}"))
    return Group(*parts)


def status(
    run: str | None = typer.Argument(None, help="A run id, name or run directory; all runs if omitted."),
    runs_dir: Path = typer.Option(Path("runs"), "--runs-dir", help="Where the run directories are."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    watch: bool = typer.Option(False, "--watch", "-w", help="Refresh every 2 s until Ctrl-C."),
) -> None:
    """Show runs, or one run in detail."""
    from rich.console import Console

    def build():
        if run:
            rd = find_run(run, runs_dir)
            _refresh_slurm([rd])
            return detail(rd)
        runs = list_runs(runs_dir)
        infos = {rd.id: rd.read() for rd in runs}
        _refresh_slurm(runs, infos)
        # A run Slurm was asked about may have just been updated: read those again, no others.
        stale = {rd.id for rd in runs if infos[rd.id].get("launcher") == "slurm"}
        return [summary(rd, None if rd.id in stale else infos[rd.id]) for rd in runs]

    def render(data):
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
