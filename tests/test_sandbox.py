"""The python tool's sandbox (rlctl/agents/sandbox.py), attacked: a model's code must not reach the
network, read or write outside its own directory, fork without bound, take more memory, CPU,
time or output than allowed, or leave anything running; and the run's files stay untouched.
Real bubblewrap processes (scripts/run-tests.sh installs bubblewrap)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from rlctl.agents.environments import ToolError
from conftest import QUICKSTART, rlctl_here, wait_for
from rlctl.agents.sandbox import Limits, PythonEnv, command, run_python, unavailable

pytestmark = [pytest.mark.process,
              pytest.mark.skipif(os.environ.get("CI") != "true" and shutil.which("bwrap") is None,
                                 reason="bubblewrap is not installed (CI installs it)")]


def test_the_sandbox_runs_code_and_returns_what_it_prints():
    assert unavailable() is None
    assert run_python("print(sum(range(10)))") == "45\n"
    assert PythonEnv().step("python", {"code": "import json; print(json.dumps([1, 2]))"}) == "[1, 2]\n"
    out = run_python("import os; print(os.getcwd(), os.getuid() != 0, sorted(os.listdir('/')))")
    cwd, not_root, listing = out.split(" ", 2)
    assert cwd == "/work" and not_root == "True"
    assert "root" not in listing and "home" not in listing and "proc" in listing


def test_no_network():
    out = run_python("import socket\ntry:\n    socket.create_connection(('1.1.1.1', 53), timeout=3)\n    print('connected')\n"
                     "except OSError as e:\n    print('refused', e.errno)")
    assert out.startswith("refused"), out
    out = run_python("import socket; print(socket.if_nameindex())")
    assert "eth" not in out and "lo" in out  # its own loopback only


def test_nothing_outside_its_directory_is_read_or_written(tmp_path):
    secret = tmp_path / "token"
    secret.write_text("s3cret")
    secret.chmod(0o644)  # readable by anyone on the host: still not in the sandbox
    out = run_python(f"print(open({str(secret)!r}).read())")
    assert "s3cret" not in out and "No such file" in out
    for target in ("/usr/evil", "/etc/evil", str(tmp_path / "evil")):
        out = run_python(f"open({target!r}, 'w').write('x')")
        assert "[exit code 1]" in out, out
        assert not Path(target).exists()
    assert run_python("open('/work/own', 'w').write('x'); print(open('/work/own').read())") == "x\n"
    assert run_python("import os; print(os.path.exists('/work/own'))") == "False\n"  # a fresh directory every call
    assert secret.read_text() == "s3cret"


def test_a_fork_bomb_is_bounded_and_leaves_nothing_running():
    before = _sandbox_processes()
    out = run_python("import os\nn = 0\nwhile True:\n    os.fork()\n    n += 1", Limits(seconds=10, processes=8))
    assert "Resource temporarily unavailable" in out or "[killed" in out, out[-300:]
    wait_for(lambda: _sandbox_processes() <= before, 10, "the fork bomb's processes to be gone")


def test_memory_cpu_time_and_output_are_limited():
    assert "MemoryError" in run_python("x = bytearray(1 << 31)", Limits(memory_mb=256))
    t0 = time.monotonic()
    assert run_python("while True: pass", Limits(seconds=1.5, cpu_seconds=30)).endswith("[killed: ran past 1.5 s]")
    assert time.monotonic() - t0 < 10
    assert run_python("while True: pass", Limits(seconds=30, cpu_seconds=1)).endswith("[stopped: past 1 CPU seconds]")
    out = run_python("print('a' * 100000)", Limits(output_bytes=1000))
    assert len(out) < 1100 and out.endswith("[stopped: output past 1000 bytes]")
    assert "File too large" in run_python("open('/work/big', 'wb').write(b'x' * (8 << 20))", Limits(disk_mb=4))
    many = "for i in range(4):\n    open(f'/work/f{i}', 'wb').write(b'x' * (3 << 20))"
    assert "No space left" in run_python(many, Limits(disk_mb=4)) and "No space left" in run_python(
        many.replace("/work", "/tmp"), Limits(disk_mb=4))


def test_a_sandbox_killed_at_its_time_leaves_no_process():
    before = _sandbox_processes()
    run_python("import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', 'import signal; signal.pause()'])\n"
               "while True: pass", Limits(seconds=1.0))
    # the kernel kills the sandbox's processes when its first one dies with bwrap: moments later
    wait_for(lambda: _sandbox_processes() <= before, 10, "the sandbox's processes to be gone")


def test_no_secret_on_the_command_line_and_the_code_comes_on_stdin():
    argv = command(Limits(), os.getuid())
    assert "-" == argv[-1] and not any("token" in a.lower() for a in argv)
    assert "--unshare-all" in argv and "--clearenv" in argv and "--die-with-parent" in argv


def test_without_bubblewrap_the_tool_is_refused_in_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", "/nonexistent")
    why = unavailable()
    assert why is not None and "\n" not in why and "install bubblewrap" in why
    res = rlctl_here("launch", str(QUICKSTART), "rollout.multi_turn.enabled=true",
                     "rollout.multi_turn.environment=python", f"run.output_dir={tmp_path / 'runs'}", cwd=tmp_path)
    assert res.returncode == 2, res.stderr
    (line,) = res.stderr.strip().splitlines()
    assert "rollout.multi_turn.environment: the python tool runs code only in a bubblewrap sandbox" in line
    assert not (tmp_path / "runs").exists()  # nothing was started or created


def test_a_tool_error_when_the_sandbox_cannot_start(monkeypatch):
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: (_ for _ in ()).throw(OSError("no such program")))
    with pytest.raises(ToolError, match="the sandbox did not start"):
        run_python("print(1)")


def _sandbox_processes() -> int:
    """Live processes on this host that run bwrap or belong to the sandbox's user (nobody). A
    zombie is not counted: a killed sandbox's first process is reparented to this host's pid 1,
    which in a container may never reap it, and it holds nothing but its pid."""
    n = 0
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
            cmd = (d / "cmdline").read_bytes()
            if state != "Z" and (b"bwrap" in cmd.split(b"\0")[0] or d.stat().st_uid == 65534):
                n += 1
        except (OSError, IndexError):
            pass
    return n


def test_the_python_tools_sandbox_is_killed_at_the_recipes_tool_timeout():
    from rlctl.agents.builtin import environment_factory
    from rlctl.recipe import MultiTurnConfig

    env = environment_factory(MultiTurnConfig(enabled=True, environment="python", tool_timeout_s=1.5))()
    assert env.step("python", {"code": "while True: pass"}).endswith("[killed: ran past 1.5 s]")
