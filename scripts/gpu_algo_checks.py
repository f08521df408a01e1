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
weights stay finite and the weight version stays at 0.

Prints one line per check and writes OUT_DIR/gpu_algo_checks.json; exit 1 if a check failed.
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

from gpu_checks import TWO_LAYERS, build_model, megatron_engine, report, run_checks, samples, torch_engine  # noqa: E402
from rlctl.recipe import AlgoConfig  # noqa: E402

VARIANTS = {
    "token-mean (GRPO default)": AlgoConfig(),
    "seq-mean-token-mean": AlgoConfig(loss_agg="seq-mean-token-mean"),
    "seq-mean-token-sum": AlgoConfig(loss_agg="seq-mean-token-sum"),
    "clip-higher + dual clip": AlgoConfig(clip_eps_high=0.28, dual_clip=3.0),
    **{f"KL {k} in the loss": AlgoConfig(kl_coef=0.1, kl_estimator=k) for k in ("k1", "k2", "k3", "low-var")},
    "KL k3 in the reward": AlgoConfig(kl_coef=0.5, kl_in="reward"),
}
STATS = ("kl", "clip_frac", "dual_clip_frac", "entropy", "approx_kl")


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
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    work = Path("/tmp/rlctl-gpu-checks")
    work.mkdir(exist_ok=True)
    model_dir = build_model(work / "small-algo", torch.float32, **TWO_LAYERS)
    steps = {name: (lambda n=name, v=algo: check_variant(model_dir, n, v)) for name, algo in VARIANTS.items()}
    steps["skipped step"] = lambda: check_skipped_step(model_dir)
    run_checks(steps, list(steps), a.out / "gpu_algo_checks.json")


if __name__ == "__main__":
    main()
