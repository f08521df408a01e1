"""Following a run from `rlctl launch` and `rlctl resume`: what it is doing, until it ends.

Before its first step a run goes through phases that can take a while on a busy machine (the
model built and warmed up, servers loading, the weights' first trip to the servers); they are
read from the run directory (run.json's processes, the first events) and named as they come. On
a terminal a rich progress line shows them, then the steps with reward and step time; piped, one
plain line per phase and per tenth of the run. No line is wider than 80 columns. Ctrl-C cancels.
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

from rlctl.errors import RunError
from rlctl.rundir import RunDir, RunState, pid_alive

HEAD_BYTES = 1 << 16
"""How much of events.jsonl the phases are read from: the events before the first step's."""


def phase(rd: RunDir, info: dict[str, Any]) -> str:
    """What a run that has recorded no step yet is doing."""
    kinds, up = _first_events(rd)
    if "initial_sync" in kinds:
        return "step 1: first rollout batch"
    if "run_start" in kinds:
        return "weights: first sync to the servers"
    servers = len((info.get("plan") or {}).get("rollout") or [])
    started = [r for r in info.get("processes") or {} if r.startswith(("rollout-", "trainer-"))]
    if servers and up >= servers:
        return "trainer and controller starting"
    if started or up:
        return f"servers starting: {up}/{servers} up" if servers else "servers starting"
    if "prepare" in (info.get("processes") or {}):
        return "model: building and warming up"
    return str(info.get("state", "starting"))


def _first_events(rd: RunDir) -> tuple[list[str], int]:
    """The kinds of the first events, and how many servers have said they are up."""
    try:
        with open(rd.events_path, "rb") as f:
            head = f.read(HEAD_BYTES)
    except OSError:
        return [], 0
    kinds, up = [], set()
    for line in head.splitlines():
        try:
            e = json.loads(line)
        except ValueError:
            continue  # a line cut at the end of the head, or damaged
        if isinstance(e, dict):
            kinds.append(e.get("event"))
            if e.get("event") == "server_up":
                up.add(e.get("role"))
    return kinds, len(up)


def _supervisor_pid(rd: RunDir, wait_s: float = 10.0) -> int | None:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        pid = rd.read()["processes"].get("supervisor", {}).get("pid")
        if pid:
            return pid
        time.sleep(0.05)
    return None


class _LocalWatch:
    """The local run's driver is its supervisor process."""

    def __init__(self, rd: RunDir) -> None:
        self.rd, self.pid = rd, _supervisor_pid(rd)

    def check(self) -> str | None:
        """A note for the progress line; ends the run in run.json if its driver is gone."""
        if self.pid and not pid_alive(self.pid):
            time.sleep(0.5)  # it may have just written its final state
            self.rd.set_state(RunState.FAILED, f"supervisor (pid {self.pid}) is gone; see {self.rd.log_path('supervisor')}")
        return None

    def done(self) -> bool:
        return True

    def cancel(self) -> None:
        if self.pid:
            os.kill(self.pid, signal.SIGTERM)
            while pid_alive(self.pid):
                time.sleep(0.1)


class _SlurmWatch:
    """A Slurm run's driver is its job: Slurm's state is joined with the run's every 2 s."""

    def __init__(self, rd: RunDir) -> None:
        from rlctl.launchers import slurm

        self.rd, self.slurm, self.job_id = rd, slurm, rd.read()["slurm"]["job_id"]
        self.job, self.asked = None, 0.0

    def check(self) -> str | None:
        if time.monotonic() - self.asked >= 2.0:
            self.asked = time.monotonic()
            self.job = self.slurm.refresh([self.rd]).get(self.rd.id)
        return f"job {self.job_id} {self.job.describe()}" if self.job else f"job {self.job_id}"

    def done(self) -> bool:
        """The run has ended: wait until its job has let go of its nodes too."""
        job = self.slurm.query([self.job_id]).get(self.job_id)
        return job is None or not job.active

    def cancel(self) -> None:
        self.slurm.cancel(self.job_id)
        self.rd.set_state(RunState.CANCELLED, f"cancelled from rlctl launch (scancel {self.job_id})")


def follow(rd: RunDir) -> int:
    """Show the run's phases and steps until it ends; Ctrl-C cancels the run. Returns the exit code."""
    from rich.console import Console

    err = Console(stderr=True)
    info = rd.read()
    err.print(f"run [bold]{rd.id}[/] ({info['mode']}, {info['launcher']})", highlight=False)
    err.print(f"  in {rd.path}", highlight=False, markup=False, soft_wrap=True)  # a path is not cut in two
    watch = _SlurmWatch(rd) if info["launcher"] == "slurm" else _LocalWatch(rd)
    shown = _Bar(err, info["steps_total"]) if err.is_terminal else _Lines(err, info["steps_total"])
    try:
        with shown:
            while True:
                note = watch.check()
                info = rd.read()
                metrics = rd.metrics()
                if metrics:
                    shown.step(metrics[-1], len(metrics))
                else:
                    shown.phase(note or phase(rd, info))
                if RunState(info["state"]).finished:
                    break
                time.sleep(0.5)
            while not watch.done():
                time.sleep(0.5)
    except KeyboardInterrupt:
        err.print("cancelling...")
        watch.cancel()
        return 130
    return _ended(rd, err)


class _Bar:
    """A terminal: one rich progress line (phase or steps, reward, step time, elapsed)."""

    def __init__(self, console, total: int) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(TextColumn("{task.description}"), BarColumn(bar_width=20), MofNCompleteColumn(),
                                 TextColumn("reward {task.fields[reward]}"), TextColumn("{task.fields[step_time]}"),
                                 TimeElapsedColumn(), console=console, transient=False)
        self.task = self.progress.add_task("starting", total=total, reward="-", step_time="")

    def __enter__(self):
        self.progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.__exit__(*exc)

    def phase(self, text: str) -> None:
        self.progress.update(self.task, description=text[:40])

    def step(self, m: dict[str, Any], done: int) -> None:
        self.progress.update(self.task, completed=done, description="training", reward=f"{m['reward_mean']:.3f}",
                             step_time=f"{m['step_time']:.2f} s/step")


class _Lines:
    """Piped: a plain line for each new phase and every tenth of the run's steps."""

    def __init__(self, console, total: int) -> None:
        self.console, self.total, self.said, self.t0 = console, total, "", time.monotonic()
        self.every, self.tenth = max(1, total // 10), -1

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def _say(self, text: str) -> None:
        if text != self.said:
            self.said = text
            self.console.print(f"[{time.monotonic() - self.t0:6.1f} s] {text}", highlight=False, markup=False)

    def phase(self, text: str) -> None:
        self._say(text)

    def step(self, m: dict[str, Any], done: int) -> None:
        if done // self.every > self.tenth or done == self.total:  # the first step, and each tenth passed
            self.tenth = done // self.every
            self._say(f"step {done}/{self.total}  reward {m['reward_mean']:.3f}  {m['step_time']:.2f} s/step")


def _ended(rd: RunDir, err) -> int:
    from rlctl.commands.status import progress_lines

    info = rd.read()
    state = RunState(info["state"])
    if state is RunState.COMPLETED:
        metrics = rd.metrics()
        err.print(f"[green]completed[/] {rd.id}")
        if metrics:  # lines that fit 80 columns, not one that wraps
            first = [m["reward_mean"] for m in metrics[:5]]
            last = [m["reward_mean"] for m in metrics[-5:]]
            err.print(f"  reward {sum(first) / len(first):.3f} (first {len(first)} steps) -> "
                      f"{sum(last) / len(last):.3f} (last {len(last)})", highlight=False)
            for line in progress_lines(metrics):
                err.print(f"  {line}", highlight=False, markup=False)
        print(rd.id)
        return 0
    if state is RunState.FAILED:
        raise RunError(f"run {rd.id} failed: {info.get('exit_reason')}")
    err.print(f"[yellow]{state.value}[/] {rd.id}: {info.get('exit_reason')}")
    return 1
