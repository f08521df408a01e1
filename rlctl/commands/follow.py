"""Following a run from `rlctl launch` and `rlctl resume`: what it is doing, until it ends.

Before its first step a run goes through phases that can take a while on a busy machine (the
model built and warmed up, servers loading, the weights' first trip to the servers); they are
read from the run directory (run.json's processes, the first events) and named as they come. On
a terminal a rich progress line shows them, then the steps with reward and step time; piped, one
plain line per phase and per tenth of the run. No line is wider than 80 columns. Ctrl-C cancels.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from rlctl.errors import RunError
from rlctl.run.dir import RunDir, RunState

if TYPE_CHECKING:
    from rlctl.launchers.liveness import Reading

HEAD_BYTES = 1 << 16
"""How much of events.jsonl the phases are read from: the events before the first step's."""


def phase(rd: RunDir, info: dict[str, Any]) -> str:
    """What a run that has recorded no step yet is doing."""
    kinds, up = _first_events(rd)
    if "eval_start" in kinds:  # before the first step (eval.before), or all a run of no steps does
        return f"evaluating held-out sets ({sum(k == 'eval_end' for k in kinds)} done)"
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


POLL_S = 0.5
"""How often the run directory is read again."""
SLURM_ASK_S = 2.0
"""How often a Slurm run's job is asked about (squeue is the whole cluster's)."""
LET_GO_S = 60.0
"""How long, after the run's end, follow waits for its supervisor to exit or its job to let go of
its nodes; then it says what still holds on, and reports the run's end all the same."""


class _Watch:
    """The run as the one reading (rlctl/launchers/liveness.py) finds it, every poll."""

    def __init__(self, rd: RunDir, info: dict[str, Any]) -> None:
        self.rd, self.on_slurm, self.asked = rd, info.get("launcher") == "slurm", float("-inf")

    def read(self) -> Reading:
        from rlctl.launchers.liveness import read_run

        ask = self.on_slurm and time.monotonic() - self.asked >= SLURM_ASK_S
        if ask:
            self.asked = time.monotonic()
        return read_run(self.rd, ask_slurm=ask)

    def note(self, info: dict[str, Any]) -> str | None:
        """A Slurm run's job, as Slurm was last seen to say, for the progress line."""
        if not self.on_slurm:
            return None
        from rlctl.launchers.slurm import JobInfo

        sl = info.get("slurm") or {}
        try:
            return f"job {sl.get('job_id')} {JobInfo(**sl['last']).describe()}"
        except (KeyError, TypeError):  # not seen by squeue yet, or slurm.last with keys a JobInfo does not have
            return f"job {sl.get('job_id')}"

    def cancel(self) -> None:
        """End the run: its supervisor (rlctl cancel's way, bounded) or its Slurm job (scancel)."""
        if not self.on_slurm:
            from rlctl.commands.cancel import stop_local

            stop_local(self.rd, self.rd.read())
            return
        from rlctl.launchers import slurm

        job_id = slurm.job_id_of(self.rd.read())
        slurm.cancel(job_id)
        self.rd.set_state(RunState.CANCELLED, f"cancelled from rlctl launch (scancel {job_id})")


def follow(rd: RunDir) -> int:
    """Show the run's phases and steps until it ends; Ctrl-C cancels the run. Returns the exit code."""
    from rich.console import Console

    from rlctl.launchers.liveness import let_go

    err = Console(stderr=True)
    info = rd.read()
    err.print(f"run [bold]{rd.id}[/] ({info['mode']}, {info['launcher']})", highlight=False)
    err.print(f"  in {rd.path}", highlight=False, markup=False, soft_wrap=True)  # a path is not cut in two
    watch = _Watch(rd, info)
    shown = _Bar(err, info["steps_total"]) if err.is_terminal else _Lines(err, info["steps_total"])
    try:
        with shown:
            while True:
                now = watch.read()
                metrics = rd.metrics()
                if metrics:
                    shown.step(metrics[-1], len(metrics))
                else:
                    shown.phase(watch.note(now.info) or phase(rd, now.info))
                if now.state.finished:
                    break
                time.sleep(POLL_S)
        held = let_go(rd, LET_GO_S, poll_s=POLL_S if watch.on_slurm else 0.1)
        if held:
            err.print(f"{held} still holds on {LET_GO_S:.0f} s after the run ended", highlight=False, markup=False)
    except KeyboardInterrupt:
        err.print("cancelling...")
        watch.cancel()
        return 130
    return _ended(rd, err, now)


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


def _ended(rd: RunDir, err, now: Reading) -> int:
    """The run's end as the reading gave it: completed (exit 0), failed (an error, exit 1), else 1."""
    from rlctl.commands.status import progress_lines
    from rlctl.run.checkpoint import final_policy
    from rlctl.run.evals import eval_lines, eval_summary

    state = now.state
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
        for line in eval_lines(eval_summary(rd)):
            err.print(f"  {line}", highlight=False, markup=False)
        final = final_policy(rd.path)
        if final is not None:
            err.print(f"  final policy: {final.hf} (rlctl export {rd.id} DIR)", highlight=False, markup=False)
        print(rd.id)
        return 0
    if state is RunState.FAILED:
        raise RunError(f"run {rd.id} failed: {now.reason}")
    err.print(f"[yellow]{state.value}[/] {rd.id}: {now.reason}")
    return 1
