"""The algo section on the torch trainer: every variant takes the same step however the batch is
cut, the aggregations weigh what they say, PPO's critic learns and survives a checkpoint, and
recomputed old log-probs come from the weights that generated the samples."""

from __future__ import annotations

import dataclasses
import math
import os
import random

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import free_port
from rlctl.engines.train.base import TrainSample
from rlctl.engines.train.torch_engine import TorchTrainEngine
from rlctl.errors import RunError
from rlctl.recipe import AlgoConfig, TrainConfig

# No gradient clipping, so the gradients compared are the raw averaged ones.
CONFIG = TrainConfig(lr=1e-2, grad_clip=1e9)

VARIANTS = {
    "seq-mean-token-mean": AlgoConfig(loss_agg="seq-mean-token-mean"),
    "seq-mean-token-sum+dual-clip": AlgoConfig(loss_agg="seq-mean-token-sum", dual_clip=3.0, clip_eps_high=0.28),
    "kl-k2-in-loss": AlgoConfig(kl_coef=0.1, kl_estimator="k2"),
    "kl-low-var-in-reward": AlgoConfig(kl_coef=0.5, kl_estimator="low-var", kl_in="reward"),
    "recompute+tis": AlgoConfig(recompute_logprobs=True, tis_cap=1.5),
    "ppo": AlgoConfig(name="ppo", gamma=0.95, gae_lambda=0.9, kl_coef=0.05, kl_in="reward"),
}


def make_samples(groups: int = 3, size: int = 4, seed: int = 0) -> list[TrainSample]:
    """Whole groups (as the controller sends them), of responses of different lengths, with
    behaviour log-probs a little off the policy's so that ratios differ from 1 (and, for each
    group's first sample, far off: a ratio near 10, where a dual clip binds)."""
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = [1] + [rng.randint(3, 90) for _ in range(rng.randint(3, 8))]
        for i in range(size):
            response = [rng.randint(3, 90) for _ in range(rng.randint(1, 6))]
            reward = float(rng.random() < 0.5)
            base = -7.0 if i == 0 else -4.6
            out.append(TrainSample(prompt, response, advantage=rng.uniform(-1, 1), reward=reward, group=g,
                                   logprobs=[base + rng.uniform(-0.3, 0.3) for _ in response], weight_version=0))
    return out


def engine(model_dir, algo: AlgoConfig, cfg: TrainConfig = CONFIG, **kw) -> TorchTrainEngine:
    return TorchTrainEngine(str(model_dir), cfg, temperature=1.0, rank=0, world_size=1, algo=algo, **kw)


def grads(e: TorchTrainEngine) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in e.model.named_parameters()}
    if e.critic is not None:
        out.update({f"critic.{n}": p.grad.clone() for n, p in e.critic.model.named_parameters() if p.grad is not None})
    return out


@pytest.mark.parametrize("name", list(VARIANTS))
def test_a_variant_takes_the_same_step_whole_in_groups_and_in_micro_batches(tiny_model_dir, name):
    algo = VARIANTS[name]
    samples = make_samples()
    whole = engine(tiny_model_dir, algo)
    a = whole.train_batch(samples)
    pieces = engine(tiny_model_dir, algo, TrainConfig(lr=1e-2, grad_clip=1e9, micro_batch_tokens=24))
    for g in range(0, len(samples), 4):  # one group per piece, as rolloutpipe streams them
        pieces.accumulate(samples[g : g + 4])
    b = pieces.step()
    assert b["micro_batches"] > a["micro_batches"]
    for key in a:
        if key not in ("seconds", "micro_batches"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-7), key
    ga, gb = grads(whole), grads(pieces)
    assert ga.keys() == gb.keys()
    for n in ga:  # float32 sums in another order: the largest gradients are about 0.3
        torch.testing.assert_close(gb[n], ga[n], rtol=1e-4, atol=1e-6, msg=n)
    assert any(float(g.abs().sum()) > 0 for g in ga.values())
    if algo.dual_clip:
        assert a["dual_clip_frac"] > 0  # the far-off samples' negative advantages reach the bound


@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "seq-mean-token-sum"])
def test_a_sequence_mean_is_the_mean_of_each_samples_own_gradient(tiny_model_dir, agg):
    """seq-mean-token-mean: each sample counts once whatever its length (the batch gradient is the
    mean of one-sample token-mean gradients); seq-mean-token-sum: the mean of token-sum ones."""
    samples = make_samples(groups=1, size=4)
    e = engine(tiny_model_dir, AlgoConfig(loss_agg=agg))
    e.train_batch(samples)
    batch = grads(e)
    per_sample = []
    for s in samples:
        one = engine(tiny_model_dir, AlgoConfig(loss_agg="token-mean"))
        one.train_batch([s])
        g = grads(one)
        scale = len(s.response_ids) if agg == "seq-mean-token-sum" else 1.0
        per_sample.append({n: t * scale for n, t in g.items()})
    for n, t in batch.items():
        torch.testing.assert_close(t, sum(g[n] for g in per_sample) / len(samples), rtol=1e-4, atol=1e-6, msg=n)


def test_recomputed_old_logprobs_are_those_of_the_weights_that_generated_the_samples(tiny_model_dir):
    e = engine(tiny_model_dir, AlgoConfig(recompute_logprobs=True, tis_cap=1.5))
    samples = make_samples()
    at_v0 = e.logprobs(samples)
    # Servers whose numerics differ: log-probs off the trainer's by a fixed +-0.2 per token.
    served = [dataclasses.replace(s, logprobs=[x + (0.2 if i % 2 else -0.2) for i, x in enumerate(lp)])
              for s, lp in zip(samples, at_v0)]
    first = e.train_batch(served)
    # The ratio is taken against the trainer's own log-probs: on-policy, nothing clips.
    assert first["clip_frac"] == 0.0 and first["approx_kl"] == pytest.approx(0.0, abs=1e-9)
    assert first["mismatch_kl"] > 0.015  # e^0.2 - 1.2 = 0.0214, or e^-0.2 - 0.8 = 0.0187
    offsets = [0.2 if i % 2 else -0.2 for s in served for i in range(len(s.logprobs))]
    caps = [min(math.exp(-d), 1.5) for d in offsets]  # p_trainer / p_server, capped
    assert first["is_weight_mean"] == pytest.approx(sum(caps) / len(caps), rel=1e-6)
    assert e.version == 1
    # Version 0's samples are still scored with version 0's weights, after the step.
    ids = e._batch_tensors(samples)
    prep = e._prepare(samples, *ids)
    for i, s in enumerate(samples):
        start = len(s.prompt_ids) - 1
        got = prep.old[i, start : start + len(s.response_ids)].tolist()
        assert got == pytest.approx(at_v0[i], abs=1e-6)
    assert e.logprobs(samples)[0] != pytest.approx(at_v0[0], abs=1e-6)  # the live weights moved
    # Once the servers hold version 1 (and one copy is kept), a version-0 sample is refused.
    e.mark_behaviour(1)
    with pytest.raises(RunError, match="weight version 0"):
        e.accumulate(samples[:1])


def test_ppo_critic_learns_the_returns(tiny_model_dir):
    e = engine(tiny_model_dir, AlgoConfig(name="ppo"), TrainConfig(lr=1e-9, grad_clip=1.0))
    samples = make_samples()
    first = e.train_batch(samples)
    for _ in range(25):
        e.mark_behaviour(e.version)  # the servers hold each new version: old values follow the critic
        last = e.train_batch([dataclasses.replace(s, weight_version=e.version) for s in samples])
    assert first["values_mean"] == 0.0  # a zero-initialized head
    assert last["value_loss"] < 0.3 * first["value_loss"]
    assert last["explained_var"] > 0.5 > first["explained_var"]
    assert {"value_clip_frac", "critic_grad_norm"} <= last.keys()


def test_ppo_critic_is_checkpointed_with_the_policy(tiny_model_dir, tmp_path):
    algo = AlgoConfig(name="ppo")
    a = engine(tiny_model_dir, algo)
    a.train_batch(make_samples(seed=1))
    a.save_checkpoint(str(tmp_path / "ckpt"))
    b = engine(tiny_model_dir, algo)
    b.load_checkpoint(str(tmp_path / "ckpt"))
    assert b.version == 1
    batch = [dataclasses.replace(s, weight_version=1) for s in make_samples(seed=2)]
    sa, sb = a.train_batch(batch), b.train_batch(batch)
    for key in ("loss", "value_loss", "values_mean", "critic_grad_norm"):
        assert sb[key] == pytest.approx(sa[key], rel=1e-5), key
    for (n, p), (_, q) in zip(a.critic.model.named_parameters(), b.critic.model.named_parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-6, msg=n)
    grpo = engine(tiny_model_dir, AlgoConfig())
    grpo.save_checkpoint(str(tmp_path / "grpo"))
    with pytest.raises(RunError, match="no critic"):
        engine(tiny_model_dir, algo).load_checkpoint(str(tmp_path / "grpo"))


def test_a_step_with_a_non_finite_gradient_is_skipped(tiny_model_dir):
    e = engine(tiny_model_dir, AlgoConfig(name="ppo"))
    before = {n: t.clone() for n, t in e.hf_weights()}
    bad = [dataclasses.replace(s, advantage=float("nan"), reward=float("nan")) for s in make_samples()]
    stats = e.train_batch(bad)
    assert stats["update_ok"] == 0.0 and stats["version"] == 0.0 and e.version == 0
    assert all(torch.equal(t, before[n]) for n, t in e.hf_weights())
    assert all(bool(torch.isfinite(p).all()) for p in e.critic.model.parameters())
    good = e.train_batch(make_samples())  # and the next batch trains as usual
    assert good["update_ok"] == 1.0 and e.version == 1


def _rank(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    e = TorchTrainEngine(model_dir, CONFIG, temperature=1.0, rank=rank, world_size=world, algo=VARIANTS["ppo"])
    e.accumulate(make_samples()[:4])
    e.accumulate(make_samples()[4:])
    stats = e.step()
    if rank == 0:
        torch.save({"grads": grads(e), "stats": stats}, out)
    # Both ranks leave together, and without tearing the gloo group down: its threads' destructors
    # can abort the process at exit ("terminate called without an active exception", seen in CI).
    dist.barrier()
    os._exit(0)


@pytest.mark.process
def test_ppo_over_two_ranks_takes_one_ranks_step(tiny_model_dir, tmp_path):
    """The critic's gradients and the PPO statistics are reduced over the ranks too."""
    single = engine(tiny_model_dir, VARIANTS["ppo"])
    s1 = single.train_batch(make_samples())
    out = tmp_path / "two.pt"
    mp.spawn(_rank, args=(2, free_port(), str(tiny_model_dir), str(out)), nprocs=2, join=True)
    two = torch.load(out)
    for n, g in grads(single).items():
        torch.testing.assert_close(two["grads"][n], g, rtol=1e-4, atol=1e-6, msg=n)
    for key in ("loss", "value_loss", "explained_var", "kl", "entropy", "critic_grad_norm"):
        assert two["stats"][key] == pytest.approx(s1[key], rel=1e-4), key


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_a_trajectorys_tool_tokens_carry_no_gradient(tiny_model_dir, agg):
    """rollout.multi_turn: a response of model turns and tool results, the results masked out.
    The step cannot depend on anything at the masked positions (their behaviour log-probs here),
    it differs from training on every token, and only the model's tokens are counted."""
    from rlctl.engines.train.base import padded_batch

    rng = random.Random(3)
    samples = make_samples(groups=1, size=4)
    masked = []
    for s in samples:
        tool = [rng.randint(3, 90) for _ in range(5)]
        response = s.response_ids + tool + s.response_ids
        mask = [1] * len(s.response_ids) + [0] * len(tool) + [1] * len(s.response_ids)
        masked.append(dataclasses.replace(s, response_ids=response, loss_mask=mask,
                                          logprobs=s.logprobs + [-3.0] * len(tool) + s.logprobs))
    _, mask, *_ = padded_batch(masked, 0)
    first = masked[0]
    start = len(first.prompt_ids) - 1
    assert mask[0, start:start + len(first.response_ids)].tolist() == first.loss_mask
    other = [dataclasses.replace(s, logprobs=[x if m else -20.0 for x, m in zip(s.logprobs, s.loss_mask)]) for s in masked]
    runs = {}
    for name, batch in (("masked", masked), ("other", other), ("all", [dataclasses.replace(s, loss_mask=None) for s in masked])):
        e = engine(tiny_model_dir, AlgoConfig(loss_agg=agg))
        stats = e.train_batch(batch)
        runs[name] = (grads(e), stats)
    for n, g in runs["masked"][0].items():
        torch.testing.assert_close(runs["other"][0][n], g, msg=n)
    assert any(not torch.allclose(runs["all"][0][n], g) for n, g in runs["masked"][0].items())
    assert runs["masked"][1]["tokens"] == sum(sum(s.loss_mask) for s in masked) < runs["all"][1]["tokens"]
