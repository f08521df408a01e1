"""The local launcher: every process of a run on this host, watched by one supervisor process.

`rlctl launch` creates the run directory and starts the supervisor (`python -m rlctl.worker
supervisor`) in its own session, so the run survives the terminal (`--detach`). The supervisor
starts the other roles as `python -m rlctl.worker ROLE`, each in its own process group with its
own log, and ends all of them when any one dies, when the controller finishes, or on SIGTERM
(`rlctl cancel`, Ctrl-C in `rlctl launch`). Children get PR_SET_PDEATHSIG, so even a SIGKILL of
the supervisor leaves no orphans.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlctl.run.checkpoint import PREEMPTED_EXIT
from rlctl.process.auth import TOKEN_FILE, TOKEN_FILE_ENV
from rlctl.process import lifetime
from rlctl.launchers.health import healthy
from rlctl.errors import RunError
from rlctl.process.topology import Role, Topology
from rlctl.recipe import Launcher, Recipe, recipe_from_yaml
from rlctl.run.dir import RunDir, RunState
from rlctl.run.tail import last_log_line
from rlctl.process.watchdog import HEARTBEAT_FILE, heartbeat_age

POLL_S = 0.2
TERM_GRACE_S = 5.0
FAIL_GRACE_S = 2.0
SERVER_START_TIMEOUT_S = 300.0
POOL_NOTICE_S = 2.0
"""How long a pooled run that failed here waits for its pool to say whether it let the run go."""


def worker_command(role: str, run_dir: Path, index: int | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "rlctl.worker", role, "--run-dir", str(run_dir)]
    if index is not None:
        cmd += ["--index", str(index)]
    return cmd


def spawn(cmd: list[str], log: Path, *, die_with_parent: bool, env: dict[str, str] | None = None) -> subprocess.Popen:
    with log.open("ab") as out:
        return subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, preexec_fn=lifetime.die_with_parent if die_with_parent else None,
            env={**os.environ, **(env or {})},
        )


def run_env(rd: RunDir) -> dict[str, str]:
    """What a local run's processes get on top of this environment (the supervisor's children
    inherit it): the path of the run's token file (rlctl/process/auth.py), and loopback for the sockets
    gloo and NCCL open for their peers, which are all on this host (unless already set)."""
    env = {TOKEN_FILE_ENV: str(rd.path.resolve() / TOKEN_FILE)}
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        env[name] = os.environ.get(name, "lo")
    return env


def start_supervisor(rd: RunDir) -> int:
    """Start the run's supervisor, detached from this terminal; returns its pid."""
    proc = spawn(worker_command("supervisor", rd.path), rd.log_path("supervisor"), die_with_parent=False,
                 env=run_env(rd))
    return proc.pid


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


@dataclass
class Child:
    role: Role
    proc: subprocess.Popen


class Supervisor:
    def __init__(self, rd: RunDir) -> None:
        self.rd = rd
        info = rd.read()
        self.recipe: Recipe = recipe_from_yaml(rd.recipe_path.read_text(), str(rd.recipe_path))
        self.plan = Topology.from_json(info["plan"])
        self.children: list[Child] = []
        self.cancel_signal: int | None = None
        self.servers_down: set[str] = set()
        self.running = False
        """True once the controller runs: a server that dies then is restarted, not fatal."""
        self.restarts: dict[str, int] = {}
        self.pool: Any = None
        """launcher=pool: the PoolDir the run is attached to, while it is."""

    def _on_signal(self, signum: int, frame) -> None:
        self.cancel_signal = signum

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        self.rd.record_process("supervisor", pid=os.getpid())
        state, reason = RunState.FAILED, "supervisor stopped unexpectedly"
        try:
            state, reason = self._run()
        finally:
            self._stop_all(graceful=state is RunState.COMPLETED)
            self._leave_pool(reason)
            self.rd.event("run_end", state=state.value, reason=reason)
            self.rd.set_state(state, reason)
        return 0 if state is RunState.COMPLETED else 1

    def _start(self, role: Role) -> Child:
        if role.kind == "controller":  # an earlier attempt's heartbeat says nothing of this one
            (self.rd.path / HEARTBEAT_FILE).unlink(missing_ok=True)
        child = Child(role, spawn(worker_command(role.kind, self.rd.path, role.index),
                                  self.rd.log_path(role.name), die_with_parent=True))
        self.children.append(child)
        self.rd.record_process(role.name, pid=child.proc.pid, port=role.port, log=str(self.rd.log_path(role.name)))
        return child

    def _failure(self) -> tuple[RunState, str] | None:
        if self.cancel_signal is not None:
            return RunState.CANCELLED, f"cancelled ({signal.Signals(self.cancel_signal).name})"
        for c in list(self.children):
            code = c.proc.poll()
            if code is not None and not (c.role.kind == "controller" and code == 0):
                self.rd.event("process_exit", role=c.role.name, code=code)
                if c.role.kind == "rollout":
                    self.servers_down.add(c.role.name)
                    self.rd.event("server_down", role=c.role.name)
                    if self.running and self._replace(c, code):
                        continue  # failover (rlctl/control/failover.py): the run goes on without it meanwhile
                last = last_log_line(self.rd.log_path(c.role.name))
                if c.role.kind == "controller" and code == PREEMPTED_EXIT:  # SIGUSR1: checkpointed, as asked
                    return RunState.CANCELLED, f"{last or 'stopped after a checkpoint'}; `rlctl resume` continues it"
                said = f": {last}" if last and code > 0 else ""
                return RunState.FAILED, f"{c.role.name} (pid {c.proc.pid}) {describe_exit(code)}{said}; see {self.rd.log_path(c.role.name)}"
        return None

    def _replace(self, c: Child, code: int) -> bool:
        """A rollout server died while the run was running: start it again, up to
        rollout.max_restarts times; after that the run goes on without it. The controller sends
        its requests to the others and gives it the weights when it rejoins."""
        self.children.remove(c)
        name = c.role.name
        self.restarts[name] = self.restarts.get(name, 0) + 1
        if self.restarts[name] > self.recipe.rollout.max_restarts:
            self.rd.event("server_given_up", role=name, restarts=self.recipe.rollout.max_restarts)
            return True
        self._start(c.role)
        self.servers_down.discard(name)
        self.rd.event("server_restarted", role=name, attempt=self.restarts[name], after=describe_exit(code))
        return True

    def _run(self) -> tuple[RunState, str]:
        if self.recipe.model.init is not None:
            prep = self._start(Role("prepare", "prepare", 0, "127.0.0.1"))
            while prep.proc.poll() is None:
                if self.cancel_signal is not None:
                    return RunState.CANCELLED, f"cancelled ({signal.Signals(self.cancel_signal).name})"
                time.sleep(POLL_S)
            self.children.remove(prep)
            if prep.proc.returncode != 0:
                return RunState.FAILED, f"building the model {describe_exit(prep.proc.returncode)}; see {self.rd.log_path('prepare')}"

        if self.recipe.launcher is Launcher.POOL:
            return self._run_in_pool()
        servers = [self._start(r) for r in self.plan.rollout]
        pending = {c.role.name: url for c, url in zip(servers, self.plan.server_urls, strict=False)}
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while pending:
            failure = self._failure()
            if failure:
                return failure
            for name, url in list(pending.items()):
                if healthy(url):
                    self.rd.event("server_up", role=name, url=url)
                    del pending[name]
            if time.monotonic() > deadline:
                return RunState.FAILED, f"rollout servers {sorted(pending)} not healthy after {SERVER_START_TIMEOUT_S:.0f} s; see their logs"
            time.sleep(POLL_S)

        for r in self.plan.trainers:
            self._start(r)
        return self._watch(self._start(self.plan.controller))

    def _watch(self, controller: Child, pool_said=lambda now=False: None) -> tuple[RunState, str]:
        """The run is running: until the controller ends or something fails (`pool_said()`: why
        the pool let the run go, or None). When the pool let it go, that is why it failed, even
        if the controller failed first (its engines were stopped under it)."""
        self.rd.set_state(RunState.RUNNING)
        self.running = True
        while True:
            failure = self._failure() or self._stalled(controller)
            if failure:
                ended = pool_said(now=True)
                return (RunState.FAILED, ended) if ended else failure
            if controller.proc.poll() == 0:
                return RunState.COMPLETED, "all steps done"
            ended = pool_said()
            if ended:
                return RunState.FAILED, ended
            time.sleep(POLL_S)

    def _stalled(self, controller: Child) -> tuple[RunState, str] | None:
        """run.stall_timeout_s: a controller whose heartbeat stopped is frozen or hung: it is
        killed, and the run fails saying so (rlctl/process/watchdog.py)."""
        age = heartbeat_age(self.rd.path / HEARTBEAT_FILE)
        if age is None or age <= self.recipe.run.stall_timeout_s:
            return None
        self.rd.event("controller_stalled", seconds=round(age, 1))
        try:
            os.killpg(controller.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return RunState.FAILED, (f"controller (pid {controller.proc.pid}) made no progress for {age:.0f} s (its "
                                 f"heartbeat stopped; run.stall_timeout_s): frozen or hung; see "
                                 f"{self.rd.log_path('controller')}")

    def _run_in_pool(self) -> tuple[RunState, str]:
        """launcher=pool: the pool starts the servers and trainers on its devices (attach waits
        until they answer); the controller runs here as in any run. The run fails when the pool
        lets it go (one of its engines died, the pool shut down)."""
        from rlctl.launchers.pool.client import attach, request
        from rlctl.launchers.pool.pooldir import PoolDir

        pd = self.pool = PoolDir(Path(self.rd.read()["pool_dir"]))  # detached at the end, attached or not
        # Here the controller starts meanwhile (it waits for the engines); a Slurm pool places the
        # engines on its nodes at the attach, and the controller reads their addresses then.
        remote = pd.read().get("launcher") == "slurm"
        controller = None if remote else self._start(self.plan.controller)
        try:
            attach(pd, self.rd.path, timeout_s=SERVER_START_TIMEOUT_S + 60)
        except RunError as e:
            return RunState.FAILED, f"not attached: {e}"
        controller = controller or self._start(self.plan.controller)
        asked = [0.0]

        def pool_said(now: bool = False) -> str | None:
            """Once a second; now: something failed here, and the pool (which notices a dead
            engine within a second) is given POOL_NOTICE_S to say whether that was the cause."""
            if time.monotonic() - asked[0] < 1.0 and not now:
                return None
            deadline = time.monotonic() + (POOL_NOTICE_S if now else 0.0)
            while True:
                asked[0] = time.monotonic()
                try:
                    ended = request(pd, "GET", f"/jobs/{self.rd.id}")["ended"]
                except RunError as e:  # gone: why it let the run go, as it wrote it here, if it did
                    ended = (self.rd.read().get("pool") or {}).get("detached") or str(e)
                if ended or time.monotonic() >= deadline:
                    return f"pool {pd.name} let the run go: {ended}" if ended else None
                time.sleep(0.2)

        return self._watch(controller, pool_said)

    def _leave_pool(self, reason: str) -> None:
        if self.pool is None:
            return
        from rlctl.launchers.pool.client import detach

        try:
            detach(self.pool, self.rd.id, reason)
        except RunError:
            pass  # already let go (or the pool is gone): its engines are stopped either way
        self.pool = None

    def _stop_all(self, graceful: bool) -> None:
        """Stop every child: SIGTERM, then SIGKILL after a grace period.

        After a completed run the roles stop in tiers (controller, trainers, then servers), so the
        trainer can leave the weight-sync group while the servers still answer. After a failure
        everything gets SIGTERM at once: waiting on a dead peer must not delay the end.
        """
        kinds = ("controller", "trainer", "rollout")
        tiers = [[c for c in self.children if c.role.kind == k] for k in kinds] if graceful else [self.children]
        for tier in tiers:
            alive = [c for c in tier if c.proc.poll() is None]
            for c in alive:
                _signal_group(c.proc.pid, signal.SIGTERM)
            deadline = time.monotonic() + (TERM_GRACE_S if graceful else FAIL_GRACE_S)
            while time.monotonic() < deadline and any(c.proc.poll() is None for c in alive):
                time.sleep(0.05)
        for c in self.children:
            _signal_group(c.proc.pid, signal.SIGKILL)  # also reaps stray grandchildren
            if c.proc.poll() is None:
                c.proc.wait(timeout=5)
            if c.role.kind == "rollout" and c.role.name not in self.servers_down:
                self.servers_down.add(c.role.name)
                self.rd.event("server_down", role=c.role.name)


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass

