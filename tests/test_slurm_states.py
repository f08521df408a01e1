"""Reading Slurm's state without a cluster: job states in words, a run whose job ended or that
Slurm forgot, and squeue's and sacct's rows read by column name whatever the user's settings
(rlctl/launchers/slurm/client.py, reconcile.py)."""

from __future__ import annotations

import subprocess

import pytest

from rlctl.launchers.slurm import JobInfo


def test_job_states_in_words():
    assert JobInfo("7", "PENDING", "Resources").describe() == "PENDING: waiting for nodes to free up"
    assert JobInfo("7", "PENDING", "QOSMaxGRESPerUser").describe() == "PENDING: you are at your QOS's GPU limit"
    running = JobInfo("7", "RUNNING", "None", "1:02", ["node1", "node[2-3]"])
    assert running.describe() == "RUNNING on node1 | node[2-3] for 1:02"
    assert JobInfo("7", "TIMEOUT", exit_code="0:15").describe() == "TIMEOUT (exit code 0:15)"


def _slurm_run(tmp_path, state: str, last_state: str | None):
    from rlctl.run.dir import create_run_dir

    rd = create_run_dir(tmp_path, "r", "run: {}\n", {"launcher": "slurm", "mode": "sync", "steps_total": 3, "plan": None})
    last = None if last_state is None else JobInfo("7", last_state, "None", "0:05", ["node1", "node2"]).to_json()
    rd.update(lambda d: d.update(state=state, slurm={"job_id": "7", "last": last}))
    return rd


@pytest.mark.parametrize("slurm_state, run_state", [("TIMEOUT", "failed"), ("FAILED", "failed"), ("NODE_FAIL", "failed"),
                                                    ("CANCELLED", "cancelled")])
def test_a_job_that_ended_under_a_running_run_ends_the_run(tmp_path, slurm_state, run_state):
    from rlctl.launchers.slurm import needs_query, reconcile

    rd = _slurm_run(tmp_path, "running", "RUNNING")
    info = reconcile(rd, rd.read(), JobInfo("7", slurm_state, exit_code="0:15"), queried=True)
    assert info["state"] == run_state and f"Slurm job 7 ended {slurm_state}" in info["exit_reason"]
    assert info["slurm"]["last"]["state"] == slurm_state and not needs_query(info)


def test_a_finished_run_whose_job_slurm_forgot_is_not_asked_about_again(tmp_path):
    from rlctl.launchers.slurm import needs_query, reconcile

    rd = _slurm_run(tmp_path, "completed", "RUNNING")
    assert needs_query(rd.read())
    info = reconcile(rd, rd.read(), None, queried=True)
    assert info["state"] == "completed" and info["slurm"]["last"]["state"] == "ENDED" and not needs_query(info)
    running = _slurm_run(tmp_path, "running", "RUNNING")  # still going, and Slurm does not know it: failed
    info = reconcile(running, running.read(), None, queried=True)
    assert info["state"] == "failed" and "no longer known to Slurm" in info["exit_reason"]


# Slurm's state by column name: squeue -O and sacct --parsable2 as Slurm 22.05 prints them.

def test_squeue_rows_are_read_by_column_name_and_a_het_job_is_one_job():
    from rlctl.launchers.slurm.client import SQUEUE_FIELDS, parse_squeue

    assert SQUEUE_FIELDS.endswith("Reason:0") and "Name" not in SQUEUE_FIELDS  # the free text last, no job name
    text = ("JOBID|HET_JOB_ID|HET_JOB_OFFSET|STATE|TIME|NODELIST|REASON\n"
            "12|11|1|PENDING|0:00||held | by admin, see ticket 7\n"  # component 1 listed first
            "11|11|0|PENDING|0:00||Priority\n"
            "13|N/A|N/A|RUNNING|1:02:03|node3|None\n")
    jobs = parse_squeue(text)
    assert set(jobs) == {"11", "13"}
    het = jobs["11"]
    assert (het.state, het.elapsed, het.nodes) == ("PENDING", "0:00", ["", ""])
    assert het.reason == "held | by admin, see ticket 7"  # a `|` in the last column shifts nothing
    assert jobs["13"] == JobInfo("13", "RUNNING", "None", "1:02:03", ["node3"], states=["RUNNING"])
    running = parse_squeue("JOBID|HET_JOB_ID|HET_JOB_OFFSET|STATE|TIME|NODELIST|REASON\n"
                           "22|21|1|RUNNING|0:07|node[2-3]|None\n21|21|0|RUNNING|0:07|node1|None\n")
    assert running["21"].nodes == ["node1", "node[2-3]"]  # in component order
    assert parse_squeue("") == {} and parse_squeue("JOBID|HET_JOB_ID|HET_JOB_OFFSET|STATE|TIME|NODELIST|REASON\n") == {}


def test_a_het_job_has_ended_only_when_every_component_has():
    """scancel ends component 0 first; the rollout component may still be COMPLETING, its
    processes being killed. `rlctl cancel` waits for that (client.cancel: until not active)."""
    from rlctl.launchers.slurm.client import parse_squeue

    header = "JOBID|HET_JOB_ID|HET_JOB_OFFSET|STATE|TIME|NODELIST|REASON\n"
    ending = parse_squeue(header + "31|31|0|CANCELLED|0:40|node1|None\n32|31|1|COMPLETING|0:40|node[2-3]|None\n")["31"]
    assert ending.state == "CANCELLED" and ending.active
    assert ending.describe() == "CANCELLED, its other components COMPLETING"
    ended = parse_squeue(header + "31|31|0|CANCELLED|0:40|node1|None\n32|31|1|CANCELLED|0:40|node[2-3]|None\n")["31"]
    assert not ended.active and ended.describe() == "CANCELLED"
    assert JobInfo("7", "COMPLETED").active is False and JobInfo("7", "RUNNING").active  # as run.json kept them


def test_a_column_squeue_did_not_print_is_a_one_line_error():
    from rlctl.errors import RunError
    from rlctl.launchers.slurm.client import parse_squeue

    with pytest.raises(RunError, match=r"^squeue printed no TIME column .*squeue --version"):
        parse_squeue("JOBID|HET_JOB_ID|HET_JOB_OFFSET|STATE||NODELIST|REASON\n5|N/A|N/A|RUNNING||node1|None\n")


def test_sacct_rows_are_read_by_column_name():
    from rlctl.launchers.slurm.client import parse_sacct

    text = ("JobID|State|Elapsed|NodeList|ExitCode|Reason\n"
            "31+0|CANCELLED by 0|00:01:10|node1|0:15|None\n"
            "31+1|CANCELLED by 0|00:01:10|node[2-3]|0:15|a|b\n"
            "40|FAILED|00:00:03|node2|1:0|None\n")
    jobs = parse_sacct(text)
    assert jobs["31"] == JobInfo("31", "CANCELLED", "None", "00:01:10", ["node1", "node[2-3]"], "0:15",
                           ["CANCELLED", "CANCELLED"])
    assert jobs["40"].describe() == "FAILED (exit code 1:0)"


def test_exit_code_is_read_after_the_free_text_job_name():
    from rlctl.launchers.slurm.client import parse_exit_code

    line = ("JobId=9 HetJobId=9 HetJobOffset=0 JobName=a|b ExitCode=7:7 JobState=X UserId=root(0) "
            "JobState=FAILED Reason=NonZeroExitCode Dependency=(null) Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 "
            "ExitCode=1:0 RunTime=00:00:03 StdOut=/runs/x ExitCode=3:3\n"
            "JobId=10 HetJobId=9 HetJobOffset=1 JobName=a|b JobState=FAILED ExitCode=0:9 RunTime=00:00:03\n")
    assert parse_exit_code(line) == "1:0"
    assert parse_exit_code("") == "" and parse_exit_code("JobId=9 JobState=RUNNING Reason=None") == ""


def test_the_users_squeue_and_sacct_settings_are_ignored(monkeypatch):
    from rlctl.launchers.slurm import client

    seen = {}

    def fake_run(cmd, **kw):
        seen.update(kw["env"])
        return subprocess.CompletedProcess(cmd, 0, "", "")

    for name in ("SQUEUE_FORMAT", "SQUEUE_FORMAT2", "SQUEUE_PARTITION", "SQUEUE_USERS", "SACCT_FORMAT",
                 "SLURM_TIME_FORMAT"):
        monkeypatch.setenv(name, "x")
    monkeypatch.setenv("SLURM_CONF", "/etc/slurm/slurm.conf")
    monkeypatch.setattr(client.subprocess, "run", fake_run)
    client.query(["5"])
    assert not [k for k in seen if k.startswith(("SQUEUE_", "SACCT_", "SLURM_TIME"))]
    assert seen["SLURM_CONF"] == "/etc/slurm/slurm.conf"


