"""`rlctl plan`: the placement space, the memory model against what torch holds, the length order
statistics against sampling, the analytic step against `rlctl simulate`, and the command."""

from __future__ import annotations

import json
import math
import random
import statistics

import pytest
import torch

from conftest import REPO, rlctl_here
from rlctl.costs.recipe import cost_model
from rlctl.planner.estimate import estimate
from rlctl.planner.launch import NotLaunchable, launch_overrides
from rlctl.costs.lengths import Lengths
from rlctl.costs.memory import TrainLayout, trainer_memory
from rlctl.planner.placement import Placement
from rlctl.planner.search import placements, plan
from rlctl.recipe import PipelineMode, load_recipe
from rlctl.costs.model import HARDWARE, CostModel, ModelShape
from rlctl.sim.run import simulate_run
from rlctl.workloads import LengthDistribution

SIM = REPO / "recipes" / "sim-1024gpu.yaml"
QWEN = REPO / "recipes" / "slurm-qwen3-1.7b.yaml"


def recipe(path=SIM, *overrides: str):
    return load_recipe(path, list(overrides), check_paths=False)


def test_length_order_statistics_match_sampling():
    rng = random.Random(7)
    for cap in (512, 16384):
        dist, lengths = LengthDistribution(cap), Lengths(cap, long_tail=True)
        draws = [dist.sample(rng) for _ in range(40_000)]
        assert lengths.mean == pytest.approx(statistics.fmean(draws), rel=0.02)
        assert lengths.std == pytest.approx(statistics.pstdev(draws), rel=0.03)
        for n in (4, 16, 64):
            sampled = statistics.fmean(max(rng.choice(draws) for _ in range(n)) for _ in range(3000))
            assert lengths.expected_max(n) == pytest.approx(sampled, rel=0.03), n
    fixed = Lengths(256, long_tail=False)
    assert fixed.mean == fixed.expected_max(1000) == 256 and fixed.std == 0
    assert fixed.residual_mean == pytest.approx(128, rel=0.01)  # a uniform age over one length


def test_the_activation_model_counts_what_autograd_saves():
    """ModelShape.activation_values_per_token against the bytes autograd keeps for the backward
    pass of a Qwen3 forward and the trainer's log-probs, for shapes that move each width."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from rlctl.algos.losses import token_logprobs

    torch.manual_seed(0)
    for h, layers, inter, heads, kv, vocab in [(64, 2, 128, 4, 2, 300), (96, 3, 384, 6, 2, 500), (64, 2, 512, 8, 4, 99)]:
        cfg = Qwen3Config(hidden_size=h, num_hidden_layers=layers, intermediate_size=inter, num_attention_heads=heads,
                          num_key_value_heads=kv, head_dim=16, vocab_size=vocab, tie_word_embeddings=True,
                          attn_implementation="sdpa")
        model = Qwen3ForCausalLM(cfg)
        ids = torch.randint(0, vocab, (2, 48))
        saved: dict[int, int] = {}
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}

        def pack(t, saved=saved, params=params):
            if t.untyped_storage().data_ptr() not in params:
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            token_logprobs(model(input_ids=ids).logits[:, :-1], ids[:, 1:])
        shape = ModelShape.from_hf_config(cfg.to_dict(), 4.0)
        tokens = ids.numel()
        # The saved log-softmax is one of the three vocabulary rows the peak counts.
        predicted = (shape.activation_values_per_token() + shape.logits_values_per_token() / 3) * tokens * 4
        assert sum(saved.values()) == pytest.approx(predicted, rel=0.12), (h, layers, inter, heads)
        assert shape.params == sum(p.numel() for p in model.parameters())


def test_trainer_memory_by_engine_layout_and_algorithm():
    shape = ModelShape.from_params_b(1.0, layers=16, hidden=2048, vocab=100_000)
    mega = recipe(QWEN)  # megatron, bf16
    m = trainer_memory(mega, shape, TrainLayout(tp=2, dp=8), micro_tokens=0)
    shard = 0.5e9
    assert m.parts["weights"] == 2 * shard and m.parts["gradients"] == 4 * shard
    assert m.parts["optimizer"] == pytest.approx(12 * shard / 8)  # distributed optimizer: fp32 master + Adam
    torch_engine = recipe(SIM)
    t = trainer_memory(torch_engine, shape, TrainLayout(dp=8), micro_tokens=1000)
    assert t.parts["weights"] + t.parts["gradients"] + t.parts["optimizer"] == 16e9  # nothing sharded
    assert t.parts["activations"] == shape.activation_values_per_token() * 1000 * 4
    assert t.parts["logits"] == 3 * 100_000 * 1000 * 4
    kl = trainer_memory(recipe(SIM, "algo.kl_coef=0.1"), shape, TrainLayout(), 0)
    assert kl.parts["reference"] == 4e9
    ppo = trainer_memory(recipe(SIM, "algo.name=ppo", "pipeline.mode=async", "pipeline.max_staleness=2"), shape,
                         TrainLayout(), 0)
    assert ppo.parts["behaviour copies"] == 3 * 4e9  # max_staleness + 1 versions
    assert ppo.parts["critic"] == 16e9 + 3 * 4e9


def test_the_space_follows_the_engines_and_nodes():
    torch_engine = list(placements(recipe(SIM), 64))
    assert {(p.train_tp, p.train_pp) for p in torch_engine} == {(1, 1)}
    assert {p.rollout_gpus for p in torch_engine if not p.colocated} == set(range(8, 64, 8))
    assert all(p.mode is PipelineMode.SYNC for p in torch_engine if p.colocated)
    assert all(p.rollout_gpus % p.rollout_tp == 0 and p.trainer_gpus % (p.train_tp * p.train_pp) == 0
               for p in torch_engine)
    mega = list(placements(recipe(QWEN), 64, pp=True))
    assert {p.train_tp for p in mega} == {1, 2, 4, 8} and {p.train_pp for p in mega} == {1, 2, 4, 8}
    assert {p.rollout_gpus for p in placements(recipe(SIM), 6, per_node=8) if not p.colocated} == {1, 2, 3, 4, 5}


def test_a_bigger_model_than_fits_is_set_apart_with_its_reason():
    r = recipe(SIM, "sim.params_b=70", "sim.gpu=h100")
    result = plan(r, cost_model(r), 16)
    assert result.unfit and all("GiB per GPU" in e.unfit or "KV cache" in e.unfit for e in result.unfit)
    assert all(e.trainer.total <= 80e9 * 0.92 for e in result.ranked)
    ranks = [e.s_per_1k for e in result.ranked]
    assert ranks == sorted(ranks)


def test_cost_model_layout_terms():
    h200, shape = HARDWARE["h200"], ModelShape.from_params_b(1.0, layers=10, hidden=1000)
    base = CostModel(h200, shape, trainer_gpus=64, train_tp=1, micro_batch_tokens=10**9)
    compute = 6e9 * 64_000 / (989e12 * 0.4 * 64)
    assert base.train_seconds(64_000, step=False) == pytest.approx(compute)
    # 16 samples on 64 data-parallel ranks: 48 ranks idle, the busiest does one sample.
    assert base.train_seconds(16_000, step=False, samples=16) == pytest.approx(6e9 * 1000 / (989e12 * 0.4))
    pp = CostModel(h200, shape, trainer_gpus=64, train_pp=4, micro_batch_tokens=1000)
    # 64000 tokens over 16 replicas: 4 micro-batches each, and the 1F1B bubble of (4 - 1) / 4.
    assert pp.train_seconds(64_000, step=False) == pytest.approx(compute * (1 + 3 / 4))
    tp = CostModel(h200, shape, trainer_gpus=64, train_tp=2, micro_batch_tokens=10**9)
    comm = 4 * 10 * (1e-5 + 2 * (1 / 2) * 2000 * 1000 * 2 / 450e9)  # 2000 tokens per rank, one micro-batch
    assert tp.train_seconds(64_000, step=False) == pytest.approx(compute + comm)
    passes = CostModel(h200, shape, trainer_gpus=64, micro_batch_tokens=10**9, forward_passes=1, critic=True)
    assert passes.train_seconds(64_000, step=False) == pytest.approx(compute * (6 + 2 + 8) / 6)
    colocated = CostModel(h200, shape, colocated=True, swap_bytes=5e9)
    assert colocated.broadcast_seconds() == pytest.approx(2 * 2e9 / (4.8e12 * 0.7) + 2 * 5e9 / 50e9)


@pytest.mark.parametrize("path,overrides,gpus", [
    (SIM, ["rollout.batch_size=256", "train.groups_per_batch=32"], 128),
    (QWEN, ["rollout.batch_size=64", "train.groups_per_batch=16", "rollout.sampling.long_tail.enabled=true"], 64),
], ids=["sim-longtail", "qwen3-1.7b"])
def test_the_analytic_step_is_within_15_percent_of_the_simulated_one(path, overrides, gpus):
    """The top 5 placements: the planner's step against the scheduler's own in virtual time,
    on the same cost model."""
    r = recipe(path, *overrides)
    result = plan(r, cost_model(r), gpus)
    for e in result.ranked[:5]:
        simulated = simulate_run(recipe(path, *overrides, *e.placement.overrides(e.running), "run.steps=3")).metrics
        step = statistics.median(m["step_time"] for m in simulated[1:])
        assert e.step_s == pytest.approx(step, rel=0.15), e.placement.label()


def test_estimates_move_the_way_the_work_does():
    r = recipe(SIM, "rollout.batch_size=256", "train.groups_per_batch=32")
    base = cost_model(r)
    sync = Placement(PipelineMode.SYNC, 64, 1, 64)
    one = estimate(r, base, sync)
    assert one.fits and one.bound in one.stages and one.step_s == pytest.approx(sum(one.stages.values()))
    assert estimate(r, base, Placement(PipelineMode.SYNC, 32, 1, 96)).stages["rollout"] > one.stages["rollout"]
    assert estimate(r, base, Placement(PipelineMode.SYNC, 96, 1, 32)).stages["train"] > one.stages["train"]
    pipelined = estimate(r, base, Placement(PipelineMode.ROLLOUTPIPE, 64, 1, 64))
    assert pipelined.step_s < one.step_s  # training hides under the rollout
    assert estimate(recipe(SIM, "rollout.batch_size=256", "train.groups_per_batch=32",
                           "rollout.max_running_requests=16"), base, sync).running == 16
    assert math.isclose(one.gpu_s_per_1k, one.step_s * 128 / one.samples * 1000)


def test_plan_command_ranks_prints_and_refuses(tmp_path):
    res = rlctl_here("plan", str(SIM), "--gpus", "64", "--top", "3", "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["considered"] > 100 and len(out["ranked"]) == 3
    assert [e["s_per_1k_samples"] for e in out["ranked"]] == sorted(e["s_per_1k_samples"] for e in out["ranked"])
    res = rlctl_here("plan", str(SIM), "rollout.batch_size=64", "train.groups_per_batch=8", "--gpus", "16",
                "--simulate", "2", "--sim-steps", "2", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "#1 against #2:" in res.stdout and "sim s" in res.stdout and "simulate #1: rlctl simulate" in res.stdout
    for args, code, said in [(["--gpus", "0"], 2, "--gpus"), (["--gpus", "8", "sim.nope=1"], 2, "sim.nope"),
                             (["--gpus", "1", "sim.params_b=5000"], 1, "no placement")]:
        res = rlctl_here("plan", str(SIM), *args, cwd=tmp_path)
        assert res.returncode == code and said in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_colocated_needs_one_set_of_gpus_and_sync(tmp_path):
    for args, said in [(["sim.colocated=true", "sim.rollout_gpus=8", "sim.trainer_gpus=16"], "sim.colocated"),
                       (["sim.colocated=true", "sim.rollout_gpus=8", "sim.trainer_gpus=8", "pipeline.mode=async"],
                        "pipeline.mode=sync")]:
        res = rlctl_here("simulate", str(SIM), *args, "--no-save", cwd=tmp_path)
        assert res.returncode == 2 and said in res.stderr, res.stderr


def test_a_planned_placement_launches_as_the_slurm_job_it_names(tmp_path):
    """`rlctl plan` says how to launch each placement rlctl can run, and why not the others; the
    keys it gives render the batch script of that placement (a dry run of the real launcher)."""
    r = recipe(QWEN)
    kinds = {}  # one placement of each kind: the recipe check of all 1036 takes minutes on 2 cores
    for e in plan(r, cost_model(r), 64, 8, pp=True).ranked:
        q = e.placement
        kinds.setdefault((q.mode, q.colocated, q.rollout_tp, q.train_tp, q.train_pp > 1), e)
    for e in kinds.values():
        p = e.placement
        try:
            launch_overrides(r, p, e.running, 8)
            assert p.train_pp == 1, p
        except NotLaunchable as why:
            assert str(why).startswith("pipeline-parallel") and p.train_pp > 1, (p, why)
    res = rlctl_here("plan", str(QWEN), "--gpus", "64", "--top", "60", "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    ranked = json.loads(res.stdout)["ranked"]
    assert all((e["launch"] is None) == bool(e["not_launchable"]) for e in ranked)
    assert any(e["launch"] and e["placement"]["colocated"] for e in ranked)
    e = next(e for e in ranked if e["launch"] and e["placement"]["rollout_tp"] > 1 and e["placement"]["train_tp"] > 1
             and not e["placement"]["colocated"])
    p = e["placement"]
    res = rlctl_here("launch", str(QWEN), "--dry-run", f"run.output_dir={tmp_path / 'runs'}", *e["launch"], cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    trainer, rollout = res.stdout.split("#SBATCH hetjob")
    t_nodes, r_nodes = -(-p["trainer_gpus"] // 8), -(-p["rollout_gpus"] // 8)
    assert f"--nodes={t_nodes}\n" in trainer and f"--ntasks-per-node={p['trainer_gpus'] // t_nodes}\n" in trainer
    assert f"--nodes={r_nodes}\n" in rollout and f"--ntasks-per-node={p['servers'] // r_nodes}\n" in rollout
    assert f"rlctl_own_gpus {p['rollout_tp']}" in rollout
    assert not (tmp_path / "runs").exists()  # a dry run writes nothing
    written = load_recipe(QWEN, e["launch"], check_paths=False)
    assert (written.train.megatron.tp, written.rollout.sglang.tp_size, str(written.pipeline.mode)) == (
        p["train_tp"], p["rollout_tp"], p["mode"])
    assert written.train.micro_batch_tokens == p["micro_batch_tokens"]
    res = rlctl_here("plan", str(QWEN), "--gpus", "64", "--top", "1", cwd=tmp_path)
    assert res.returncode == 0 and "launch #1: " in res.stdout and "rlctl launch " in res.stdout, res.stdout


def test_a_colocated_placement_on_one_gpu_launches_as_a_colocated_local_run():
    """One GPU: the plan's #1 is colocated, and its keys make a recipe whose server and trainer take
    turns on it (docs/colocate.md)."""
    one_gpu = REPO / "recipes" / "one-gpu-gsm8k.yaml"
    r = load_recipe(one_gpu, check_paths=False)
    best = plan(r, cost_model(r), 1, 1).ranked[0]
    assert best.placement.colocated
    keys = launch_overrides(r, best.placement, best.running, 1)
    launched = load_recipe(one_gpu, keys, check_paths=False)
    assert launched.colocate.enabled and str(launched.pipeline.mode) == "sync"
    assert (launched.train.ranks, launched.rollout.servers, str(launched.train.device)) == (1, 1, "cuda")
    assert launched.rollout.max_running_requests == best.running


def test_the_plans_colocated_first_on_64_gpus_launches_as_one_slurm_job_and_dry_runs(tmp_path):
    """`rlctl plan recipes/slurm-qwen3-1.7b.yaml --gpus 64`: #1 is colocated; its launch line is one
    Slurm job (no hetjob) of 8 nodes whose every GPU holds a Megatron rank and an SGLang TP rank."""
    res = rlctl_here("plan", str(QWEN), "--gpus", "64", "--top", "1", "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    best = json.loads(res.stdout)["ranked"][0]
    p = best["placement"]
    assert p["colocated"] and best["launch"], best
    res = rlctl_here("launch", str(QWEN), "--dry-run", f"run.output_dir={tmp_path / 'runs'}", *best["launch"],
                     cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "#SBATCH hetjob" not in res.stdout and "#SBATCH --nodes=8\n" in res.stdout
    assert "#SBATCH --ntasks-per-node=8\n" in res.stdout and "#SBATCH --gpus-per-node=8\n" in res.stdout
    assert f"rlctl_colocated_gpus $(($1 % {8 // p['rollout_tp']} * {p['rollout_tp']})) {p['rollout_tp']}" in res.stdout
    assert not (tmp_path / "runs").exists()
    written = load_recipe(QWEN, best["launch"], check_paths=False)
    assert written.colocate.enabled and written.train.ranks == written.rollout.servers * p["rollout_tp"] == 64


def test_tool_calls_are_priced_as_more_turns_and_the_slowest_trajectorys_wait():
    """rollout.multi_turn priced from sim.tools (rlctl/planner/tools.py): E[turns] requests a
    trajectory, and in sync and rolloutpipe the slowest trajectory's tool seconds as a stage; in
    async, a group's latency over the staleness bound's open groups, where that is more than the
    rollout; each mode's first placement against the simulated steps of the same tools."""
    from rlctl.planner.tools import ToolTime

    tools = REPO / "recipes" / "pool" / "sim-job-tools.yaml"
    r = recipe(tools, "sim.params_b=1.7")
    t = ToolTime.of(r)
    assert t is not None and t.turns == pytest.approx(1.875) and t.calls == pytest.approx(0.875)
    assert ToolTime.of(recipe(tools, "rollout.multi_turn.enabled=false")) is None
    base = cost_model(r)
    sync = estimate(r, base, Placement(PipelineMode.SYNC, 8, 1, 8))
    plain = estimate(recipe(tools, "sim.params_b=1.7", "rollout.multi_turn.enabled=false"), base,
                     Placement(PipelineMode.SYNC, 8, 1, 8))
    slow = estimate(recipe(tools, "sim.params_b=1.7", "sim.tools.latency_median_s=8"), base,
                    Placement(PipelineMode.SYNC, 8, 1, 8))
    assert "tools" not in plain.stages and 0 < sync.stages["tools"] < slow.stages["tools"]
    assert sync.stages["rollout"] > plain.stages["rollout"]  # 1.875 requests a trajectory
    async_ = [estimate(recipe(tools, "sim.params_b=1.7", *keys), base, Placement(PipelineMode.ASYNC, 8, 1, 8))
              for keys in ([], ["sim.tools.latency_median_s=8"], ["pipeline.max_staleness=3"])]
    assert 0 < async_[0].stages["tools"] < async_[1].stages["tools"]  # slower tools, a longer floor
    assert async_[2].step_s < async_[0].step_s  # more open groups, a lower one
    ranked = plan(r, base, 16).ranked
    assert ranked[0].placement.mode is PipelineMode.ASYNC  # tools overlap the rollout there
    for mode in (PipelineMode.SYNC, PipelineMode.ROLLOUTPIPE, PipelineMode.ASYNC):
        e = next(e for e in ranked if e.placement.mode is mode)
        simulated = simulate_run(recipe(tools, "sim.params_b=1.7", *e.placement.overrides(e.running),
                                        "run.steps=6")).metrics
        step = statistics.fmean(m["step_time"] for m in simulated[1:])
        assert e.step_s == pytest.approx(step, rel=0.2), e.placement.label()
