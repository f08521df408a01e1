"""The event log's clock and writer: one time base for every writer, whole lines, flushed in time."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import pytest

from rlctl.metrics import Recorder
from rlctl.run.dir import HOST, EventLog, RunClock, RunDir, read_jsonl


def test_run_clock_is_wall_time_that_never_goes_back():
    clock = RunClock()
    readings = [clock.now() for _ in range(1000)]
    assert readings == sorted(readings)
    assert abs(readings[0] - time.time()) < 1.0


def test_every_writer_names_its_host_on_the_wall_clock(tmp_path):
    rd = RunDir(tmp_path)
    rd.event("server_up", role="rollout-0")
    (e,) = rd.events()
    assert e["host"] == HOST and e["role"] == "rollout-0" and abs(e["t"] - time.time()) < 5.0


def test_event_log_writes_whole_lines_at_flush(tmp_path):
    path = tmp_path / "events.jsonl"
    log = EventLog(path, max_delay_s=3600)
    log.write({"t": 1.0, "event": "a"})
    log.write({"t": 2.0, "event": "b"})
    assert read_jsonl(path) == []
    RunDir(tmp_path).event("server_down", role="rollout-1")  # another writer, between our batches
    log.flush()
    assert [e["event"] for e in read_jsonl(path)] == ["server_down", "a", "b"]


def test_event_log_flushes_when_full_or_old(tmp_path):
    path = tmp_path / "events.jsonl"
    full = EventLog(path, max_bytes=100, max_delay_s=3600)
    for i in range(5):
        full.write({"t": float(i), "event": "group_admitted", "group": i})
    assert 0 < len(read_jsonl(path)) < 5
    path.unlink()
    old = EventLog(path, max_delay_s=0.0)
    old.write({"t": 0.0, "event": "group_admitted", "group": 0})
    assert len(read_jsonl(path)) == 1


def test_recorder_flushes_events_before_the_step_record(tmp_path):
    """What `rlctl status` sees at a step's end: all of its events, then its metrics line."""
    rd = RunDir(tmp_path)
    seen: list[int] = []

    def on_record(record: dict) -> None:
        seen.append(len(rd.events()))
        rd.append_metrics(record)

    recorder = Recorder(EventLog(rd.events_path, max_delay_s=3600), on_record, wall_clock=lambda: 123.0)
    recorder.emit("step_start", 0.0, step=0, version=0)
    recorder.emit("group_admitted", 0.0, step=0, group=0)
    assert rd.events() == []
    recorder.emit("step_end", 1.0, step=0, version=0)
    assert seen == [3] and rd.metrics()[0]["time"] == 123.0 and recorder.recorded == 1
    recorder.emit("group_dropped", 1.5, step=0, group=0, reason="unused")
    recorder.close(completed=True)
    assert len(rd.events()) == 4


@pytest.mark.process
def test_controller_flushes_buffered_events_on_sigterm(tmp_path):
    """The supervisor ends the controller with SIGTERM: its buffered events reach the disk, and it
    still dies of the signal."""
    script = (
        "import asyncio, os, signal, sys\n"
        "from pathlib import Path\n"
        "from rlctl.control.controller import _flush_on_sigterm\n"
        "from rlctl.run.dir import EventLog\n"
        "async def main():\n"
        "    log = EventLog(Path(sys.argv[1]), max_delay_s=3600)\n"
        "    _flush_on_sigterm(log)\n"
        "    log.write({'t': 1.0, 'event': 'step_start', 'step': 0})\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    await asyncio.sleep(30)\n"
        "asyncio.run(main())\n"
    )
    path = tmp_path / "events.jsonl"
    res = subprocess.run([sys.executable, "-c", script, str(path)], timeout=60)
    assert res.returncode == -signal.SIGTERM
    assert read_jsonl(path) == [{"t": 1.0, "event": "step_start", "step": 0}]
