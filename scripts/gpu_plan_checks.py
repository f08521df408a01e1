"""The planner (`rlctl plan`) against one GPU, for the GPU machine:

    python -m pip install --no-deps --target /tmp/deps .device-wheels/*.whl   # omegaconf, math-verify
    PYTHONPATH=$PWD:/tmp/deps python scripts/gpu_plan_checks.py --out OUT_DIR [--only order,trainer,server]

1. memory: the GPU bench trainer (recipes/bench-longtail-gpu.yaml: the torch engine, fp32, KL
   reference) takes two train steps on a batch of one micro-batch of 16384 and of 4096 tokens;
   torch's peak allocated memory in the second (AdamW's state exists from the first on) against
   costs/memory.py's trainer_memory. Its built-in server
   runs 256 requests of 524 tokens at once; the peak against server_memory at that context.
   Within 15% each.
2. order: three placements of the bench recipe on this GPU, launched for real (3 steps each, the
   weights' warm-up skipped: the long-tail lengths do not depend on them): as written; a small
   KV budget (32 running requests); micro-batches of 512 tokens. The planner, calibrated on the
   first run, predicts each one's step; the order of the predictions must be the order of the
   measured median steps.
One line per check; OUT_DIR/gpu_plan_checks.json and results/gpu_plan_checks.json (with --only:
gpu_plan_checks-ONLY); exit 1 if a check failed.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import threading
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from rlctl.costs.recipe import cost_model  # noqa: E402
from rlctl.costs.memory import TrainLayout, server_memory, trainer_memory  # noqa: E402
from rlctl.costs.shape import init_config, model_shape  # noqa: E402
from rlctl.recipe import load_recipe  # noqa: E402
from artifact import slug, write_artifact  # noqa: E402

BENCH = REPO / "recipes" / "bench-longtail-gpu.yaml"
RESULTS: dict[str, dict] = {}
GIB = 1024**3


def report(name: str, ok: bool | None, **numbers) -> None:
    RESULTS[name] = {"ok": ok, **numbers}
    verdict = "PASS" if ok else "FAIL" if ok is not None else "INFO"
    print(f"{verdict} {name}: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                           for k, v in numbers.items()), flush=True)


def bench_model(work: Path) -> Path:
    """The bench recipe's model with random weights, saved as the model builder saves it."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    path = work / "bench-model"
    if not (path / "config.json").exists():
        config = init_config(load_recipe(BENCH, check_paths=False))
        cfg = Qwen3Config(**config, max_position_embeddings=1024, rope_theta=10000.0, pad_token_id=0, bos_token_id=1,
                          eos_token_id=2)
        Qwen3ForCausalLM(cfg).to(torch.float32).save_pretrained(path)
    return path


def check_trainer_memory(work: Path) -> None:
    from rlctl.engines.train.base import TrainSample
    from rlctl.engines.train.torch_engine import TorchTrainEngine

    recipe = load_recipe(BENCH, check_paths=False)
    model = bench_model(work)
    shape = model_shape(recipe)
    g = torch.Generator().manual_seed(0)
    for tokens in (16384, 4096):
        torch.cuda.empty_cache()
        cfg = recipe.train
        engine = TorchTrainEngine(str(model), cfg, 1.0, 0, 1, device="cuda:0", algo=recipe.algo)
        per = 512
        batch = []
        for _ in range(tokens // per):
            ids = torch.randint(3, shape.vocab, (per,), generator=g).tolist()
            batch.append(TrainSample(ids[:12], ids[12:], advantage=float(torch.randn(1, generator=g)),
                                     logprobs=[-1.0] * (per - 12), weight_version=0))
        engine.train_batch(batch)  # the optimizer's state exists from the first step on
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        engine.train_batch(batch)
        torch.cuda.synchronize()
        measured = torch.cuda.max_memory_allocated()
        predicted = trainer_memory(recipe, shape, TrainLayout(micro_batch_tokens=cfg.micro_batch_tokens), tokens)
        report(f"trainer peak memory, one micro-batch of {tokens} tokens",
               abs(predicted.total / measured - 1) <= 0.15, measured_gib=measured / GIB,
               predicted_gib=predicted.total / GIB, ratio=predicted.total / measured,
               **{k.replace(" ", "_") + "_gib": v / GIB for k, v in predicted.parts.items() if v})
        del engine
        gc.collect()
        torch.cuda.empty_cache()


def check_server_memory(work: Path) -> None:
    from dataclasses import replace

    from transformers import AutoModelForCausalLM

    from rlctl.engines.rollout.builtin.engine import Engine, Request, SamplingParams

    recipe = load_recipe(BENCH, check_paths=False)
    model = AutoModelForCausalLM.from_pretrained(bench_model(work), dtype=torch.float32).to("cuda:0").eval()
    running, prompt, new = 256, 12, 512
    engine = Engine(model, {2}, 0, max_running=running, seed=0, max_context=1024)
    engine.start()
    done = threading.Semaphore(0)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    for i in range(running):
        engine.submit(Request(str(i), [1] + [5 + i % 50] * (prompt - 1), SamplingParams(max_new_tokens=new, ignore_eos=True),
                              False, lambda r: done.release()))
    for _ in range(running):
        done.acquire()
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated()
    engine.stop()
    del engine, model
    gc.collect()
    torch.cuda.empty_cache()
    cost = replace(cost_model(recipe), mean_context_tokens=prompt + new)  # every request at its longest
    predicted = server_memory(cost, running, expands_kv=True)
    report(f"server peak memory, {running} requests of {prompt + new} tokens", abs(predicted.total / measured - 1) <= 0.15,
           measured_gib=measured / GIB, predicted_gib=predicted.total / GIB, ratio=predicted.total / measured,
           **{k.replace(" ", "_") + "_gib": v / GIB for k, v in predicted.parts.items()})


def gpu_variants() -> list:
    from plan_order import Variant

    from rlctl.planner.estimate import Placement
    from rlctl.recipe import PipelineMode

    def one_gpu(mb: int = 16384) -> Placement:
        return Placement(PipelineMode.SYNC, 1, 1, 1, micro_batch_tokens=mb, colocated=True)

    return [Variant("as written", [], one_gpu()),
            Variant("small KV budget", ["rollout.max_running_requests=32", "rollout.concurrency=32"], one_gpu()),
            Variant("micro-batch 512", ["train.micro_batch_tokens=512"], one_gpu(512))]


def check_order(out: Path) -> None:
    from plan_order import check_order as run_and_compare

    variants = gpu_variants()
    common = ["run.steps=3", "rollout.batch_size=16", "train.groups_per_batch=4", "model.init.warmup_steps=0"]
    ok, _ = run_and_compare(BENCH, variants, common, out / "runs")
    report("predicted order of step times is the measured order", ok,
           **{v.name.replace(" ", "_"): f"measured {v.measured:.2f} s, predicted {v.predicted:.2f} s" for v in variants})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--only", default="order,trainer,server")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(4)
    only = set(args.only.split(","))
    # The runs first, while this process holds no GPU memory.
    steps = {"order": lambda: check_order(args.out),
             "trainer": lambda: check_trainer_memory(args.out), "server": lambda: check_server_memory(args.out)}
    for name, step in steps.items():
        if name in only:
            try:
                step()
            except Exception as e:  # noqa: BLE001 - one failed check must not hide the others
                report(name, False, error=f"{type(e).__name__}: {e}"[:300])
            (args.out / "gpu_plan_checks.json").write_text(json.dumps(RESULTS, indent=1))
    every = only >= set(steps)
    write_artifact("gpu_plan_checks" + ("" if every else "-" + slug(args.only)), {"only": sorted(only), "checks": RESULTS})
    sys.exit(0 if all(r["ok"] is not False for r in RESULTS.values()) else 1)


if __name__ == "__main__":
    main()
