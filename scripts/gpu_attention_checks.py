"""train.megatron.attention=sdpa with full recompute (the defaults) against Megatron's own unfused
attention without recompute, on the GPU machine (as scripts/gpu_checks.py says how):

    PYTHONPATH=$PWD:/tmp/deps python scripts/gpu_attention_checks.py --out OUT_DIR

One line per dtype; OUT_DIR/gpu_attention_checks.json and results/gpu_attention_checks.json; exit 1
if a check failed.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from gpu_common import TWO_LAYERS, build_model, megatron_engine, report, run_checks, samples, torch_engine
from rlctl.engines.train.base import TrainSample


def check_attention(work: Path) -> None:
    """train.megatron.attention=sdpa with full recompute (the defaults) against Megatron's own
    unfused attention without recompute, on the same weights and batch: fp32 log-probs within
    1e-4 and one GRPO step's loss within 1e-3 relative (check 2 and 3's tolerances); in bf16,
    sdpa's log-probs no further from the fp32 torch engine's than the unfused attention's are
    (within 1.5x of its largest error) and the step's loss within 1e-2 relative."""
    from rlctl.recipe import MegatronAttention, Recompute

    shape = {**TWO_LAYERS, "num_hidden_layers": 4}
    model_dir = build_model(work / "small-attention", torch.float32, **shape)
    te = torch_engine(model_dir)
    batch = samples(shape["vocab_size"], seed=3)
    ref = te.logprobs(batch)
    batch = [TrainSample(s.prompt_ids, s.response_ids, s.advantage, lp, 0) for s, lp in zip(batch, ref)]
    settings = {"sdpa+full": dict(attention=MegatronAttention.SDPA, recompute_granularity=Recompute.FULL),
                "local+none": dict(attention=MegatronAttention.LOCAL, recompute_granularity=Recompute.NONE)}
    for dtype in ("float32", "bfloat16"):
        got, stats = {}, {}
        for name, keys in settings.items():
            me = megatron_engine(model_dir, dtype, **keys)
            got[name] = me.logprobs(batch)
            stats[name] = me.train_batch(batch)
            del me
        diff = max(abs(a - b) for x, y in zip(got["sdpa+full"], got["local+none"]) for a, b in zip(x, y))
        err = {n: max(abs(a - b) for x, y in zip(lp, ref) for a, b in zip(x, y)) for n, lp in got.items()}
        rel = abs(stats["sdpa+full"]["loss"] - stats["local+none"]["loss"]) / max(abs(stats["local+none"]["loss"]), 1e-12)
        gn = abs(stats["sdpa+full"]["grad_norm"] - stats["local+none"]["grad_norm"]) / max(stats["local+none"]["grad_norm"], 1e-12)
        if dtype == "float32":
            ok = diff <= 1e-4 and rel <= 1e-3
        else:
            ok = err["sdpa+full"] <= 1.5 * err["local+none"] and rel <= 1e-2
        report(f"attention sdpa+full recompute vs local unfused ({dtype})", ok, logprobs_max_abs_diff=diff,
               err_vs_torch_fp32_sdpa=err["sdpa+full"], err_vs_torch_fp32_local=err["local+none"],
               loss_rel_diff=rel, grad_norm_rel_diff=gn, loss_sdpa=stats["sdpa+full"]["loss"],
               loss_local=stats["local+none"]["loss"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-checks-out")))
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    work = Path("/tmp/rlctl-gpu-checks")
    work.mkdir(exist_ok=True)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}", flush=True)
    run_checks({"attention": lambda: check_attention(work)}, ["attention"], a.out / "gpu_attention_checks.json")


if __name__ == "__main__":
    main()
