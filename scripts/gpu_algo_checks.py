"""The algo section on both trainers, for the GPU machine (megatron-core needs CUDA):

    PYTHONPATH=$PWD:/tmp/deps python scripts/gpu_algo_checks.py --out OUT_DIR

For each trainer-side variant of the objective (loss aggregations, clip-higher with dual clip,
each KL estimator in the loss, the KL in the reward), the torch and the Megatron engine (fp32)
take the same two optimizer steps from the same weights on the same batches: the first moves the
policy away from the KL reference, the second is compared. Passes when the second step's loss
agrees within 1e-3 relative (the tolerance of gpu_checks.py's one GRPO step) and the KL, clip and
entropy statistics within 1e-3 absolute. The behaviour log-probs are the torch engine's own,
moved by up to +-0.4 nats (and by -2.5 for a quarter of the samples), so that both clips bind.

Then a Megatron step (bf16) whose gradients are not finite (a NaN advantage): it is skipped, the
weights stay finite and the weight version stays at 0. PPO on Megatron: a checkpoint after one
step, loaded, takes the next step exactly as the saving engine; and a 10-step local PPO run
(rolloutpipe, recomputed log-probs with truncated IS) completes with the critic's statistics.

Prints one line per check and writes OUT_DIR/gpu_algo_checks.json and results/gpu_algo_checks.json
(with --only: gpu_algo_checks-ONLY); exit 1 if a check failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from gpu_common import TWO_LAYERS, build_model, megatron_engine, report, run_checks, samples, torch_engine  # noqa: E402
from rlctl.recipe import AlgoConfig  # noqa: E402

VARIANTS = {
    "token-mean (GRPO default)": AlgoConfig(),
    "seq-mean-token-mean": AlgoConfig(loss_agg="seq-mean-token-mean"),
    "seq-mean-token-sum": AlgoConfig(loss_agg="seq-mean-token-sum"),
    "clip-higher + dual clip": AlgoConfig(clip_eps_high=0.28, dual_clip=3.0),
    **{f"KL {k} in the loss": AlgoConfig(kl_coef=0.1, kl_estimator=k) for k in ("k1", "k2", "k3", "low-var")},
    "KL k3 in the reward": AlgoConfig(kl_coef=0.5, kl_in="reward"),
    "recomputed log-probs + truncated IS": AlgoConfig(recompute_logprobs=True, tis_cap=1.5),
    "PPO (critic, GAE, value clip, KL k3 in the reward)": AlgoConfig(name="ppo", gamma=0.95, gae_lambda=0.9,
                                                                    kl_coef=0.05, kl_in="reward"),
}
STATS = ("kl", "clip_frac", "dual_clip_frac", "entropy", "approx_kl", "mismatch_kl", "is_weight_mean", "value_loss",
         "explained_var", "values_mean", "value_clip_frac")


def off_policy(batch, logprobs, seed: int):
    """The samples with behaviour log-probs moved off the policy's, and rewards and groups of 4."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (s, lp) in enumerate(zip(batch, logprobs)):
        shift = -2.5 if i % 4 == 0 else 0.0
        moved = [x + shift + float(torch.empty(1).uniform_(-0.4, 0.4, generator=g)) for x in lp]
        out.append(dataclasses.replace(s, logprobs=moved, reward=float(i % 3 == 0), group=i // 4))
    return out


def check_variant(model_dir: Path, name: str, algo: AlgoConfig) -> None:
    first, second = samples(TWO_LAYERS["vocab_size"], seed=10), samples(TWO_LAYERS["vocab_size"], seed=11)
    te = torch_engine(model_dir, lr=1e-3, algo=algo)
    first, second = off_policy(first, te.logprobs(first), 1), off_policy(second, te.logprobs(second), 2)
    me = megatron_engine(model_dir, "float32", lr=1e-3, algo=algo)
    me.train_batch(first)
    te.train_batch(first)
    m, t = me.train_batch(second), te.train_batch(second)
    rel = abs(m["loss"] - t["loss"]) / max(abs(t["loss"]), 1e-12)
    diffs = {k: abs(m[k] - t[k]) for k in STATS if k in t}
    report(f"{name}: step 2, Megatron vs torch (float32)", rel <= 1e-3 and all(d <= 1e-3 for d in diffs.values())
           and m["version"] == t["version"] == 2.0, loss_megatron=m["loss"], loss_torch=t["loss"], rel_diff=rel,
           **{f"{k}_torch": t[k] for k in diffs}, **{f"{k}_abs_diff": d for k, d in diffs.items()})
    del me, te


def check_ppo_checkpoint(model_dir: Path, work: Path) -> None:
    """PPO on Megatron: a checkpoint after one step, loaded into a fresh engine, takes the next
    step exactly as the engine that saved it (the critic's weights and Adam state came back)."""
    import shutil

    algo = VARIANTS["PPO (critic, GAE, value clip, KL k3 in the reward)"]
    first, second = samples(TWO_LAYERS["vocab_size"], seed=13), samples(TWO_LAYERS["vocab_size"], seed=14)
    te = torch_engine(model_dir, lr=1e-3, algo=algo)
    first, second = off_policy(first, te.logprobs(first), 3), off_policy(second, te.logprobs(second), 4)
    del te
    ckpt = work / "ckpt-ppo"
    shutil.rmtree(ckpt, ignore_errors=True)
    saver = megatron_engine(model_dir, "float32", lr=1e-3, algo=algo)
    saver.train_batch(first)
    saver.save_checkpoint(str(ckpt))
    second = [dataclasses.replace(s, weight_version=1) for s in second]
    want = saver.train_batch(second)
    critic_after = [p.detach().clone() for p in saver.critic.model.parameters()]
    del saver
    loader = megatron_engine(model_dir, "float32", lr=1e-3, algo=algo)
    loader.load_checkpoint(str(ckpt))
    got = loader.train_batch(second)
    diff = max(float((p.detach() - q).abs().max()) for p, q in zip(loader.critic.model.parameters(), critic_after))
    same = all(got[k] == want[k] for k in ("loss", "value_loss", "values_mean"))
    report("Megatron PPO checkpoint: the next step as the saving engine's", same and diff == 0.0,
           value_loss=got["value_loss"], value_loss_saver=want["value_loss"], critic_max_abs_diff=diff)


def check_ppo_run(out: Path) -> None:
    """A local PPO run with the Megatron trainer: rolloutpipe, 2 built-in servers on the same GPU."""
    import json
    import subprocess

    runs = out / "ppo-runs"
    cmd = [sys.executable, "-m", "rlctl", "launch", str(REPO / "recipes" / "quickstart.yaml"), "run.steps=10",
           "train.engine=megatron", "train.device=cuda", "rollout.device=cuda", "train.megatron.dtype=float32",
           "algo.name=ppo", "algo.recompute_logprobs=true", "algo.tis_cap=2", "pipeline.mode=rolloutpipe",
           "pipeline.admission=frontier", f"run.output_dir={runs}"]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=400)
    if res.returncode != 0:
        report("local PPO run, megatron trainer", False, error=res.stderr.strip().splitlines()[-1][:300])
        return
    m = [json.loads(line) for line in (next(runs.iterdir()) / "metrics.jsonl").read_text().splitlines()]
    report("local PPO run, megatron trainer", len(m) == 10 and all("value_loss" in r for r in m), steps=len(m),
           reward_first=m[0]["reward_mean"], reward_last=m[-1]["reward_mean"], value_loss_first=m[0]["value_loss"],
           value_loss_last=m[-1]["value_loss"], mismatch_kl=m[-1]["mismatch_kl"])


def check_skipped_step(model_dir: Path) -> None:
    me = megatron_engine(model_dir, "bfloat16", lr=1e-3)
    batch = [dataclasses.replace(s, advantage=float("nan")) for s in samples(TWO_LAYERS["vocab_size"], seed=12)]
    stats = me.train_batch(batch)
    finite = all(bool(torch.isfinite(t).all()) for _, t in me.hf_weights())
    ok = stats["update_ok"] == 0.0 and me.version == 0 and stats["version"] == 0.0 and finite
    report("Megatron: a non-finite step and the version", ok, update_ok=stats["update_ok"], version=me.version,
           weights_finite=finite)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-checks-out")))
    p.add_argument("--only", default="", help="comma-separated check names (default: all)")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    work = Path("/tmp/rlctl-gpu-checks")
    work.mkdir(exist_ok=True)
    model_dir = build_model(work / "small-algo", torch.float32, **TWO_LAYERS)
    steps = {name: (lambda n=name, v=algo: check_variant(model_dir, n, v)) for name, algo in VARIANTS.items()}
    steps["skipped step"] = lambda: check_skipped_step(model_dir)
    steps["ppo checkpoint"] = lambda: check_ppo_checkpoint(model_dir, work)
    steps["ppo run"] = lambda: check_ppo_run(a.out)
    run_checks(steps, a.only.split(",") if a.only else list(steps), a.out / "gpu_algo_checks.json")


if __name__ == "__main__":
    main()
