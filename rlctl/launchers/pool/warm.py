"""Warm engine starts: a pool forks each run's engine processes from one process that has
already imported torch and the engines, instead of starting a Python for each of them.

A cold engine process spends seconds of CPU importing torch, transformers and aiohttp before it
loads a model; a pool that serves many short runs pays that for every one of them, on the same
devices its runs are computing on. `python -m rlctl.launchers.pool.warm` (the *forker*, started
by the pool's service) imports them once, then forks one child per request. The child is what
`python -m rlctl.worker ROLE --run-dir DIR --index I` would have been: its own session (the pool
signals its process group), killed when the forker dies (which dies with the pool), its output in
the run's log, its environment the one the pool sends (no secrets: the token file's path).

The forker never touches CUDA and runs no torch operation, which is what makes forking it safe: a
CUDA context and torch's thread pools do not survive a fork, and a child makes its own when it
first needs them. (Loading torch leaves one idle thread waiting on a futex in the forker, as it
does in a DataLoader's parent when that forks its workers; Python warns about any fork of a
process with threads, and the forker silences that one warning.)

Protocol, one JSON object per line:
    pool -> forker   {"id": N, "argv": [...rlctl.worker args], "log": PATH, "env": {...}}
    forker -> pool   {"ready": true}                once the imports are done
                     {"id": N, "pid": PID}          a child started
                     {"exit": PID, "code": CODE}    a child ended (CODE < 0: killed by -CODE)
"""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
from pathlib import Path

WARM_MODULES = ("torch", "torch.distributed", "safetensors.torch", "transformers", "aiohttp", "aiohttp.web",
                "rlctl.worker", "rlctl.engines.rollout.builtin.server", "rlctl.engines.train.service",
                "rlctl.engines.train.torch_engine", "rlctl.engines.weightsync.sender",
                "transformers.generation.utils", "transformers.models.auto.modeling_auto",
                "transformers.models.qwen3.modeling_qwen3")
"""What a built-in engine process imports before it serves (optional ones may be absent): torch,
the engines, and transformers' modules for the architecture of the model rlctl builds
(rlctl/models/tiny.py), which transformers would otherwise import on first use."""


class WarmProcess:
    """A forked engine process, as much of subprocess.Popen as the pool uses."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._ended = threading.Event()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def _end(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
            self._ended.set()


class Forker:
    """The pool's end: starts the forker and asks it for processes."""

    def __init__(self, log: Path, ready_timeout_s: float = 300.0) -> None:
        from rlctl.process.lifetime import die_with_parent

        self.ready_timeout_s = ready_timeout_s
        with log.open("ab") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "rlctl.launchers.pool.warm"], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=err, start_new_session=True,
                                         preexec_fn=die_with_parent)
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._started: dict[int, tuple[threading.Event, list[WarmProcess]]] = {}
        self._children: dict[int, WarmProcess] = {}
        self._next = 0
        threading.Thread(target=self._read, name="forker-replies", daemon=True).start()

    def spawn(self, argv: list[str], log: Path, env: dict[str, str]) -> WarmProcess:
        """Fork `python -m rlctl.worker *argv` (blocking: call it from a thread)."""
        from rlctl.errors import RunError

        if not self._ready.wait(self.ready_timeout_s) or self.proc.poll() is not None:
            raise RunError(f"the pool's engine forker is not running (exit code {self.proc.poll()}); see the pool's log")
        with self._lock:
            self._next += 1
            rid, done = self._next, threading.Event()
            self._started[rid] = (done, [])
            line = json.dumps({"id": rid, "argv": argv, "log": str(log), "env": env}) + "\n"
            assert self.proc.stdin is not None
            self.proc.stdin.write(line.encode())
            self.proc.stdin.flush()
        if not done.wait(30.0):
            raise RunError("the pool's engine forker did not start a process within 30 s; see the pool's log")
        started = self._started.pop(rid)[1]
        if not started:
            raise RunError(f"the pool's engine forker exited (code {self.proc.poll()}); see the pool's logs/forker.log")
        return started[0]

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            try:
                msg = json.loads(raw)
            except ValueError:
                continue  # not the forker's: nothing else writes here, but a stray line must not stop this
            if msg.get("ready"):
                self._ready.set()
            elif "pid" in msg:
                child = self._children[msg["pid"]] = WarmProcess(msg["pid"])
                done, out = self._started[msg["id"]]
                out.append(child)
                done.set()
            elif "exit" in msg and msg["exit"] in self._children:
                self._children.pop(msg["exit"])._end(int(msg["code"]))
        for child in self._children.values():  # the forker is gone, and its children with it
            child._end(-signal.SIGKILL)
        for done, _ in list(self._started.values()):  # requests it will never answer
            done.set()
        self._ready.set()

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()  # the forker exits at the end of its input
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# -- the forker -------------------------------------------------------------------------------


def _child(req: dict) -> None:
    """In the forked child: become the engine process the request describes; never returns."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)  # the forker's, closed below
        os.setsid()
        from rlctl.process.lifetime import die_with_parent

        die_with_parent()
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL)
        out = os.open(req["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.closerange(3, 256)  # the forker's pipes and whatever else it held
        sys.stdin = open(0, closefd=False)  # noqa: SIM115
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        os.environ.clear()
        os.environ.update(req["env"])
        sys.argv = ["rlctl.worker", *req["argv"]]
        from rlctl.worker import main

        code = main(req["argv"]) or 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


_replies = sys.stdout
"""The pipe to the pool: serve() moves it off fd 1, so that a print by a module being imported
goes to the forker's log, not into the replies."""


def _say(msg: dict) -> None:
    _replies.write(json.dumps(msg) + "\n")
    _replies.flush()


def serve() -> None:
    import warnings

    global _replies
    _replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)

    warnings.filterwarnings("ignore", r"This process \(pid=\d+\) is multi-threaded", DeprecationWarning)
    for name in WARM_MODULES:
        try:
            importlib.import_module(name)
        except ImportError as e:
            print(f"not preloaded: {name} ({e})", file=sys.stderr, flush=True)
    _say({"ready": True})
    wake_r, wake_w = os.pipe()  # a child's exit wakes the select at once (its signal writes here)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    pending = b""
    while True:
        readable, _, _ = select.select([sys.stdin.fileno(), wake_r], [], [], 1.0)
        if wake_r in readable:
            os.read(wake_r, 512)
        if sys.stdin.fileno() in readable:
            data = os.read(sys.stdin.fileno(), 1 << 16)
            if not data:
                return
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                req = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    _child(req)
                _say({"id": req["id"], "pid": pid})
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            _say({"exit": pid, "code": os.waitstatus_to_exitcode(status)})


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the pool stops it (end of input), not a terminal's Ctrl-C
    serve()
    sys.exit(0)
