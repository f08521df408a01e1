"""One damaged run directory never takes the others down: every reading command (status, status
--json, status RUN, compare, trace, logs, cancel) returns within seconds, shows the good runs as
they are, and marks the bad one (`unreadable: why` in a listing, one line and exit 1 when it is
the run named; `damaged: ...` where only events, metrics, recipe or logs are hurt).

The runs are copies of one real run (launched once per module, so the module is in the process
tier), each damaged in its own way. The commands on them run in this process (rlctl_here)."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import FAST, QUICKSTART, rlctl, rlctl_here

pytestmark = pytest.mark.process

SLOW_S = 10.0  # a command takes well under 2 s; this is loose for a loaded 2-core machine
GOOD = ("good-20261201-120000-00a0", "good-20261201-120000-00a1")


def _edit_info(fn: Callable[[dict], None]) -> Callable[[Path], None]:
    def damage(d: Path) -> None:
        info = json.loads((d / "run.json").read_text())
        fn(info)
        (d / "run.json").write_text(json.dumps(info))
    return damage


def _write(name: str, data: bytes) -> Callable[[Path], None]:
    return lambda d: (d / name).write_bytes(data)


def _replace(name: str, make: Callable[[Path], None]) -> Callable[[Path], None]:
    def damage(d: Path) -> None:
        (d / name).unlink()
        make(d / name)
    return damage


def _before_last_lines(name: str, garbage: bytes, keep: int = 2) -> Callable[[Path], None]:
    """Garbage lines put before the last `keep` lines of a JSONL file (keep=0: at its end)."""
    def damage(d: Path) -> None:
        lines = (d / name).read_bytes().splitlines(keepends=True)
        cut = len(lines) - keep
        (d / name).write_bytes(b"".join(lines[:cut]) + garbage + b"".join(lines[cut:]))
    return damage


def _truncate_last_line(name: str) -> Callable[[Path], None]:
    def damage(d: Path) -> None:
        data = (d / name).read_bytes()
        (d / name).write_bytes(data[: len(data) - 1 - len(data.rstrip(b"\n").rsplit(b"\n", 1)[-1]) // 2])
    return damage


def _run_dir_is_a_file(d: Path) -> None:
    shutil.rmtree(d)
    d.write_text("not a run directory\n")


NOT_OBJECTS = b'[1, 2]\n5\n"a string"\nnull\n{"t": "soon", "event": 7}\n{"t": 1e400, "event": "step_end"}\n'
ALIAS_BOMB = b'a: &a ["x","x","x","x","x","x","x","x","x"]\n' + b"".join(
    f"{c}: &{c} [*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p}]\n".encode() for p, c in zip("abcdefgh", "bcdefghi"))

# kind -> (damage, what it hurts). "run": run.json cannot be read, so the run is unreadable;
# "events", "metrics", "recipe", "logs": the run is readable, that part of it is damaged.
KINDS: dict[str, tuple[Callable[[Path], None], str]] = {
    "runjson-missing": (lambda d: (d / "run.json").unlink(), "run"),
    "runjson-empty": (_write("run.json", b""), "run"),
    "runjson-notjson": (_write("run.json", b'{"id": "x", "state": '), "run"),
    "runjson-list": (_write("run.json", b"[1, 2, 3]"), "run"),
    "runjson-string": (_write("run.json", b'"a run"'), "run"),
    "runjson-badutf8": (lambda d: (d / "run.json").write_bytes(b"\xff\xfe" + (d / "run.json").read_bytes()), "run"),
    "runjson-deep": (_write("run.json", b"[" * 100_000), "run"),
    "runjson-nostate": (_edit_info(lambda i: i.pop("state")), "run"),
    "runjson-wrongtypes": (_edit_info(lambda i: i.update(processes="many", steps_total="3")), "run"),
    "runjson-badstate": (_edit_info(lambda i: i.update(state="exploded")), "run"),
    "runjson-badtime": (_edit_info(lambda i: i.update(created="yesterday")), "run"),
    "runjson-badpid": (_edit_info(lambda i: i["processes"].update(supervisor={"pid": [1]})), "run"),
    "runjson-dir": (_replace("run.json", lambda p: p.mkdir()), "run"),
    "runjson-dangling": (_replace("run.json", lambda p: p.symlink_to(p.parent / "gone.json")), "run"),
    "runjson-fifo": (_replace("run.json", lambda p: os.mkfifo(p)), "run"),  # never opened for a blocking read
    "rundir-file": (_run_dir_is_a_file, "run"),
    "events-badutf8": (_before_last_lines("events.jsonl", b"\xff\xfe\xfd{\x80}\n"), "events"),
    "events-nul": (_before_last_lines("events.jsonl", b"\x00" * 64 + b"\n"), "events"),
    "events-truncated": (_truncate_last_line("events.jsonl"), "events"),
    "events-10mb-line": (_before_last_lines("events.jsonl", b'{"pad": "' + b"x" * (10 << 20) + b"\n"), "events"),
    "events-not-objects": (_before_last_lines("events.jsonl", NOT_OBJECTS), "events"),
    "events-fifo": (_replace("events.jsonl", lambda p: os.mkfifo(p)), "events"),
    "metrics-garbled": (_before_last_lines("metrics.jsonl", b"\xff\xfe\n\x00\x00\n[3]\n", keep=0), "metrics"),
    "metrics-wrong-fields": (_before_last_lines("metrics.jsonl", b'{"step": "two", "reward_mean": "high"}\n', 1), "metrics"),
    "metrics-10mb-line": (_before_last_lines("metrics.jsonl", b"y" * (10 << 20) + b"\n", keep=0), "metrics"),
    "metrics-truncated": (_truncate_last_line("metrics.jsonl"), "metrics"),
    "recipe-missing": (lambda d: (d / "recipe.yaml").unlink(), "recipe"),
    "recipe-alias-bomb": (_write("recipe.yaml", ALIAS_BOMB), "recipe"),
    "logs-symlink-out": (_replace("logs/controller.log", lambda p: p.symlink_to("/etc/passwd")), "logs"),
}
RUN_IDS = {kind: f"{kind}-20261201-120000-{i:04x}" for i, kind in enumerate(KINDS)}
UNREADABLE = [k for k, (_, part) in KINDS.items() if part == "run"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """A runs directory: two copies of one real run, and one damaged copy per kind."""
    root = tmp_path_factory.mktemp("garbled")
    res = rlctl("launch", str(QUICKSTART), *FAST, f"run.output_dir={root / 'source'}", cwd=root)
    assert res.returncode == 0, res.stderr
    (source,) = (root / "source").iterdir()
    out = root / "runs"
    for run_id in [*GOOD, *RUN_IDS.values()]:
        shutil.copytree(source, out / run_id, symlinks=True)
        _edit_info(lambda i, run_id=run_id: i.update(id=run_id, name=run_id.rsplit("-", 3)[0]))(out / run_id)
    for kind, (damage, _) in KINDS.items():
        damage(out / RUN_IDS[kind])
    return out


def cli(runs: Path, *args: str):
    """rlctl on the runs directory, timed: every command answers within seconds, never hangs."""
    start = time.monotonic()
    # A wide terminal, so that what a table says is on one line of its output.
    res = rlctl_here(*args, "--runs-dir", str(runs), cwd=runs.parent, env={"COLUMNS": "1000"})
    took = time.monotonic() - start
    assert took < SLOW_S, f"rlctl {' '.join(args)} took {took:.1f} s"
    return res


def one_error_line(res, code: int, *words: str) -> str:
    assert res.returncode == code, (res.returncode, res.stdout[-2000:], res.stderr[-2000:])
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and len(lines[0]) < 400, res.stderr[-2000:]
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def test_status_lists_every_run_good_ones_as_they_are(runs):
    good = json.loads((runs / GOOD[0] / "metrics.jsonl").read_text().splitlines()[-1])
    res = cli(runs, "status", "--json")
    assert res.returncode == 0, res.stderr
    rows = {r["path"].rsplit("/", 1)[-1]: r for r in json.loads(res.stdout)}
    assert set(rows) == {*GOOD, *RUN_IDS.values()}
    for run_id in GOOD:
        row = rows[run_id]
        assert (row["state"], row["step"], row["steps_total"], row["reward"]) == ("completed", 3, 3, good["reward_mean"])
        assert "unreadable" not in row and "problems" not in row
    for kind, run_id in RUN_IDS.items():
        row = rows[run_id]
        if kind in UNREADABLE:
            assert row["state"] == "unreadable" and row["unreadable"] and "\n" not in row["unreadable"], row
        else:
            assert row["state"] == "completed" and "unreadable" not in row, row
    assert rows[RUN_IDS["metrics-truncated"]]["step"] == 2  # the last complete record
    for kind in ("metrics-garbled", "metrics-10mb-line"):
        assert rows[RUN_IDS[kind]]["step"] == 3 and rows[RUN_IDS[kind]]["problems"], rows[RUN_IDS[kind]]
    assert rows[RUN_IDS["runjson-fifo"]]["unreadable"] == "run.json is a FIFO, not a file"
    assert rows[RUN_IDS["rundir-file"]]["unreadable"] == "the run directory is not a directory"

    res = cli(runs, "status")
    assert res.returncode == 0, res.stderr
    lines = {line.split()[0]: line for line in res.stdout.splitlines()[1:]}
    assert set(lines) == {*GOOD, *RUN_IDS.values()}
    assert lines[GOOD[0]].split()[3:6] == ["completed", "3/3", f"{good['reward_mean']:.3f}"]
    for kind in UNREADABLE:
        assert f"unreadable: {rows[RUN_IDS[kind]]['unreadable']}" in lines[RUN_IDS[kind]]
    assert "damaged: metrics.jsonl: 3 lines are not JSON objects" in lines[RUN_IDS["metrics-garbled"]]


@pytest.mark.parametrize("kind", list(KINDS))
def test_each_command_on_a_damaged_run(runs, kind):
    run_id, part = RUN_IDS[kind], KINDS[kind][1]
    trace = runs.parent / f"{kind}.trace.json"
    status = cli(runs, "status", run_id)
    traced = cli(runs, "trace", run_id, "-o", str(trace))
    compared = cli(runs, "compare", GOOD[0], run_id)
    cancelled = cli(runs, "cancel", run_id)
    logs = cli(runs, "logs", run_id)
    assert GOOD[0] in compared.stdout and run_id in compared.stdout  # the good run is compared all the same
    if part == "run":
        why = one_error_line(status, 1, run_id, "unreadable: ")
        assert one_error_line(traced, 1) == why
        one_error_line(compared, 1, run_id, "unreadable: ", "left out")
        assert "unreadable: " in compared.stdout and "learning" in compared.stdout
        one_error_line(cancelled, 1, run_id, "not cancelled")
        if kind == "rundir-file":
            one_error_line(logs, 1, "not a directory")
        else:
            assert logs.returncode == 0 and logs.stdout == (runs / GOOD[0] / "logs" / "controller.log").read_text()
        return
    assert status.returncode == 0 and "completed" in status.stdout, status.stderr
    assert compared.returncode == 0, compared.stderr
    assert cancelled.returncode == 0 and "already completed" in cancelled.stdout, cancelled.stderr
    if kind == "events-fifo":
        one_error_line(traced, 1, "events.jsonl is a FIFO, not a file")
        assert "damaged: events.jsonl is a FIFO, not a file" in status.stdout
    else:
        assert traced.returncode == 0, traced.stderr
        assert len(json.loads(trace.read_text())["traceEvents"]) > 20
    if kind in ("events-badutf8", "events-nul", "events-not-objects", "events-10mb-line"):
        assert "left out:" in traced.stdout and "not JSON objects" in traced.stdout
    if kind in ("events-badutf8", "events-nul", "events-not-objects"):
        assert "damaged: events.jsonl:" in status.stdout  # within the last events it shows
    if kind == "recipe-missing":
        assert "damaged: no recipe.yaml" in status.stdout and "damaged: no recipe.yaml" in compared.stdout
    if kind == "recipe-alias-bomb":
        assert "damaged: recipe.yaml is not a readable recipe" in compared.stdout
    if kind == "logs-symlink-out":
        one_error_line(logs, 1, "leads out of the run's logs directory")
        assert "root:" not in logs.stdout
    else:
        assert logs.returncode == 0 and logs.stdout == (runs / GOOD[0] / "logs" / "controller.log").read_text()


def test_compare_good_runs_and_all_at_once(runs):
    res = cli(runs, "compare", *GOOD)
    assert res.returncode == 0, res.stderr
    assert "learning" in res.stdout and "unreadable" not in res.stdout and "damaged" not in res.stdout
    res = cli(runs, "compare", *GOOD, "--json")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["config"]["keys_differ"] == 0 and data["config"]["keys_total"] > 50 and "unreadable" not in data
    res = cli(runs, "compare", *GOOD, *RUN_IDS.values(), "--json")
    one_error_line(res, 1, "unreadable: ", f"{len(UNREADABLE) - 1} more unreadable runs")
    data = json.loads(res.stdout)
    assert [r["id"] for r in data["runs"]] == [*GOOD, *(RUN_IDS[k] for k in KINDS if k not in UNREADABLE)]
    assert sorted(r["id"] for r in data["unreadable"]) == sorted(RUN_IDS[k] for k in UNREADABLE)
    assert data["metrics"]["reward_mean"][0]["last_mean"] == data["metrics"]["reward_mean"][1]["last_mean"]


@pytest.mark.parametrize("role,code,words", [
    ("../../etc/passwd", 2, "is not a role"),
    ("/etc/passwd", 2, "is not a role"),
    ("..", 2, "is not a role"),
    ("trainer-9", 2, "no log for role 'trainer-9'"),
])
def test_logs_reads_only_the_runs_own_logs(runs, role, code, words):
    res = cli(runs, "logs", GOOD[0], role)
    one_error_line(res, code, words)
    assert res.stdout == ""


def test_a_named_run_that_is_not_there_is_still_a_usage_error(runs):
    one_error_line(cli(runs, "status", "no-such-run"), 2, "no run 'no-such-run'")
    one_error_line(cli(runs, "trace", "no-such-run", "-o", str(runs.parent / "x.json")), 2, "no run")
