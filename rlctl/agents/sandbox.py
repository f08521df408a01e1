"""The built-in `python` tool: a model's code run in a bubblewrap sandbox, never bare.

Each call is a fresh `bwrap` with every namespace unshared (no network but its own loopback, its
own process tree, no view of the host's processes), the host's system and Python directories
mounted read-only on a read-only root, a private, size-capped tmpfs as its home and working
directory (/work) and its /tmp, an empty environment, and Python in isolated mode without site-packages (the standard
library only). Limits, from Limits: CPU seconds and address space (RLIMIT_CPU, RLIMIT_AS), the
processes it may have (RLIMIT_NPROC, counted for an unprivileged user: run as root, the sandbox
drops to `nobody` first, as root ignores the limit), the size of a file (RLIMIT_FSIZE), open
files, the bytes of output read back (past them, and past its wall-clock seconds, the whole
sandbox is killed: it dies with bwrap). The code comes on stdin.

Without bubblewrap, or where it cannot make its namespaces, the tool is refused in one line
(`unavailable()`) before a run starts: code a model writes never runs outside a sandbox.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import selectors
import time
from dataclasses import dataclass
from pathlib import Path

from rlctl.agents.environments import Environment, ToolError

NOBODY = 65534

PYTHON_TOOL = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run Python code (standard library only, no network) and return what it prints.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
    },
}


@dataclass(frozen=True)
class Limits:
    seconds: float = 10.0
    """Wall-clock seconds; past them the sandbox is killed."""
    cpu_seconds: int = 10
    memory_mb: int = 512
    """Address space of each process."""
    processes: int = 16
    """Processes (and threads) the sandbox may have at once."""
    output_bytes: int = 16_384
    """stdout and stderr together; past them the sandbox is killed."""
    disk_mb: int = 64
    """Each of its tmpfs mounts (/work and /tmp), and any one file (RLIMIT_FSIZE)."""
    open_files: int = 64


def unavailable() -> str | None:
    """Why the sandbox cannot run here (one line), or None when it can."""
    if sys.platform != "linux":
        return "the python tool's sandbox (bubblewrap) runs on Linux only"
    for tool, package in (("bwrap", "bubblewrap"), ("prlimit", "util-linux"), ("setpriv", "util-linux")):
        if shutil.which(tool) is None:
            return (f"the python tool runs code only in a bubblewrap sandbox, and `{tool}` is not installed; "
                    f"install {package} (apt-get install {package}) or use another environment")
    try:
        result = run_python("print(6*7)", Limits(seconds=30))
    except ToolError as e:
        return f"bubblewrap could not start a sandbox here ({e}); allow unprivileged user namespaces or use another environment"
    if result.strip() != "42":
        return f"bubblewrap's sandbox ran a test program wrongly ({result.strip()[:200]!r})"
    return None


def interpreter() -> str:
    """The Python the sandbox runs: the system's (readable by `nobody`, which a Python under
    /root is not), else this process's own."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.access(candidate, os.X_OK):
            return os.path.realpath(candidate)
    return os.path.realpath(sys.executable)


def _ro_binds(python: str) -> list[str]:
    """The host directories a sandboxed Python needs, read-only: the system's and its own."""
    prefix = os.path.dirname(os.path.dirname(python))
    paths = {"/usr", "/bin", "/lib", "/lib64", "/lib32", "/etc/alternatives", "/etc/ld.so.cache", prefix}
    args: list[str] = []
    for p in sorted(paths):
        if os.path.exists(p):
            args += ["--ro-bind", p, p]
    return args


def command(limits: Limits, own_uid: int, processes_now: int = 0, info_fd: int | None = None) -> list[str]:
    """The command line that runs Python from stdin in the sandbox (no secret is on it).
    `processes_now`: the processes own_uid has already, which RLIMIT_NPROC counts too (0 for
    root, whose sandbox runs as `nobody`); `info_fd`: where bwrap writes the pid of the
    sandbox's first process."""
    nproc = limits.processes + processes_now
    rlimits = ["prlimit", f"--cpu={limits.cpu_seconds}:{limits.cpu_seconds + 1}", f"--as={limits.memory_mb << 20}", f"--nproc={nproc}",
               f"--fsize={limits.disk_mb << 20}", f"--nofile={limits.open_files}", "--core=0", "--"]
    drop = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--"] if own_uid == 0 else []
    size = str(limits.disk_mb << 20)
    python = interpreter()
    info = ["--info-fd", str(info_fd)] if info_fd is not None else []
    bwrap = ["bwrap", *info, "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session", "--disable-userns", *_ro_binds(python),
             "--proc", "/proc", "--dev", "/dev", "--size", size, "--tmpfs", "/tmp", "--size", size, "--tmpfs", "/work",
             "--remount-ro", "/", "--chdir", "/work", "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/work",
             "--setenv", "LANG", "C.UTF-8", "--setenv", "PYTHONDONTWRITEBYTECODE", "1", "--"]
    return [*rlimits, *drop, *bwrap, python, "-I", "-S", "-"]


def _processes_of(uid: int) -> int:
    count = 0
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                count += d.stat().st_uid == uid
            except OSError:
                pass
    return count


def run_python(code: str, limits: Limits = Limits()) -> str:
    """Run `code` in the sandbox; its output (stdout and stderr, at most limits.output_bytes), with
    how it ended when it did not exit 0. ToolError when the sandbox itself could not start."""
    if not isinstance(code, str):
        raise ToolError(f"code must be a string, got {type(code).__name__}")
    uid = os.getuid()
    info_r, info_w = os.pipe()
    argv = command(limits, uid, _processes_of(uid) if uid != 0 else 0, info_fd=info_w)
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True, close_fds=True, pass_fds=(info_w,))
    except OSError as e:
        os.close(info_r)
        raise ToolError(f"the sandbox did not start: {e}") from None
    finally:
        os.close(info_w)
    sandbox = _Sandbox(proc, info_r)
    try:
        out, ended = _collect(sandbox, code.encode("utf-8", "replace"), limits)
    finally:
        if proc.poll() is None:
            sandbox.kill()
        os.close(info_r)
    return _result(out.decode("utf-8", "replace"), proc.returncode, ended, limits)


class _Sandbox:
    """A running bwrap and what it said of itself on its info fd: the pid of the sandbox's first
    process, in this host's pid namespace."""

    def __init__(self, proc: subprocess.Popen[bytes], info_fd: int) -> None:
        self.proc, self.info_fd = proc, info_fd
        self.info = bytearray()

    def read_info(self) -> bool:
        """Read what the info fd has; False at its end."""
        chunk = os.read(self.info_fd, 4096)
        self.info += chunk
        return bool(chunk)

    def kill(self) -> None:
        """Kill the sandbox's first process, which ends every process of its pid namespace, and
        let bwrap, its parent, see it end: nothing is left an orphan for this host's pid 1 to
        reap (in a container, one that may never). bwrap and its session are killed after, if
        they are still there."""
        try:
            pid = int(json.loads(bytes(self.info))["child-pid"])
            os.kill(pid, signal.SIGKILL)
            self.proc.wait(5)
            return
        except (ValueError, KeyError, TypeError, OSError, subprocess.TimeoutExpired):
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


def _collect(sandbox: _Sandbox, stdin: bytes, limits: Limits) -> tuple[bytes, str]:
    """The sandbox's output until it exits (""), runs past its seconds ("time") or writes past
    output_bytes ("output"); either of the last two kills it."""
    proc = sandbox.proc
    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdin.write(stdin)
        proc.stdin.close()
    except BrokenPipeError:
        pass
    deadline = time.monotonic() + limits.seconds
    out = bytearray()
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        sel.register(sandbox.info_fd, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                sandbox.kill()
                return bytes(out), "time"
            ready = [key.fileobj for key, _ in sel.select(left)]
            if sandbox.info_fd in ready and not sandbox.read_info():
                sel.unregister(sandbox.info_fd)
            if proc.stdout not in ready:
                continue
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                break
            out += chunk
            if len(out) > limits.output_bytes:
                sandbox.kill()
                return bytes(out[: limits.output_bytes]), "output"
    try:
        proc.wait(max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        sandbox.kill()
        return bytes(out), "time"
    return bytes(out), ""


def _result(text: str, code: int | None, ended: str, limits: Limits) -> str:
    if ended == "output":
        return text + f"\n[stopped: output past {limits.output_bytes} bytes]"
    if ended == "time":
        return text + f"\n[killed: ran past {limits.seconds:g} s]"
    if code == 0:
        return text
    # bwrap, the sandbox's first process, exits 128 + N when the code died of signal N (SIGXCPU at
    # its CPU limit; the hard limit, a second later, is SIGKILL)
    died = -code if code is not None and code < 0 else code - 128 if code is not None and 128 < code < 128 + 65 else 0
    if died:
        why = {signal.SIGXCPU: f"past {limits.cpu_seconds} CPU seconds", signal.SIGXFSZ: "past the file size limit",
               signal.SIGKILL: "killed"}.get(died) or _signal_name(died)
        return text + f"\n[stopped: {why}]"
    return text + f"\n[exit code {code}]"


def _signal_name(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:
        return f"signal {n}"


class PythonEnv(Environment):
    """python(code): the code's output, run in the sandbox with `limits`."""

    def __init__(self, limits: Limits = Limits()) -> None:
        self.tools = [PYTHON_TOOL]
        self.limits = limits

    def tool_python(self, code: str) -> str:
        return run_python(code, self.limits)
