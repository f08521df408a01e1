"""`rlctl status` and `rlctl logs` over run directories (rendered at a fixed width)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from rich.console import Console

from conftest import FAST, QUICKSTART, processes_mentioning, rlctl, rlctl_here
from rlctl.commands.status import render_detail, render_table
from rlctl.run.dir import RunDir
from rlctl.run.find import list_runs
from rlctl.launchers.status import detail, summary
from rlctl.run.tail import last_jsonl_record, last_jsonl_records, last_log_line, tail_lines


def fake_run(root, run_id: str, state: str, steps: int, rewards: list[float], mode: str = "sync") -> RunDir:
    d = root / run_id
    (d / "logs").mkdir(parents=True)
    (d / "run.json").write_text(json.dumps({
        "schema": 1, "id": run_id, "name": run_id.rsplit("-", 3)[0], "state": state,
        "created": "2026-01-01T00:00:00+00:00", "ended": "2026-01-01T00:01:05+00:00", "exit_reason": None,
        "processes": {}, "launcher": "local", "mode": mode, "steps_total": steps,
    }))
    (d / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "reward_mean": r}) + "\n" for i, r in enumerate(rewards)))
    (d / "logs" / "controller.log").write_text("hello from the controller\n")
    return RunDir(d)


def test_table_at_width_80(tmp_path):
    fake_run(tmp_path, "quickstart-20260101-000000-aaaa", "completed", 100, [0.2, 0.7])
    fake_run(tmp_path, "long-tail-20260101-000001-bbbb", "failed", 40, [])
    console = Console(width=80, record=True, color_system=None)
    console.print(render_table([summary(rd) for rd in list_runs(tmp_path)]))
    assert console.export_text() == (
        "RUN                             MODE LAUNCHER STATE      STEP REWARD ELAPSED\n"
        "long-tail-20260101-000001-bbbb  sync local    failed     0/40      -    1:05\n"
        "quickstart-20260101-000000-aaaa sync local    completed 2/100  0.700    1:05\n"
    )


@pytest.mark.process
def test_json_and_logs(tmp_path):
    rd = fake_run(tmp_path, "quickstart-20260101-000000-aaaa", "completed", 100, [0.2, 0.7])
    res = rlctl("status", "--json", "--runs-dir", str(tmp_path), cwd=tmp_path)
    (row,) = json.loads(res.stdout)
    assert row["id"] == rd.id and row["step"] == 2 and row["reward"] == 0.7
    # A name finds the newest run of that name.
    res = rlctl("logs", "quickstart", "--runs-dir", str(tmp_path), cwd=tmp_path)
    assert res.returncode == 0 and res.stdout == "hello from the controller\n"
    res = rlctl("logs", "quickstart", "trainer-9", "--runs-dir", str(tmp_path), cwd=tmp_path)
    assert res.returncode == 2 and "logs: controller" in res.stderr


def test_tails_read_only_the_end_of_a_file(tmp_path):
    log = tmp_path / "x.log"
    log.write_text("x" * 1_000_000 + "\nfirst words\nlast words " + "y" * 400 + "\n\n  \n")
    assert last_log_line(log) == ("last words " + "y" * 400)[:300]
    assert last_log_line(tmp_path / "missing.log") is None and last_jsonl_record(tmp_path / "missing.jsonl") is None
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": i, "pad": "z" * 100}) + "\n" for i in range(5000)) + '{"step": 50')
    assert last_jsonl_record(metrics)["step"] == 4999  # the line being written is skipped
    assert tail_lines(metrics, 14) == ['"}', '{"step": 50']  # the first line of the window may be cut
    assert [r["step"] for r in last_jsonl_records(metrics, 3)] == [4997, 4998, 4999]
    # 500 bytes hold three whole records of about 125 bytes and a cut one: fewer than asked for.
    assert [r["step"] for r in last_jsonl_records(metrics, 9, max_bytes=500)] == [4997, 4998, 4999]


def test_detail_shows_events_whatever_clock_wrote_them(tmp_path):
    rd = fake_run(tmp_path, "quickstart-20260101-000000-aaaa", "completed", 100, [])
    rd.events_path.write_text("".join(json.dumps(e) + "\n" for e in (
        {"t": 12.5, "event": "server_up", "role": "rollout-0"},
        {"t": 1790000000.25, "event": "run_end", "state": "completed", "host": "node1"},
        {"event": "submitted", "job_id": "7"},
    )))
    console = Console(width=200, record=True, color_system=None)
    console.print(render_detail(detail(rd)))
    text = console.export_text()
    from datetime import datetime

    rows = [line.split() for line in text.splitlines()]
    assert ["12.500", "server_up", "role=rollout-0"] in rows  # not a Unix time: shown as written
    clock = datetime.fromtimestamp(1790000000.25).strftime("%H:%M:%S.250")  # a Unix time: its time of day
    assert [clock, "run_end", "state=completed", "host=node1"] in rows
    assert ["None", "submitted", "job_id=7"] in rows
    assert "{" not in text.split("last events")[1]  # no Python dicts


def test_a_colocated_run_says_so_and_what_its_turns_cost(tmp_path):
    rd = fake_run(tmp_path, "colo-20260101-000000-cccc", "completed", 10, [])
    info = json.loads(rd.run_json.read_text()) | {"colocated": True}
    rd.run_json.write_text(json.dumps(info))
    last = {"step": 4, "reward_mean": 0.5, "step_time": 9.0, "rollout_time": 5.0, "train_time": 3.0, "sync_time": 0.2,
            "trainer_wait_ratio": 0.4, "turn_time": 1.25}
    rd.metrics_path.write_text(json.dumps(last) + "\n")
    console = Console(width=200, record=True, color_system=None)
    console.print(render_detail(detail(rd)))
    text = console.export_text()
    assert "sync / local, colocated" in text
    assert "took turns for 1.25 s of the step" in text
    assert render_table([summary(rd)]).plain.splitlines()[1].split()[1:3] == ["sync", "colocated"]
    plain = fake_run(tmp_path, "plain-20260101-000000-dddd", "completed", 10, [0.1])
    assert summary(plain)["colocated"] is False and "colocated" not in render_table([summary(plain)]).plain


def test_status_says_where_it_looked_when_there_are_no_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    res = rlctl_here("status", cwd=tmp_path)
    assert res.returncode == 0 and f"no runs in {tmp_path / 'runs'}" in res.stdout and "--runs-dir" in res.stdout


def test_the_listing_piped_is_the_table_and_json_a_run_per_line(tmp_path):
    """Piped, the rows go out whole as the table renders them; --json is a list with a run per
    line (the same data as before, in a layout json writes fast at thousands of runs)."""
    from rlctl.launchers.status import summaries

    fake_run(tmp_path, "quickstart-20260101-000000-aaaa", "completed", 100, [0.2, 0.7])
    fake_run(tmp_path, "long-tail-20260101-000001-bbbb", "failed", 40, [])
    res = rlctl_here("status", "--runs-dir", str(tmp_path), cwd=tmp_path)
    assert res.returncode == 0 and res.stdout == render_table(summaries(tmp_path)).plain + "\n"
    out = rlctl_here("status", "--json", "--runs-dir", str(tmp_path), cwd=tmp_path).stdout
    assert json.loads(out) == json.loads(json.dumps(summaries(tmp_path), default=str))
    assert [json.loads(line.rstrip(","))["id"] for line in out.splitlines()[1:-1]] == [
        "long-tail-20260101-000001-bbbb", "quickstart-20260101-000000-aaaa"]


def test_a_row_finds_the_last_metrics_record_behind_long_lines(tmp_path):
    """A row reads the end of metrics.jsonl only; a last record longer than that window is still found."""
    rd = fake_run(tmp_path, "big-20260101-000000-aaaa", "running", 10, [])
    rd.metrics_path.write_text("".join(json.dumps({"step": i, "reward_mean": i / 10, "pad": "x" * 20_000}) + "\n"
                                       for i in range(3)))
    row = summary(rd)
    assert (row["step"], row["reward"]) == (3, 0.2) and "problems" not in row


def test_status_lists_the_sweeps_under_the_runs(tmp_path, monkeypatch):
    """A sweep's record is hidden in .sweeps/ (never taken for a run); `rlctl status` lists each
    sweep after the runs, with how many of its runs are in each state."""
    from rlctl.run.sweep import Sweep

    monkeypatch.setenv("COLUMNS", "300")
    sw = Sweep.create(tmp_path, "quickstart", QUICKSTART, [("train.lr", ["1e-4", "3e-4"]), ("run.seed", ["0", "1"])],
                      [], "local")
    alone = rlctl_here("status", "--runs-dir", str(tmp_path), cwd=tmp_path).stdout
    assert "no runs in" in alone and f"  {sw.id}  4 runs of {QUICKSTART} over train.lr, run.seed (4 not started)" in alone
    done = fake_run(tmp_path, "quickstart-20260101-000000-aaaa", "completed", 3, [0.5])
    sw.set_run(0, done.id)
    sw.set_run(1, "quickstart-20260101-000001-gone")
    fake_run(tmp_path, "other-20260101-000002-bbbb", "failed", 3, [])
    lines = rlctl_here("status", "--runs-dir", str(tmp_path), cwd=tmp_path).stdout.splitlines()
    assert [line.split()[0] for line in lines[1:3]] == ["other-20260101-000002-bbbb", done.id]
    assert lines[3:] == ["sweeps (1; `rlctl status SWEEP` shows one):",
                         f"  {sw.id}  4 runs of {QUICKSTART} over train.lr, run.seed "
                         "(1 completed, 1 missing, 2 not started)"]
    sw.path.write_text("{not json")
    assert "unreadable: sweep " in rlctl_here("status", "--runs-dir", str(tmp_path), cwd=tmp_path).stdout


@pytest.mark.parametrize("command", ["status", "logs", "trace", "cancel"])
@pytest.mark.parametrize("path", ["/etc", "/", "/no/such/dir"])
def test_an_absolute_path_that_is_not_a_run_is_one_line_and_exit_2(tmp_path, command, path):
    fake_run(tmp_path, "quickstart-20260101-000000-aaaa", "completed", 3, [0.5])
    args = [command, path] + (["-o", str(tmp_path / "t.json")] if command == "trace" else [])
    res = rlctl_here(*args, "--runs-dir", str(tmp_path), cwd=tmp_path)
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stderr.strip().splitlines() == [f"error: {path} is not a run directory (no run.json in it); give a "
                                               "run's directory, id or name (`rlctl status` lists the runs)"]


@pytest.mark.parametrize("record,why", [
    (b"null", "it is not a JSON object"),
    (b"[" * 100_000, "nested too deep to be a sweep's record"),
    (b'{"id": "s", "recipe": "r.yaml", "grid": {}, "fixed": [], "points": [{"values": {}, "run": "../../etc"}]}',
     "point 0's run is not a run id"),
    (b'{"id": "s", "recipe": "r.yaml", "grid": {"x": [1, 2]}, "fixed": [], "points": [7]}', "point 0 has no values"),
    (b"\xff\xfe{}", "'utf-8' codec can't decode byte 0xff"),
], ids=["null", "100k-deep", "run-id-a-path", "point-not-an-object", "not-utf8"])
def test_a_damaged_sweep_record_is_listed_unreadable_and_the_runs_still_show(tmp_path, monkeypatch, record, why):
    monkeypatch.setenv("COLUMNS", "400")
    done = fake_run(tmp_path, "quickstart-20260101-000000-aaaa", "completed", 3, [0.5])
    (tmp_path / ".sweeps").mkdir()
    bad = tmp_path / ".sweeps" / "sweep-q-20260101-000000-0000aaaa.json"
    bad.write_bytes(record)
    listed = rlctl_here("status", "--runs-dir", str(tmp_path), cwd=tmp_path)
    assert listed.returncode == 0 and listed.stderr == "", listed.stderr[-2000:]
    lines = listed.stdout.splitlines()
    assert lines[1].split()[:4] == [done.id, "sync", "local", "completed"]
    assert lines[-1].startswith("  sweep-q-20260101-000000-0000aaaa  unreadable: sweep sweep-q-20260101-000000-0000aaaa: "
                                f"{bad} cannot be read ({why[:15]}"), lines[-1]  # cut to the listing's width
    named = rlctl_here("status", "sweep-q", "--runs-dir", str(tmp_path), cwd=tmp_path)
    (line,) = named.stderr.strip().splitlines()
    assert named.returncode == 1 and line.startswith(f"error: sweep sweep-q-20260101-000000-0000aaaa: {bad} cannot be "
                                                     f"read ({why}"), line
    compared = rlctl_here("compare", "sweep-q", "--runs-dir", str(tmp_path), cwd=tmp_path)
    assert compared.returncode == 1 and len(compared.stderr.strip().splitlines()) == 1, compared.stderr[-2000:]


@pytest.mark.e2e
def test_ctrl_c_in_launch_cancels_the_run(tmp_path):
    # Ctrl-C as a terminal delivers it, however pytest was started: a shell starts background
    # jobs with SIGINT ignored, their children inherit that, and Python then leaves it ignored.
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlctl", "launch", str(QUICKSTART), *FAST, "run.steps=1000",
         f"run.output_dir={tmp_path / 'runs'}"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        runs = list_runs(tmp_path / "runs")
        if runs and runs[0].metrics():
            break
        time.sleep(0.2)
    (rd,) = list_runs(tmp_path / "runs")
    os.kill(proc.pid, signal.SIGINT)
    try:  # the pipes are read meanwhile, so a full pipe cannot block the launch
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"launch still running 60 s after Ctrl-C; run state {rd.read()['state']}; stderr: {err[-1500:]}")
    assert proc.returncode == 130, err
    assert rd.read()["state"] == "cancelled"
    assert processes_mentioning(rd.id) == []


def test_one_unreadable_run_is_a_row_not_a_crash(tmp_path):
    from rlctl.launchers.status import summaries

    fake_run(tmp_path, "quickstart-20260101-000000-aaaa", "completed", 100, [0.2, 0.7])
    bad = fake_run(tmp_path, "broken-20260101-000001-bbbb", "completed", 100, [])
    bad.run_json.write_bytes(b'{"id": "broken", "state": ')  # cut off mid-write
    damaged = fake_run(tmp_path, "damaged-20260101-000002-cccc", "completed", 100, [0.5])
    with damaged.metrics_path.open("ab") as f:
        f.write(b"\xff\xfe not json\n")
    console = Console(width=80, record=True, color_system=None)
    console.print(render_table(summaries(tmp_path)), soft_wrap=True)
    assert console.export_text() == (
        "RUN                             MODE LAUNCHER STATE       STEP REWARD ELAPSED\n"
        "broken-20260101-000001-bbbb     -    -        unreadable     -      -       -  "
        "unreadable: run.json is not UTF-8 JSON (Expecting value: line 1 column 27 (char 26))\n"
        "damaged-20260101-000002-cccc    sync local    completed  1/100  0.500    1:05  "
        "damaged: metrics.jsonl: 1 line is not a JSON object\n"
        "quickstart-20260101-000000-aaaa sync local    completed  2/100  0.700    1:05\n"
    )
