"""Shared fixtures, and the test tiers.

Tiers (markers; docs/testing.md):
- fast: everything not marked with a tier below. No subprocess, no socket, no sleep, and the
  guard in `_fast_tier_guard` holds every fast test to that: `pytest -m fast` runs in about a minute.
- process: starts real processes or listens on sockets (rollout servers, trainers, `rlctl` itself).
- e2e: whole runs, `rlctl launch` to the end (minutes).
- slurm: needs the project's Slurm test cluster (scripts/slurm-test-cluster.sh, as root).
- gpu: needs a CUDA GPU; skipped here, run on the GPU machine.
"""

from __future__ import annotations

import multiprocessing.process
import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
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


TIERS = ("process", "e2e", "slurm", "gpu")


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups into the test ids
def pytest_collection_modifyitems(config, items) -> None:
    """A test with no tier marker is in the fast tier. Under pytest-xdist's `--dist loadgroup`
    (scripts/run-tests.sh), tests are handed to workers a group at a time: a module's tests stay
    together (its module-scoped servers and runs start once), and every Slurm test is in one group,
    since they share the test cluster's three nodes. The slowest kinds go out first, so that the
    short ones fill the end: the Slurm group, then modules with whole runs, then those with
    processes, then the fast ones."""
    for item in items:
        if not any(item.get_closest_marker(tier) for tier in TIERS):
            item.add_marker(pytest.mark.fast)
    if not getattr(config.option, "loadgroup", False):
        return
    group_of, rank = {}, {}
    for item in items:
        group = group_of[item.nodeid] = "slurm" if item.get_closest_marker("slurm") else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))
        weight = next((i for i, tier in enumerate(("slurm", "e2e", "process")) if item.get_closest_marker(tier)), 3)
        rank[group] = min(rank.get(group, 3), weight)
    order = {group: i for i, group in enumerate(rank)}
    items.sort(key=lambda item: (rank[group_of[item.nodeid]], order[group_of[item.nodeid]]))


class NotFast(AssertionError):
    """A fast-tier test reached for a process, a socket or a sleep."""


_guard = {"on": False}


@contextmanager
def outside_fast_guard():
    """For test support code that may fetch or spawn in any tier (a missing wheel's download)."""
    was, _guard["on"] = _guard["on"], False
    try:
        yield
    finally:
        _guard["on"] = was


def _refuse(what: str):
    def refused(*args, **kwargs):
        if _guard["on"]:
            raise NotFast(f"a fast-tier test {what}: mark it @pytest.mark.process (or e2e/slurm), "
                          "or test the same thing without it (tests/conftest.py, docs/testing.md)")
        return original(*args, **kwargs)
    owner, name = _GUARDED[what]
    original = getattr(owner, name)
    refused.__wrapped__ = original  # type: ignore[attr-defined]
    return refused


_GUARDED = {
    "started a subprocess": (subprocess.Popen, "__init__"),
    "started a multiprocessing process": (multiprocessing.process.BaseProcess, "start"),
    "connected a socket": (socket.socket, "connect"),
    "connected a socket (connect_ex)": (socket.socket, "connect_ex"),
    "bound a socket": (socket.socket, "bind"),
    "slept": (time, "sleep"),
}


@pytest.fixture(autouse=True)
def _fast_tier_guard(request, monkeypatch):
    """Fast tests are held to their tier: a subprocess, a socket connect/bind or a time.sleep in one
    fails it, naming the rule. Other tiers run unguarded."""
    if request.node.get_closest_marker("fast") is None:
        yield
        return
    for what, (owner, name) in _GUARDED.items():
        monkeypatch.setattr(owner, name, _refuse(what))
    _guard["on"] = True
    try:
        yield
    finally:
        _guard["on"] = False


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


@contextmanager
def _servers(model_dir: Path, log_dir: Path):
    """start(seed, *args) -> the URL of a new built-in rollout server (a real process); all are
    killed when the block ends."""
    procs: list[subprocess.Popen] = []

    def start(seed: int = 0, *extra: str) -> str:
        port = free_port()
        log = (log_dir / f"server-{port}.log").open("wb")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "rlctl.engines.rollout.builtin.server", "--model-path", str(model_dir),
             "--port", str(port), "--random-seed", str(seed), *extra],
            stdout=log, stderr=subprocess.STDOUT,
        ))
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health")
        return url

    start.procs = procs  # type: ignore[attr-defined]  # a test may kill one
    try:
        yield start
    finally:
        for p in procs:
            p.kill()
            p.wait()


@pytest.fixture
def start_server(tiny_model_dir, tmp_path):
    """Start built-in rollout servers for one test, which may change or kill them."""
    with _servers(tiny_model_dir, tmp_path) as start:
        yield start


@pytest.fixture(scope="module")
def shared_server(tiny_model_dir, tmp_path_factory) -> str:
    """One built-in rollout server (seed 0) for a module's tests that leave it as they found it."""
    with _servers(tiny_model_dir, tmp_path_factory.mktemp("shared-server")) as start:
        yield start()


def rlctl(*args: str, cwd: Path, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m rlctl ARGS` as a real process (process tier)."""
    return subprocess.run([sys.executable, "-m", "rlctl", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def rlctl_here(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """The same command line run in this process, through rlctl.cli.main (fast tier): its exit code
    and what it wrote to stdout and stderr. For commands that start no process of their own."""
    import contextlib
    import io

    from rlctl.cli import main

    # Text streams over bytes, as a terminal's are: some commands write bytes to sys.stdout.buffer.
    out, err = (io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="replace", write_through=True)
                for _ in range(2))
    argv, here, saved = sys.argv, os.getcwd(), {k: os.environ.get(k) for k in env or {}}
    sys.argv = ["rlctl", *args]
    os.chdir(cwd)
    os.environ.update(env or {})
    code: int | str | None = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main()
    except SystemExit as e:
        code = e.code
    finally:
        sys.argv = argv
        os.chdir(here)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    if isinstance(code, str):  # sys.exit("message"): the message on stderr, exit 1
        err.write(code + "\n")
        code = 1
    text = [stream.buffer.getvalue().decode(errors="replace") for stream in (out, err)]
    return subprocess.CompletedProcess(args, code or 0, *text)


def descendants(pids: set[int]) -> set[int]:
    """pids and every live process below them (the scorer pool, SGLang's workers, ...)."""
    parent = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                parent[int(p.name)] = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
    found, grew = {p for p in pids if p in parent}, True
    while grew:
        more = {c for c, pp in parent.items() if pp in found} - found
        grew, found = bool(more), found | more
    return found


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
        with outside_fast_guard():
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


@pytest.fixture(scope="module")
def chat_tokenizer_factory():
    """chat_tokenizer_factory(template): a byte-level BPE tokenizer with ChatML's special tokens
    and that chat template, built here."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["What is 2+3? The answer is 5.", "system user assistant Be brief."] * 20, trainer)
    return lambda template: PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                                    pad_token="<|endoftext|>", chat_template=template)
