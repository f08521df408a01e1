"""slurm.requeue without a cluster: the batch script's lines, the recipe's checks, and the job
step that decides whether a job requeues itself (rlctl/launchers/slurm/steps.py), on real run
directories. The whole cycle on the test cluster is test_slurm_cluster.py's
test_a_preempted_job_checkpoints_requeues_and_resumes_until_the_run_completes."""

from __future__ import annotations

import pytest

from conftest import QUICKSTART, rlctl_here
from test_slurm_render import render


def test_without_requeue_the_job_ends_at_its_time_limit(tmp_path):
    text = render("quickstart-1x1", "slurm.requeue=false")
    assert "#SBATCH --no-requeue" in text and "USR1" not in text and "requeue_run" not in text
    assert '"$PY" -m rlctl.worker controller --run-dir "$RUN_DIR" >"$RLCTL_LOGS/controller.log" 2>&1 &' in text


@pytest.mark.parametrize("override, time, said", [
    ("slurm.signal_before_s=120", "2", "is not before the time limit (slurm.time=2, 120 s)"),
    ("slurm.signal_before_s=3600", "01:00:00", "is not before the time limit"),
    ("slurm.signal_before_s=0", "10", "slurm.signal_before_s"),
    ("slurm.signal_before_s=70000", "3-00:00:00", "Slurm's --signal limit"),
    ("slurm.max_requeues=-1", "10", "slurm.max_requeues"),
])
def test_a_warning_that_cannot_come_before_the_limit_is_refused(tmp_path, override, time, said):
    res = rlctl_here("launch", str(QUICKSTART), "launcher=slurm", f"slurm.time={time}", override,
                f"run.output_dir={tmp_path}", "--dry-run", cwd=tmp_path)
    assert res.returncode == 2 and said in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    ok = rlctl_here("launch", str(QUICKSTART), "launcher=slurm", f"slurm.time={time}", override, "slurm.requeue=false",
               f"run.output_dir={tmp_path}", "--dry-run", cwd=tmp_path)
    assert (ok.returncode == 0) == ("before the time limit" in said), ok.stderr


def slurm_run(tmp_path, *overrides: str):
    from rlctl.recipe import load_recipe, recipe_to_yaml
    from rlctl.run.dir import create_run_dir

    r = load_recipe(QUICKSTART, ["launcher=slurm", *overrides], check_paths=False)
    rd = create_run_dir(tmp_path, r.run.name, recipe_to_yaml(r), {"launcher": "slurm", "mode": "sync", "steps_total": 100,
                                                                  "plan": None})
    rd.update(lambda d: d.update(state="running", slurm={"job_id": "7", "restart_count": 0}))
    return rd


def checkpoint_at(rd, steps: int) -> None:
    """A checkpoint as list_checkpoints sees one (the controller's file is written last) and as
    a resume accepts it (with its manifest)."""
    from rlctl.run.manifest import write_manifest

    d = rd.path / "checkpoints" / f"step-{steps:06d}"
    d.mkdir(parents=True)
    (d / "controller.json").write_text(f'{{"steps": {steps}, "t": 0.0, "version": {4 * steps}}}\n')
    write_manifest(d)


def test_a_job_requeues_itself_only_after_progress_and_at_most_max_requeues_times(tmp_path, monkeypatch):
    from rlctl.launchers.slurm.steps import requeue, start_attempt

    assert start_attempt(rd := slurm_run(tmp_path, "slurm.max_requeues=2")) == 1
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    checkpoint_at(rd, 5)
    assert requeue(rd) == 0
    info = rd.read()
    assert info["state"] == "starting" and info["attempt_end"]["state"] == "requeued"
    assert [e["checkpoint_steps"] for e in rd.events() if e["event"] == "requeue"] == [5]

    # The requeued job's first step: attempt 2, from the checkpoint; attempt 1 recorded as requeued.
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert start_attempt(rd) == 2
    info = rd.read()
    assert info["resume"]["steps"] == 5 and "attempt_end" not in info
    assert [(a["attempt"], a.get("state"), a.get("slurm", {}).get("job_id")) for a in info["attempts"]] == [
        (1, "requeued", "7"), (2, None, None)]

    # No checkpoint beyond step 5 in this attempt: no requeue (it would loop), the run fails saying why.
    assert requeue(rd) == 1
    info = rd.read()
    assert info["state"] == "failed" and "beyond step 5" in info["exit_reason"] and "rlctl resume" in info["exit_reason"]


def test_max_requeues_and_an_attempt_without_any_checkpoint_end_the_run(tmp_path, monkeypatch):
    from rlctl.launchers.slurm.steps import requeue

    rd = slurm_run(tmp_path / "a", "slurm.max_requeues=2")
    checkpoint_at(rd, 3)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    assert requeue(rd) == 1
    assert "slurm.max_requeues=2" in rd.read()["exit_reason"]

    rd = slurm_run(tmp_path / "b")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    assert requeue(rd) == 1
    reason = rd.read()["exit_reason"]
    assert "beyond step 0" in reason and "slurm.signal_before_s (now 300 s)" in reason and "rlctl resume" not in reason


def test_status_shows_an_attempt_that_ended_before_the_next_one_began(tmp_path, monkeypatch):
    """`rlctl resume` of a Slurm run records how the attempt ended; until the new job's first step
    folds that into run.json's attempts, status shows the ended attempt and the waiting one."""
    from rlctl.launchers.status import attempts

    rd = slurm_run(tmp_path)
    rd.update(lambda d: d.update(state="starting", slurm={"job_id": "9"},
                                 attempt_end={"state": "cancelled", "at": "2026-12-01T20:05:00+00:00", "reason": "scancel",
                                              "slurm": {"job_id": "7", "restart_count": 0}}))
    rows = attempts(rd.read())
    assert [(a["attempt"], a["state"], a["slurm_job"], a["exit_reason"]) for a in rows] == [
        (1, "cancelled", "7", "scancel"), (2, "starting", "9", None)]
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    from rlctl.launchers.slurm.steps import start_attempt

    rd.update(lambda d: d["slurm"].update(attempts_started=1))
    assert start_attempt(rd) == 2  # the new job's first step: the same two attempts, now in run.json
    rows = attempts(rd.read())
    assert [(a["attempt"], a["state"], a["slurm_job"]) for a in rows] == [(1, "cancelled", "7"), (2, "starting", "9")]
