"""End to end: `rlctl launch` runs real processes (rollout servers, trainer ranks, controller),
fills the run directory, and ends every process when one dies or the run is cancelled."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from conftest import FAST, QUICKSTART, descendants, processes_mentioning, rlctl, wait_for
from rlctl.metrics import chrome_trace
from rlctl.run.dir import RunDir
from test_metrics import assert_slices_nest

pytestmark = pytest.mark.e2e


def launch(tmp_path: Path, *overrides: str, detach: bool = False):
    args = ["launch", str(QUICKSTART), *FAST, f"run.output_dir={tmp_path / 'runs'}", *overrides]
    if detach:
        args.insert(1, "--detach")
    return rlctl(*args, cwd=tmp_path)


def only_run(tmp_path: Path) -> RunDir:
    (path,) = (tmp_path / "runs").iterdir()
    return RunDir(path)


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory) -> tuple[object, RunDir]:
    """One sync run of 4 steps, read by the tests that only look at what it left."""
    tmp = tmp_path_factory.mktemp("sync-run")
    res = launch(tmp, "run.steps=4")
    assert res.returncode == 0, res.stderr
    return res, only_run(tmp)


def test_run_completes_and_fills_the_run_directory(sync_run):
    res, rd = sync_run
    assert res.stdout.strip() == rd.id
    # piped, the launch says each phase and step on a line of its own, none wider than 80 columns
    said = res.stderr.splitlines()
    assert said[1] == f"  in {rd.path}" and all(len(line) <= 80 for line in said[:1] + said[2:]), said
    for words in ("servers starting", "step 4/4  reward", "completed", "optimizer steps"):
        assert any(words in line for line in said), (words, said)
    info = rd.read()
    assert info["state"] == "completed" and info["exit_reason"] == "all steps done" and info["ended"]
    roles = info["processes"]
    assert {"supervisor", "prepare", "rollout-0", "rollout-1", "trainer-0", "controller"} <= set(roles)
    assert roles["rollout-0"]["port"] != roles["rollout-1"]["port"]
    assert len({roles[r]["pid"] for r in roles}) == len(roles)  # every role its own process
    assert "steps: 4" in rd.recipe_path.read_text()  # resolved recipe with the override
    for role in ("rollout-0", "rollout-1", "trainer-0", "controller", "supervisor"):
        assert rd.log_path(role).is_file()

    events = rd.events()
    kinds = {e["event"] for e in events}
    assert {"server_up", "server_down", "run_start", "step_start", "group_admitted", "group_completed",
            "train_start", "train_end", "sync_start", "sync_end", "step_end", "run_end"} <= kinds
    ts = [e["t"] for e in events if e["event"] not in ("server_up", "server_down", "run_end")]
    assert ts == sorted(ts)  # the controller's events are in monotonic order
    assert sum(e["event"] == "group_completed" for e in events) == 4 * 8

    metrics = rd.metrics()
    assert [m["step"] for m in metrics] == [0, 1, 2, 3]
    for key in ("reward_mean", "response_len_mean", "step_time", "rollout_time", "train_time", "sync_time",
                "wait_time", "trainer_wait_ratio"):
        assert all(key in m for m in metrics), key
    assert all(m["train_batches"] == 2 and m["samples"] == 32 for m in metrics)
    assert processes_mentioning(rd.id) == []
    trace = chrome_trace(events)["traceEvents"]  # what `rlctl trace` writes: every track drawable as a stack
    assert_slices_nest(trace)
    assert sum(e["ph"] == "X" and e["pid"] == 1 for e in trace) == 4 * 8 * 4  # every sample's request


def test_a_completed_run_leaves_its_trained_policy_for_export(sync_run, tmp_path):
    """No run.save_every, yet the run's end is kept: RUN/final/ holds the policy after its last
    optimizer step, and `rlctl export` writes it out as a model transformers loads."""
    import torch
    from transformers import AutoModelForCausalLM

    res, rd = sync_run
    assert not list((rd.path / "checkpoints").glob("step-*"))
    assert json.loads((rd.path / "final" / "final.json").read_text()) == {"steps": 4, "version": 8}
    assert f"final policy: {rd.path / 'final' / 'hf'}" in res.stderr.replace("\n", "")
    out = tmp_path / "model"
    exported = rlctl("export", rd.id, str(out), "--runs-dir", str(rd.path.parent), cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr
    trained = AutoModelForCausalLM.from_pretrained(out).state_dict()
    initial = AutoModelForCausalLM.from_pretrained(rd.read()["model_path"]).state_dict()
    # The policy after the last optimizer step: every tensor moved, where any step had a gradient
    # (a run whose every sample scored the same, as a tiny model's 4 steps sometimes do, has none).
    changed = [k for k in trained if not torch.equal(trained[k], initial[k])]
    learned = any(m["grad_norm"] > 0 for m in rd.metrics())
    assert trained.keys() == initial.keys() and changed == (list(trained) if learned else []), (learned, changed)
    final_sync = [e for e in rd.events() if e["event"] == "final_saved"]
    assert [e["version"] for e in final_sync] == [8]


def test_rlctl_eval_evaluates_the_runs_final_policy_without_training(sync_run, tmp_path):
    """`rlctl eval RUN --set FILE`: a run of no steps on the run's own recipe and final policy,
    which evaluates the set once and leaves eval.jsonl; a model directory needs a recipe."""
    _, rd = sync_run
    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text("".join(json.dumps({"prompt": f"max({i},3,5)=", "answer": str(max(i, 5))}) + "\n"
                               for i in range(10)))
    runs = tmp_path / "runs"
    res = rlctl("eval", str(rd.path), "--set", str(heldout), "-k", "2", "--runs-dir", str(runs), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "eval heldout (10 prompts x 2): mean@2 " in res.stderr
    (path,) = runs.iterdir()
    ev = RunDir(path)
    assert path.name.startswith("eval-quickstart-") and ev.read()["model_path"] == str(rd.path / "final" / "hf")
    assert ev.metrics() == [] and not (path / "final").exists()
    (record,) = ev.evals()
    assert (record["set"], record["steps"], record["versions"], record["prompts"], record["k"]) == \
        ("heldout", 0, [0], 10, 2)
    no_recipe = rlctl("eval", str(rd.path / "final" / "hf"), "--set", str(heldout), cwd=tmp_path)
    assert no_recipe.returncode == 2 and "give --recipe RECIPE" in no_recipe.stderr and no_recipe.stderr.count("\n") == 1


def test_sync_invariant_every_trained_sample_has_the_step_version(sync_run):
    events = sync_run[1].events()
    starts = {e["step"]: e["version"] for e in events if e["event"] == "step_start"}
    # Two train batches per step: the servers serve version 2k during step k.
    assert starts == {k: 2 * k for k in range(4)}
    for e in events:
        if e["event"] == "group_completed":
            assert set(e["versions"]) == {starts[e["step"]]}
        if e["event"] == "train_start":
            assert e["versions"] == [starts[e["step"]]]
    trained = [g for e in events if e["event"] == "train_start" for g in e["groups"]]
    completed = [e["group"] for e in events if e["event"] == "group_completed"]
    assert sorted(trained) == sorted(completed) and len(set(trained)) == len(trained)  # each once


def test_two_trainer_ranks_and_checked_weights_handed_over_in_place(tmp_path):
    # check_weights: after every sync each server's tensors must hash like the trainer's. In
    # rolloutpipe the batches arrive in pieces, which rank 1 must follow (accumulate, then train).
    # sync_backend=ipc: the servers open the trainer's buckets in shared memory (CUDA IPC on a GPU).
    res = launch(tmp_path, "train.ranks=2", "pipeline.check_weights=true", "pipeline.mode=rolloutpipe",
                 "pipeline.admission=frontier", "rollout.concurrency=4", "train.sync_backend=ipc")
    assert res.returncode == 0, res.stderr
    events = only_run(tmp_path).events()
    checked = [e for e in events if e["event"] == "weights_checked"]
    assert len(checked) == 1 + 3 and all(e["servers"] == 2 and e["tensors"] > 10 for e in checked)  # + the initial sync
    assert any(e["event"] == "accumulate_end" for e in events)
    info = only_run(tmp_path).read()
    assert {"trainer-0", "trainer-1"} <= set(info["processes"])
    assert "trainer rank 1/2 ready" in (only_run(tmp_path).log_path("trainer-1").read_text())
    assert "weight sync to 2 server(s) by ipc" in only_run(tmp_path).log_path("trainer-0").read_text()


def test_a_run_whose_servers_answer_as_sglang(tmp_path):
    """Built-in servers emulating SGLang 0.5.23 with TP 2: their generations are stamped
    "default" until the run's weights reach them, pause replies carry no `success`, updates
    outside a session are refused; the run sends version 0 before step 0 and checks every TP
    rank of every server after every sync."""
    res = launch(tmp_path, "rollout.builtin.emulate_sglang=0.5.23", "rollout.builtin.tp_size=2",
                 "pipeline.check_weights=true", "pipeline.mode=async")
    assert res.returncode == 0, res.stderr
    rd = only_run(tmp_path)
    events = rd.events()
    kinds = [e["event"] for e in events]
    assert kinds.index("initial_sync") < kinds.index("step_start")
    assert [e["version"] for e in events if e["event"] == "weights_checked"][0] == 0
    assert all(isinstance(v, int) for e in events if e["event"] == "group_completed" for v in e["versions"])
    assert "as ranks 1..2 of 5" in rd.log_path("rollout-0").read_text()
    assert "as ranks 3..4 of 5" in rd.log_path("rollout-1").read_text()


@pytest.mark.parametrize("victim", ["trainer-0", "controller"])  # a rollout server fails over: test_failover.py
def test_sigkill_of_one_process_ends_the_run(tmp_path, victim):
    res = launch(tmp_path, "run.steps=1000", detach=True)
    assert res.returncode == 0, res.stderr
    rd = only_run(tmp_path)
    wait_for(lambda: rd.metrics(), 180, "first step")
    pid = rd.read()["processes"][victim]["pid"]
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    wait_for(lambda: not processes_mentioning(rd.id), 10, "every process of the run to exit")
    assert time.monotonic() - killed < 10
    status = json.loads(rlctl("status", rd.id, "--runs-dir", str(tmp_path / "runs"), "--json", cwd=tmp_path).stdout)
    assert status["state"] == "failed"
    assert victim in status["exit_reason"] and "SIGKILL" in status["exit_reason"]


def test_cancel_and_status_of_a_crashed_supervisor(tmp_path):
    runs = str(tmp_path / "runs")
    assert launch(tmp_path, "run.steps=1000", detach=True).returncode == 0
    rd = only_run(tmp_path)
    wait_for(lambda: rd.read()["state"] == "running", 180, "running")
    res = rlctl("cancel", rd.id, "--runs-dir", runs, cwd=tmp_path)
    assert res.returncode == 0 and "cancelled" in res.stdout
    assert processes_mentioning(rd.id) == []
    assert rd.read()["state"] == "cancelled"

    # A supervisor killed outright: its children go with it, and status says failed.
    assert launch(tmp_path, "run.steps=1000", "run.name=crash", detach=True).returncode == 0
    crash = next(RunDir(p) for p in (tmp_path / "runs").iterdir() if p.name.startswith("crash"))
    wait_for(lambda: crash.read()["state"] == "running", 180, "running")
    wait_for(lambda: any(e["event"] == "run_start" for e in crash.events()), 180, "the controller to start")
    tree = descendants({crash.read()["processes"]["supervisor"]["pid"]})
    controller = crash.read()["processes"]["controller"]["pid"]
    assert descendants({controller}) - {controller}, "the controller's scoring workers"
    os.kill(crash.read()["processes"]["supervisor"]["pid"], signal.SIGKILL)
    wait_for(lambda: not processes_mentioning(crash.id), 10, "orphans to exit")
    # Its grandchildren too: the scoring workers and their resource tracker, which name no run.
    wait_for(lambda: not [p for p in tree if Path(f"/proc/{p}").exists()], 30, "the scoring workers to exit")
    status = json.loads(rlctl("status", "--runs-dir", runs, "--json", cwd=tmp_path).stdout)
    by_id = {r["id"]: r for r in status}
    assert by_id[crash.id]["state"] == "failed"
    assert "supervisor.log" in by_id[crash.id]["exit_reason"]
    assert crash.read()["state"] == "failed"  # status wrote what it found into run.json
    assert by_id[rd.id]["state"] == "cancelled"


def test_unknown_run_is_a_usage_error(tmp_path):
    res = rlctl("status", "no-such-run", "--runs-dir", str(tmp_path), cwd=tmp_path)
    assert res.returncode == 2 and res.stderr.startswith("error: no run 'no-such-run'")
