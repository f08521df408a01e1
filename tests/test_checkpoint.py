"""Checkpoints and resume (rlctl/run/checkpoint.py): real runs write complete HF checkpoints and keep
the newest; a run whose trainer is killed resumes from its last checkpoint and completes with
every step once; `rlctl export` copies a checkpoint's policy; the errors are one line each. The
scheduler's part (prompt cursor, async groups in flight) is checked in-process, in virtual time."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FAST, QUICKSTART, REPO, processes_mentioning, rlctl, wait_for
from rlctl.run.checkpoint import list_checkpoints
from rlctl.run.manifest import check_manifest
from rlctl.data import prompt_stream
from rlctl.recipe import DataConfig, load_recipe
from rlctl.run.dir import RunDir, RunState, create_run_dir

SAVE = ["run.save_every=2", "run.keep_checkpoints=2"]
# The quickstart's model (right about 1 time in 4) with FAST's small batches: rewards well above
# 0, so that a resume onto broken weights or optimizer state would show in the reward.
QUICK_MODEL = [o for o in FAST if not o.startswith("model.")]


def launch_args(runs: Path, *overrides: str) -> list[str]:
    return ["launch", str(QUICKSTART), *QUICK_MODEL, f"run.output_dir={runs}", *overrides]


def the_run(runs: Path, name: str = "quickstart") -> RunDir:
    (path,) = [p for p in runs.iterdir() if p.name.startswith(name)]
    return RunDir(path)


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> RunDir:
    """5 steps, a checkpoint every 2 and after the last, the newest 2 kept: step-4 and step-5."""
    tmp = tmp_path_factory.mktemp("saved")
    res = rlctl(*launch_args(tmp / "runs", "run.steps=5", *SAVE), cwd=tmp)
    assert res.returncode == 0, res.stderr
    return the_run(tmp / "runs")


@pytest.mark.e2e
def test_the_newest_checkpoints_are_kept_complete_and_load_with_transformers(saved_run):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpts = list_checkpoints(saved_run.path)
    assert [c.steps for c in ckpts] == [4, 5]
    assert sorted(p.name for p in (saved_run.path / "checkpoints").iterdir()) == ["step-000004", "step-000005"]
    saved = [e for e in saved_run.events() if e["event"] == "checkpoint"]
    assert [(e["steps"], e["removed"]) for e in saved] == [(2, []), (4, []), (5, [2])]
    for c in ckpts:
        for f in ("hf/config.json", "hf/model.safetensors", "hf/tokenizer.json", "trainer/optimizer.pt",
                  "trainer/rng-rank-0.json", "trainer/engine.json", "controller.json", "manifest.json"):
            assert (c.path / f).is_file(), f
        check_manifest(c.path)  # every file as the controller recorded it
        state = c.controller_state()
        # sync: 2 optimizer steps and 8 prompts per step, nothing in flight at a step's end
        assert (state["steps"], state["version"], state["prompts"]["position"]) == (c.steps, 2 * c.steps, 8 * c.steps)
        assert state["unfinished"] == [] and state["next_group"] == 8 * c.steps
        assert json.loads((c.path / "trainer/engine.json").read_text())["version"] == 2 * c.steps
        assert set(torch.load(c.path / "trainer/optimizer.pt", weights_only=True)["state"])  # AdamW moments
        model = AutoModelForCausalLM.from_pretrained(c.hf)
        ids = AutoTokenizer.from_pretrained(c.hf)("max(3,9,2)=", return_tensors="pt").input_ids
        logits = model(input_ids=ids).logits
        assert logits.shape[:2] == ids.shape and torch.isfinite(logits).all()
    a, b = (AutoModelForCausalLM.from_pretrained(c.hf).state_dict() for c in ckpts)
    assert any(not torch.equal(a[k], b[k]) for k in a)  # a step of training lies between them
    shown = json.loads(rlctl("status", saved_run.id, "--runs-dir", str(saved_run.path.parent), "--json",
                             cwd=saved_run.path).stdout)
    assert [(c["step"], c["bytes"] > 0) for c in shown["checkpoints"]] == [(4, True), (5, True)]


@pytest.mark.e2e
def test_export_copies_a_checkpoint_bit_for_bit(saved_run, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    runs = str(saved_run.path.parent)
    res = rlctl("export", saved_run.id, str(tmp_path / "policy"), "--step", "4", "--runs-dir", runs, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == str(tmp_path / "policy")
    mine = load_file(tmp_path / "policy" / "model.safetensors")
    theirs = load_file(saved_run.path / "checkpoints/step-000004/hf/model.safetensors")
    assert mine.keys() == theirs.keys() and all(mine[k].equal(theirs[k]) for k in mine)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "policy").state_dict()
    assert all(loaded[k].equal(v) for k, v in mine.items())
    newest = rlctl("export", saved_run.id, str(tmp_path / "newest"), "--runs-dir", runs, cwd=tmp_path)
    assert newest.returncode == 0 and "the checkpoint after 5 steps" in newest.stderr


def one_line_error(res: subprocess.CompletedProcess, code: int, *words: str) -> None:
    assert res.returncode == code, res.stderr
    assert res.stderr.startswith("error: ") and res.stderr.count("\n") == 1, res.stderr
    for w in words:
        assert w in res.stderr, (w, res.stderr)


def fake_run(runs: Path, state: RunState | None) -> RunDir:
    rd = create_run_dir(runs, "fake", "run: {}\n", {"launcher": "local", "mode": "sync", "steps_total": 3, "plan": None})
    if state is not None:
        rd.set_state(state, "for the test")
    return rd


@pytest.mark.e2e
def test_errors_are_one_line(saved_run, tmp_path):
    runs = tmp_path / "runs"
    failed = fake_run(runs, RunState.FAILED)
    one_line_error(rlctl("resume", failed.id, "--runs-dir", str(runs), cwd=tmp_path), 2, "no checkpoint",
                   "run.save_every")
    assert failed.read()["state"] == "failed" and "attempts" not in failed.read()  # nothing was touched

    running = fake_run(runs, None)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", running.id])
    try:
        running.record_process("supervisor", pid=sleeper.pid)
        one_line_error(rlctl("resume", running.id, "--runs-dir", str(runs), cwd=tmp_path), 2, "still starting",
                       "rlctl cancel")
    finally:
        sleeper.kill()
        sleeper.wait()

    done = str(saved_run.path.parent)
    one_line_error(rlctl("resume", saved_run.id, "--runs-dir", done, cwd=tmp_path), 2, "completed all its 5 steps")
    one_line_error(rlctl("export", saved_run.id, str(tmp_path / "x"), "--step", "3", "--runs-dir", done, cwd=tmp_path),
                   2, "no checkpoint at step 3", "4, 5")
    assert not (tmp_path / "x").exists()


@pytest.mark.e2e
def test_a_killed_run_resumes_from_its_checkpoint_and_completes(tmp_path):
    steps, runs = 12, tmp_path / "runs"
    launching = subprocess.Popen([sys.executable, "-m", "rlctl", *launch_args(runs, f"run.steps={steps}", *SAVE, "train.ranks=2")],
                                 cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    rd = wait_for(lambda: (runs.is_dir() and any(runs.iterdir())) and the_run(runs), 60, "the run directory")
    wait_for(lambda: [c for c in list_checkpoints(rd.path) if c.steps >= 4], 240, "the checkpoint after step 4")
    os.kill(rd.read()["processes"]["trainer-0"]["pid"], signal.SIGKILL)
    out, err = launching.communicate(timeout=60)
    assert launching.returncode == 1 and "trainer-0" in err and "SIGKILL" in err, err
    wait_for(lambda: not processes_mentioning(rd.id), 10, "every process of the run to exit")
    ckpt = list_checkpoints(rd.path)[-1]
    assert 0 < ckpt.steps < steps, "the run was killed too late to test a resume"
    assert {f.name for f in (ckpt.path / "trainer").iterdir()} == {  # rank 0 writes weights and optimizer
        "engine.json", "optimizer.pt", "rng-rank-0.json", "rng-rank-1.json"}

    res = rlctl("resume", rd.id, "--runs-dir", str(runs), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    info = rd.read()
    assert info["state"] == "completed" and [a["attempt"] for a in info["attempts"]] == [1, 2]
    assert info["attempts"][0]["state"] == "failed" and info["attempts"][1]["resumed_from"] == ckpt.steps
    assert [m["step"] for m in rd.metrics()] == list(range(steps))  # every step once, the last record of each
    events = rd.events()
    assert sorted(e["step"] for e in events if e["event"] == "step_start") == list(range(steps))
    (resumed,) = [e for e in events if e["event"] == "resume"]
    assert resumed["from_step"] == ckpt.steps and resumed["attempt"] == 2
    assert [e.get("resumed_from") for e in events if e["event"] == "run_start"] == [None, ckpt.steps]
    # The trainer and the servers continue from the checkpoint's weights: version 2k at step k.
    starts = {e["step"]: e["version"] for e in events if e["event"] == "step_start"}
    assert starts == {k: 2 * k for k in range(steps)}
    assert {v for e in events if e["event"] == "group_completed" and e["step"] == ckpt.steps
            for v in e["versions"]} == {2 * ckpt.steps}
    loaded = [e for e in events if e["event"] == "checkpoint_loaded"]
    assert [(e["steps"], e["version"], e["prompts"]) for e in loaded] == [(ckpt.steps, 2 * ckpt.steps, 8 * ckpt.steps)]
    # The reward curve goes on in the range it was in (loose: the run learns little in 12 steps;
    # weights or optimizer state restored wrong would send it to about 0). That the trainer holds
    # exactly the checkpoint's state is test_the_torch_engine_continues_exactly_from_its_checkpoint.
    got = [m["reward_mean"] for m in rd.metrics()]
    before, after = got[:ckpt.steps], got[ckpt.steps:]
    assert sum(after) / len(after) > 0.08 and abs(sum(after) / len(after) - sum(before) / len(before)) < 0.2, got


# -- the scheduler's part, in-process ------------------------------------------------------------


@pytest.mark.parametrize("source", ["task", "jsonl"])
def test_the_prompt_cursor_continues_where_it_was(tmp_path, source):
    cfg = DataConfig()
    if source == "jsonl":
        rows = tmp_path / "rows.jsonl"
        rows.write_text("".join(json.dumps({"prompt": f"p{i}", "answer": str(i)}) + "\n" for i in range(5)))
        cfg = DataConfig(source="jsonl", path=str(rows))
    whole = [p for p, _ in zip(prompt_stream(cfg, 7), range(23))]
    assert len({p.text for p in whole}) > 3
    for cut in (0, 5, 7, 10, 12):
        a = prompt_stream(cfg, 7)
        for _ in range(cut):
            next(a)
        b = prompt_stream(cfg, 7)
        b.restore(json.loads(json.dumps(a.state())))  # as controller.json keeps it
        assert [next(b) for _ in range(23 - cut)] == whole[cut:], cut


def simulated(recipe):
    """The recipe's pipeline over simulated engines (rlctl/sim/), its trainer, and its events."""
    from rlctl.metrics import KeptEvents, Recorder
    from rlctl.pipelines.build import build_pipeline
    from rlctl.pipelines.scoring import inline_scorer
    from rlctl.rewards.verifiers import scored_by
    from rlctl.sim.engines import SimRollout, SimTrainer
    from rlctl.sim.loop import VirtualClock
    from rlctl.costs.recipe import cost_model

    cost = cost_model(recipe)
    servers = [SimRollout(f"rollout-{i}", cost, recipe.rollout.max_running_requests) for i in range(4)]
    trainer, events, rng = SimTrainer(cost, servers), KeptEvents(), random.Random(0)
    pipeline = build_pipeline(recipe, servers, trainer, VirtualClock(), Recorder(events, lambda r: None).emit,
                              lambda step: None, tokenize=lambda prompt: [0] * 64,
                              score=inline_scorer(lambda ids: "", scored_by(lambda r, a: float(rng.random() < 0.5))))
    return pipeline, trainer, events


def test_async_checkpoint_state_leaves_the_groups_in_flight_behind():
    """async generates on while a step ends: the groups in flight or waiting are listed as
    unfinished (a resume records them dropped), and the resumed scheduler opens new groups from
    the saved cursor, with the next group ids, at the saved version."""
    from rlctl.sim.loop import run_virtual

    recipe = load_recipe(REPO / "recipes" / "sim-1024gpu.yaml", [
        "rollout.batch_size=16", "rollout.group_size=4", "train.groups_per_batch=4", "sim.rollout_gpus=4",
        "sim.trainer_gpus=4", "rollout.sampling.max_new_tokens=512", "pipeline.mode=async", "pipeline.max_staleness=2",
        "pipeline.admission=frontier"], check_paths=False)
    first, _, _ = simulated(recipe)
    states = {}

    async def keep(step: int) -> None:
        states[step + 1] = first.state()

    first.after_step = keep
    run_virtual(first.run(4))
    state = json.loads(json.dumps(states[2]))
    assert state["unfinished"] and state["version"] == 2 and state["prompts"]["position"] == state["next_group"]
    second, trainer, events = simulated(recipe)
    trainer.version = state["version"]
    second.restore(state)
    run_virtual(second.run(4, start=2))
    assert [(e["step"], e["version"]) for e in events if e["event"] == "step_start"] == [(2, 2), (3, 3)]
    admitted = [e for e in events if e["event"] == "group_admitted"]
    assert min(e["group"] for e in admitted) == state["next_group"]
    assert min(e["prompt"] for e in admitted) == state["prompts"]["position"]


def test_the_torch_engine_continues_exactly_from_its_checkpoint(tiny_model_dir, tmp_path):
    """Weights, optimizer moments, RNG and version come back: the next step from a loaded
    checkpoint is bit for bit the step the saving engine takes; from the initial weights it is not."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlctl.engines.train.base import TrainSample
    from rlctl.engines.train.torch_engine import TorchTrainEngine
    from rlctl.recipe import TrainConfig

    rng = random.Random(0)
    samples = [TrainSample([1] + [rng.randint(3, 90) for _ in range(5)], [rng.randint(3, 90) for _ in range(3)],
                           advantage=rng.uniform(-1, 1), logprobs=[-4.6] * 3, weight_version=0) for _ in range(12)]

    def engine() -> TorchTrainEngine:
        return TorchTrainEngine(str(tiny_model_dir), TrainConfig(lr=1e-2), temperature=1.0, rank=0, world_size=1)

    saver = engine()
    saver.train_batch(samples[:6])
    saver.save_checkpoint(str(tmp_path / "ckpt"))
    saved = {n: t.clone() for n, t in saver.hf_weights()}
    drawn = torch.rand(4)  # from the RNG state the checkpoint holds
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt" / "hf").state_dict()
    assert all(exported[n].equal(t) for n, t in saved.items())
    torch.manual_seed(1234)  # the loader's RNG starts elsewhere
    loader = engine()
    assert loader.load_checkpoint(str(tmp_path / "ckpt")) == {"version": 1.0}
    assert torch.rand(4).equal(drawn)
    assert all(t.equal(saved[n]) for n, t in loader.hf_weights())
    moments = [(saver.optimizer.state[p], loader.optimizer.state[q])
               for p, q in zip(saver.model.parameters(), loader.model.parameters())]
    assert all(a["exp_avg_sq"].equal(b["exp_avg_sq"]) and a["step"].equal(b["step"]) for a, b in moments)
    fresh = engine()
    for e in (saver, loader, fresh):
        e.train_batch(samples[6:])
    after = dict(saver.hf_weights())
    assert all(t.equal(after[n]) for n, t in loader.hf_weights()) and loader.version == 2
    assert not all(t.equal(after[n]) for n, t in fresh.hf_weights())


@pytest.mark.e2e
def test_sigusr1_checkpoints_and_stops_and_launch_resume_continues(tmp_path):
    """SIGUSR1 to the controller (what a Slurm job's batch script passes on before the time limit):
    a checkpoint at the end of the step in progress, then the run stops, cancelled, with no
    checkpoint from run.save_every (0). `rlctl launch RECIPE --resume` with the same recipe
    continues it; a changed recipe is refused, naming the key."""
    steps, runs = 10, tmp_path / "runs"
    args = launch_args(runs, f"run.steps={steps}")
    launching = subprocess.Popen([sys.executable, "-m", "rlctl", *args], cwd=tmp_path, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
    rd = wait_for(lambda: (runs.is_dir() and any(runs.iterdir())) and the_run(runs), 60, "the run directory")
    wait_for(lambda: len(rd.metrics()) >= 2, 240, "two steps")
    os.kill(rd.read()["processes"]["controller"]["pid"], signal.SIGUSR1)
    out, err = launching.communicate(timeout=120)
    assert launching.returncode == 1, err
    info = rd.read()
    assert info["state"] == "cancelled" and "rlctl resume" in info["exit_reason"], info["exit_reason"]
    (ckpt,) = list_checkpoints(rd.path)
    assert 2 <= ckpt.steps < steps and len(rd.metrics()) == ckpt.steps
    (stopped,) = [e for e in rd.events() if e["event"] == "preempted"]
    assert stopped["steps"] == ckpt.steps
    wait_for(lambda: not processes_mentioning(rd.id), 10, "every process of the run to exit")

    changed = rlctl(*args, "train.lr=1e-3", "--resume", cwd=tmp_path)
    assert changed.returncode == 2 and "train.lr" in changed.stderr and rd.id in changed.stderr, changed.stderr
    res = rlctl(*args, "--resume", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert [p.name for p in runs.iterdir()] == [rd.id]  # the same run, not a new one
    info = rd.read()
    assert info["state"] == "completed" and info["attempts"][1]["resumed_from"] == ckpt.steps
    assert [m["step"] for m in rd.metrics()] == list(range(steps))
    again = rlctl(*args, "--resume", cwd=tmp_path)  # completed: nothing to do, no new run
    assert again.returncode == 0 and "nothing to do" in again.stderr and len(list(runs.iterdir())) == 1
