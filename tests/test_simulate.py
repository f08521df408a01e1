"""`rlctl simulate`: the real scheduler on simulated engines in virtual time."""

from __future__ import annotations

import json

import pytest

from conftest import QUICKSTART, REPO, rlctl_here
from rlctl.recipe import load_recipe
from rlctl.run.dir import RunDir
from rlctl.sim.run import simulate_run

SIM = REPO / "recipes" / "sim-1024gpu.yaml"
SMALL = ["run.steps=2", "rollout.batch_size=64", "rollout.group_size=8", "train.groups_per_batch=8",
         "sim.rollout_gpus=8", "sim.trainer_gpus=8", "rollout.sampling.max_new_tokens=4096"]


def metrics_for(*overrides: str) -> list[dict]:
    recipe = load_recipe(SIM, [*SMALL, *overrides], check_paths=False)
    return simulate_run(recipe).metrics


def test_rolloutpipe_beats_sync_in_simulation():
    sync = metrics_for("pipeline.mode=sync", "pipeline.admission=fifo")
    pipe = metrics_for("pipeline.mode=rolloutpipe", "pipeline.admission=frontier")
    assert all(m["train_batches"] == 8 and m["samples"] == 512 for m in sync + pipe)
    for s, p in zip(sync, pipe):
        assert p["rollout_to_train_end"] < s["rollout_to_train_end"]
        assert p["trainer_wait_ratio"] < s["trainer_wait_ratio"]
        assert 0 < p["efficiency"] <= 1.0 + 1e-9


def test_async_in_simulation_respects_staleness():
    metrics = metrics_for("pipeline.mode=async", "pipeline.max_staleness=1", "pipeline.admission=frontier")
    assert all(m["staleness_max"] <= 1 for m in metrics)


def test_simulate_writes_a_run_directory(tmp_path):
    res = rlctl_here("simulate", str(SIM), *SMALL, f"run.output_dir={tmp_path / 'runs'}", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    run_id = res.stdout.strip().splitlines()[-1]
    rd = RunDir(tmp_path / "runs" / run_id)
    info = rd.read()
    assert info["state"] == "completed" and info["launcher"] == "simulate"
    assert [m["step"] for m in rd.metrics()] == [0, 1]
    status = json.loads(rlctl_here("status", run_id, "--json", "--runs-dir", str(tmp_path / "runs"), cwd=tmp_path).stdout)
    assert status["state"] == "completed" and status["step"] == 2


def test_a_simulation_is_listed_apart_and_never_found_for_its_recipes_name(tmp_path):
    """`rlctl simulate recipe.yaml` names its run sim-<name>-...: `rlctl status` lists it (launcher
    simulate), but `rlctl status NAME` finds the recipe's real runs, or none."""
    from test_status import fake_run

    runs = tmp_path / "runs"
    res = rlctl_here("simulate", str(QUICKSTART), "run.steps=2", "--sim-defaults", f"run.output_dir={runs}", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    sim_id = res.stdout.strip().splitlines()[-1]
    assert sim_id.startswith("sim-quickstart-") and RunDir(runs / sim_id).read()["name"] == "sim-quickstart"
    missing = rlctl_here("status", "quickstart", "--runs-dir", str(runs), cwd=tmp_path)
    assert missing.returncode == 2 and "no run 'quickstart'" in missing.stderr  # not the simulation
    real = fake_run(runs, "quickstart-20260101-000000-aaaa", "completed", 3, [0.5])  # older than the simulation
    found = json.loads(rlctl_here("status", "quickstart", "--json", "--runs-dir", str(runs), cwd=tmp_path).stdout)
    assert found["id"] == real.id
    assert json.loads(rlctl_here("status", "sim-quickstart", "--json", "--runs-dir", str(runs), cwd=tmp_path).stdout)[
        "id"] == sim_id
    listed = rlctl_here("status", "--runs-dir", str(runs), cwd=tmp_path).stdout.splitlines()
    assert [line.split()[:3] for line in listed[1:]] == [["quickstart-20260101-000000-aaaa", "sync", "local"],
                                                        [sim_id, "sync", "simulate"]]


def test_bad_sim_key_is_a_recipe_error(tmp_path):
    res = rlctl_here("simulate", str(SIM), "sim.gpu=tpu", cwd=tmp_path)
    assert res.returncode == 2 and "sim.gpu" in res.stderr


@pytest.mark.parametrize("admission", ["fifo", "frontier"])
def test_every_group_accounted_for(admission):
    recipe = load_recipe(SIM, [*SMALL, "pipeline.mode=rolloutpipe", f"pipeline.admission={admission}",
                               "rollout.dynamic_sampling=true", "rollout.over_provision=0.25"], check_paths=False)
    events = simulate_run(recipe).events
    admitted = {e["group"] for e in events if e["event"] == "group_admitted"}
    trained = [g for e in events if e["event"] == "train_start" for g in e["groups"]]
    dropped = {e["group"] for e in events if e["event"] == "group_dropped"}
    assert len(trained) == len(set(trained)) == 2 * 64
    assert admitted == set(trained) | dropped and not set(trained) & dropped


@pytest.mark.parametrize("mode", ["sync", "rolloutpipe"])
def test_calibration_recovers_the_knobs_that_made_the_events(tiny_model_dir, mode):
    """Events from a simulation with known costs -> calibrate -> the same costs come back, and the
    calibrated model predicts a run with twice the batch. In rolloutpipe a train batch reaches
    the trainer in several calls (streamed groups), each a data point of its own."""
    import json as _json

    from rlctl.sim.calibrate import calibrate, model_parameters

    config = _json.loads((tiny_model_dir / "config.json").read_text())
    truth = [f"sim.params_b={model_parameters(str(tiny_model_dir)) / 1e9}", "sim.gpu=cpu", "sim.rollout_gpus=2",
             "sim.trainer_gpus=1", "sim.prompt_tokens=12", "sim.context_tokens=16",
             f"sim.layers={config['num_hidden_layers']}", f"sim.kv_dim={config['num_key_value_heads'] * config['head_dim']}",
             "sim.decode_step_overhead_s=0.01", "sim.mfu_train=0.3", "sim.layer_launch_s=0",
             "rollout.sampling.max_new_tokens=4"]
    pipeline = [f"pipeline.mode={mode}", "pipeline.admission=frontier", "rollout.concurrency=4"]
    quick = REPO / "recipes" / "quickstart.yaml"
    recipe = load_recipe(quick, ["run.steps=3", *truth, *pipeline], check_paths=False)
    events = simulate_run(recipe).events
    if mode == "rolloutpipe":
        assert any(e["event"] == "accumulate_end" for e in events)
    knobs = calibrate(events, str(tiny_model_dir), servers=2, trainer_ranks=1, long_tail=False)
    assert knobs["sim.decode_step_overhead_s"] == pytest.approx(0.01, rel=0.1)
    assert knobs["sim.mfu_train"] == pytest.approx(0.3, rel=0.1)
    assert knobs["rollout.sampling.max_new_tokens"] == 4

    fitted = [f"{k}={v}" for k, v in knobs.items()]
    big_truth = load_recipe(quick, ["run.steps=3", *truth, *pipeline, "rollout.batch_size=64"], check_paths=False)
    big_pred = load_recipe(quick, ["run.steps=3", *fitted, *pipeline, "rollout.batch_size=64"], check_paths=False)
    want = [m["step_time"] for m in simulate_run(big_truth).metrics]
    got = [m["step_time"] for m in simulate_run(big_pred).metrics]
    assert got == pytest.approx(want, rel=0.05)


def test_a_recipe_without_a_sim_section_is_refused_unless_defaults_are_asked_for(tmp_path):
    """The quickstart says nothing of a cluster: simulating it would silently price a 1.7B model."""
    res = rlctl_here("simulate", str(QUICKSTART), "run.steps=2", "--no-save", cwd=tmp_path)
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1
    assert "no sim: section" in res.stderr and "--sim-defaults" in res.stderr
    res = rlctl_here("simulate", str(QUICKSTART), "run.steps=2", "--no-save", "--sim-defaults", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "model 1.7B; h200 GPUs: 8 rollout (tp 1) + 8 trainer" in res.stdout
    assert "\n    the sim: defaults\n" in res.stdout
    res = rlctl_here("simulate", str(QUICKSTART), "run.steps=2", "--no-save", "sim.params_b=7", cwd=tmp_path)
    assert res.returncode == 0 and "model 7B" in res.stdout and "overridden: sim.params_b" in res.stdout
    assert all(len(line) <= 80 for line in res.stdout.splitlines()[:6])


def test_calibration_tells_a_call_from_an_optimizer_step(tiny_model_dir):
    """Streamed groups of different lengths: accumulate calls pay the per-call cost only, the
    final call of a batch the step too; both come back, with the per-token cost."""
    import json as _json

    from rlctl.sim.calibrate import calibrate, model_parameters

    config = _json.loads((tiny_model_dir / "config.json").read_text())
    truth = [f"sim.params_b={model_parameters(str(tiny_model_dir)) / 1e9}", "sim.gpu=cpu", "sim.rollout_gpus=2",
             "sim.trainer_gpus=1", "sim.prompt_tokens=12", f"sim.layers={config['num_hidden_layers']}",
             "sim.mfu_train=0.3", "sim.layer_launch_s=0.001", "sim.train_step_overhead_s=0.004",
             "rollout.sampling.max_new_tokens=64", "rollout.sampling.long_tail.enabled=true",
             "pipeline.mode=rolloutpipe", "pipeline.admission=frontier", "rollout.concurrency=4"]
    events = simulate_run(load_recipe(REPO / "recipes" / "quickstart.yaml", ["run.steps=3", *truth],
                                      check_paths=False)).events
    knobs = calibrate(events, str(tiny_model_dir), servers=2, trainer_ranks=1, long_tail=True)
    assert knobs["sim.layer_launch_s"] == pytest.approx(0.001, rel=0.05)
    assert knobs["sim.train_step_overhead_s"] == pytest.approx(0.004, rel=0.05)
    assert knobs["sim.mfu_train"] == pytest.approx(0.3, rel=0.05)
