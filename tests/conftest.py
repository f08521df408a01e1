"""Shared fixtures. Integration tests start real processes: rollout servers, trainers, runs."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import sglang_source
from sglang_source import Source

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "recipes" / "quickstart.yaml"

# Small and fast, for tests that only need the machinery to work, not to learn.
FAST = [
    "run.steps=3",
    "model.init.hidden_size=32",
    "model.init.head_dim=8",
    "model.init.intermediate_size=64",
    "model.init.warmup_steps=20",
    "rollout.batch_size=8",
    "rollout.group_size=4",
    "train.groups_per_batch=4",
]


@pytest.fixture(scope="session", autouse=True)
def _cache(tmp_path_factory) -> None:
    """Tests build their tiny models into their own cache, never the user's."""
    os.environ["RLCTL_CACHE"] = str(tmp_path_factory.mktemp("rlctl-cache"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from rlctl.models.tiny import build_tiny_model
    from rlctl.recipe import ModelInit

    init = ModelInit(hidden_size=32, head_dim=8, intermediate_size=64, warmup_steps=5)
    return build_tiny_model(init, "max-digit", tmp_path_factory.mktemp("models") / "tiny")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout: float, what: str):
    """Poll predicate every 0.2 s; its first truthy value, or fail naming what was awaited."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def rejoined(rd, server: str):
    """`server`'s server_rejoined event in run `rd`, or None while it has not; a run that ended
    meanwhile fails the wait at once, with the run's own reason."""
    event = next((e for e in rd.events() if e["event"] == "server_rejoined" and e["server"] == server), None)
    if event is None and (info := rd.read())["state"] in ("completed", "failed", "cancelled"):
        raise AssertionError(f"the run ended ({info['state']}: {info.get('exit_reason')}) before {server} rejoined")
    return event


def wait_http(url: str, timeout: float = 120.0) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(url)


@pytest.fixture
def start_server(tiny_model_dir, tmp_path):
    """Start built-in rollout servers as real processes; all are killed at teardown."""
    procs: list[subprocess.Popen] = []

    def start(seed: int = 0, *extra: str) -> str:
        port = free_port()
        log = (tmp_path / f"server-{port}.log").open("wb")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "rlctl.engines.rollout.builtin.server", "--model-path", str(tiny_model_dir),
             "--port", str(port), "--random-seed", str(seed), *extra],
            stdout=log, stderr=subprocess.STDOUT,
        ))
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health")
        return url

    start.procs = procs  # type: ignore[attr-defined]  # a test may kill one
    yield start
    for p in procs:
        p.kill()
        p.wait()


def rlctl(*args: str, cwd: Path, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlctl", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def processes_mentioning(text: str) -> list[int]:
    """Live (non-zombie) pids whose command line mentions text."""
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit() or int(p.name) == os.getpid():
            continue
        try:
            cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (p / "stat").read_text().rsplit(")", 1)[-1].split()[0]
        except OSError:
            continue
        if text in cmd and state != "Z":
            out.append(int(p.name))
    return out


# -- SGLang's own source (tests/sglang_source.py) -------------------------------------------------

_download_errors: dict[str, str] = {}


def ensure_wheel(version: str) -> None:
    """The wheel is there, or pip fetches it (once per version); else skip, or fail under CI."""
    try:
        sglang_source.wheel(version)
        return
    except sglang_source.MissingWheel:
        pass
    if version not in _download_errors:
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                               f"sglang=={version}", "-d", str(sglang_source.wheel_dir())],
                              capture_output=True, text=True, timeout=900)
        _download_errors[version] = "" if done.returncode == 0 else done.stderr[-1500:]
    try:
        sglang_source.wheel(version)
    except sglang_source.MissingWheel as e:
        message = f"{e}\npip download failed:\n{_download_errors[version]}"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture(scope="session")
def sglang():
    """sglang(version) -> the Source of that version's wheel."""
    def get(version: str) -> Source:
        ensure_wheel(version)
        return sglang_source.source(version)
    return get
