"""Every GPU check of train.engine=megatron in one go, for the GPU machine:

    python -m pip install --no-deps --target /tmp/deps .device-wheels/*.whl   # megatron-core, omegaconf
    PYTHONPATH=$PWD:/tmp/deps python scripts/gpu_checks.py --out OUT_DIR

1. HF -> Megatron -> HF round trip of a small Qwen3-architecture model through the engine
   (fp32 and bf16): exact.
2. Per-token log-probs of the Megatron and torch engines on the same weights and tokens (padded
   batch of different lengths): fp32 max abs diff <= 1e-4; bf16 reported.
3. One GRPO step of each engine from the same state and batch: losses within 1e-3 relative; how
   far the updated weights are apart is reported.
4. A train batch given to the Megatron engine in 3 accumulate() calls against the same batch in
   one call: the reduced, token-normalized gradients agree within 1e-5 of their largest entry.
5. A local run, train.engine=megatron (fp32), rolloutpipe (frontier, streamed groups), 2 built-in
   rollout servers on the same GPU, weight sync over gloo, pipeline.check_weights=true: after every
   sync each server's tensors hash like the trainer's.
6. Qwen2 (q/k/v biases, mapped into Megatron's fused linear_qkv.bias): checks 1 to 3 on a small
   Qwen2-architecture model with random, nonzero biases, so that a dropped or misplaced bias shows.
7. Weight-sync throughput of a Qwen3-0.6B-shaped model (bf16) to a built-in server on the GPU.
8. Megatron checkpoint: dist_checkpointing save after a step, load into a fresh engine: weights,
   every Adam state tensor and the version back exactly, the HF export loads in transformers, and
   the next step as close to the saving engine's as a rerun without a checkpoint is.
9. Megatron memory release and resume (a pool's moves, bf16): both tags leave the GPU after a step
   and come back bit for bit; the next step is the one an engine that never released takes.
Checks 2 to 9 run train.megatron's defaults (attention=sdpa, full recompute);
scripts/gpu_attention_checks.py holds them to Megatron's unfused attention.
One line per check; OUT_DIR/ and results/gpu_checks.json; exit 1 if a check failed (gpu_algo_checks.py: the algo knobs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from rlctl.engines.train.base import TrainSample  # noqa: E402
from gpu_common import (TWO_LAYERS, build_model, free_port, megatron_engine, report, run_checks, samples,  # noqa: E402
                        torch_engine)

def check_engines(work: Path) -> None:
    """Checks 1 to 4, on one small model whose norms are away from 1."""
    shape = {**TWO_LAYERS, "num_hidden_layers": 4}
    model_dir = build_model(work / "small", torch.float32, **shape)
    check_round_trip(model_dir)
    batch = check_against_torch(model_dir, samples(shape["vocab_size"]))
    check_accumulation(model_dir, batch)


def check_qwen2(work: Path) -> None:
    """6. Checks 1 to 3 on a Qwen2-architecture model (q/k/v biases, no qk-norm)."""
    shape = {**TWO_LAYERS, "num_hidden_layers": 4, "tie_word_embeddings": True}  # head_dim 32 as Qwen2 derives it
    model_dir = build_model(work / "small-qwen2", torch.float32, arch="qwen2", **shape)
    check_round_trip(model_dir, tag="Qwen2, ")
    check_against_torch(model_dir, samples(shape["vocab_size"], seed=1), tag="Qwen2, ")


def adam_states(engine) -> list[dict]:
    """Every Adam state tensor of a Megatron engine's (distributed) optimizer, on the CPU."""
    out = []
    for opt in getattr(engine.optimizer, "chained_optimizers", [engine.optimizer]):
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                state = opt.optimizer.state[p]
                out.append({k: v.detach().float().cpu().clone() for k, v in state.items() if torch.is_tensor(v)}
                           | {"param": p.detach().float().cpu().clone()})
    return out


def check_checkpoint(work: Path) -> None:
    """8. Megatron's checkpoint (dist_checkpointing + the HF export): saved after a step and
    loaded into a fresh engine, the weights, every Adam state tensor (exp_avg, exp_avg_sq, step,
    the fp32 shard) and the version come back exactly, and the HF directory loads in
    transformers; and the next step matches the saving engine's as closely as the same two
    steps run again without a checkpoint do (they are bit-identical on the H200)."""
    import shutil

    from transformers import AutoModelForCausalLM

    shape = TWO_LAYERS
    model_dir = build_model(work / "small-ckpt", torch.float32, **shape)
    batch = samples(shape["vocab_size"], seed=2)
    half = len(batch) // 2
    ckpt = work / "ckpt-megatron"
    shutil.rmtree(ckpt, ignore_errors=True)
    saver = megatron_engine(model_dir, "float32", lr=1e-3)
    saver.train_batch(batch[:half])
    saver.save_checkpoint(str(ckpt))
    saved = {n: t.detach().cpu().clone() for n, t in saver.hf_weights()}
    saved_adam = adam_states(saver)
    saver.train_batch(batch[half:])
    after = {n: t.detach().cpu().clone() for n, t in saver.hf_weights()}
    del saver
    loader = megatron_engine(model_dir, "float32", lr=1e-3)
    info = loader.load_checkpoint(str(ckpt))
    same = all(torch.equal(t.detach().cpu(), saved[n]) for n, t in loader.hf_weights())
    loaded_adam = adam_states(loader)
    adam_same = len(loaded_adam) == len(saved_adam) and all(
        a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a) for a, b in zip(saved_adam, loaded_adam))
    exported = AutoModelForCausalLM.from_pretrained(ckpt / "hf", dtype=torch.float32).state_dict()
    hf_same = all(torch.equal(exported[n], t) for n, t in saved.items() if n in exported)
    loader.train_batch(batch[half:])
    diff = max((t.detach().cpu() - after[n]).abs().max().item() for n, t in loader.hf_weights())
    del loader
    again = megatron_engine(model_dir, "float32", lr=1e-3)  # the same two steps with no checkpoint between
    again.train_batch(batch[:half])
    again.train_batch(batch[half:])
    noise = max((t.detach().cpu() - after[n]).abs().max().item() for n, t in again.hf_weights())
    exact = same and adam_same and hf_same and info["version"] == 1.0
    report("Megatron checkpoint: save, load, next step", exact and diff <= max(noise, 1e-6),
           weights_back_exactly=same, adam_state_back_exactly=adam_same, adam_tensors=len(saved_adam),
           hf_export_equal=hf_same, version=info["version"], next_step_max_abs_diff=diff,
           same_two_steps_rerun_max_abs_diff=noise)


def check_memory(work: Path) -> None:
    """9. release_memory / resume_memory of the Megatron engine (rlctl/engines/train/megatron_memory.py)."""
    model_dir = build_model(work / "small-memory", torch.float32, **TWO_LAYERS)
    batch = samples(TWO_LAYERS["vocab_size"], seed=3)
    half = len(batch) // 2
    moved = megatron_engine(model_dir, "bfloat16", lr=1e-3)
    moved.train_batch(batch[:half])
    held = lambda e: [t.detach().cpu().clone() for t in e._buffers() + e._optimizer_tensors()]  # noqa: E731
    before, adam = held(moved), adam_states(moved)
    full = torch.cuda.memory_allocated()  # what the caching allocator has handed out: no sync needed
    out = moved.release_memory(None)
    emptied = torch.cuda.memory_allocated()
    released = moved.memory_resident()
    back = moved.resume_memory(None)
    exact = all(torch.equal(a, b) for a, b in zip(before, held(moved), strict=True))
    adam_same = all(a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
                    for a, b in zip(adam, adam_states(moved), strict=True))
    moved.train_batch(batch[half:])
    after = {n: t.detach().cpu().clone() for n, t in moved.hf_weights()}
    kept = megatron_engine(model_dir, "bfloat16", lr=1e-3)  # the same two steps, never released
    kept.train_batch(batch[:half])
    kept.train_batch(batch[half:])
    diff = max((t.detach().cpu() - after[n]).abs().max().item() for n, t in kept.hf_weights())
    ok = (exact and adam_same and out["released"] == ["weights", "optimizer"] and not any(released.values())
          and back["resumed"] == ["weights", "optimizer"] and full - emptied >= 0.99 * out["bytes"] and diff == 0.0)
    report("Megatron memory: release, resume bit for bit, next step", ok, bytes_moved=out["bytes"],
           allocated_before=full, allocated_released=emptied, release_s=out["seconds"], resume_s=back["seconds"],
           tensors_back_exactly=exact, adam_state_back_exactly=adam_same, next_step_max_abs_diff=diff)


def check_round_trip(model_dir: Path, tag: str = "") -> None:
    """1. HF -> Megatron -> HF, in fp32 and bf16: every tensor back exactly."""
    from safetensors.torch import load_file

    on_disk = load_file(str(model_dir / "model.safetensors"))
    for dtype in ("float32", "bfloat16"):
        eng = megatron_engine(model_dir, dtype)
        exported = dict(eng.hf_weights())
        # In bf16, Megatron keeps the norm weights in fp32: each tensor must equal the HF one in
        # the dtype the model holds it in (bf16 matrices are the HF values rounded once).
        want = {n: t.to(exported[n].dtype if n in exported else getattr(torch, dtype)) for n, t in on_disk.items()}
        differ = sorted(n for n in want if n not in exported or not torch.equal(exported[n].cpu(), want[n]))
        dtypes = sorted({str(t.dtype) for t in exported.values()})
        report(f"round trip HF->Megatron->HF ({tag}{dtype})", not differ and set(exported) == set(want), tensors=len(exported),
               differ=len(differ), first_differ=differ[0] if differ else "-", exported_dtypes="/".join(dtypes))
        del eng


def check_against_torch(model_dir: Path, batch: list[TrainSample], tag: str = "") -> list[TrainSample]:
    """2. log-probs and 3. one GRPO step of each engine. Returns the batch with the torch engine's
    log-probs as the behaviour policy (ratio 1 at the start), for the checks after it."""
    te = torch_engine(model_dir)
    ref = te.logprobs(batch)
    batch = [TrainSample(s.prompt_ids, s.response_ids, s.advantage, lp, 0) for s, lp in zip(batch, ref)]
    for dtype in ("float32", "bfloat16"):
        me = megatron_engine(model_dir, dtype)
        got = me.logprobs(batch)
        diff = max(abs(a - b) for x, y in zip(got, ref) for a, b in zip(x, y))
        report(f"log-probs Megatron vs torch ({tag}{dtype})", diff <= 1e-4 if dtype == "float32" else None, max_abs_diff=diff)
        if dtype == "float32":
            m_stats = me.train_batch(batch)
            t_stats = te.train_batch(batch)
            rel = abs(m_stats["loss"] - t_stats["loss"]) / max(abs(t_stats["loss"]), 1e-12)
            after = dict(me.hf_weights())
            wdiff = max(float((after[n].float().cpu() - p.detach().float().cpu()).abs().max())
                        for n, p in te.model.named_parameters())
            lp_after = max(abs(a - b) for x, y in zip(me.logprobs(batch), te.logprobs(batch)) for a, b in zip(x, y))
            report(f"one GRPO step, Megatron vs torch ({tag}float32)", rel <= 1e-3, loss_megatron=m_stats["loss"],
                   loss_torch=t_stats["loss"], rel_diff=rel, weights_max_abs_diff_after=wdiff,
                   logprobs_max_abs_diff_after=lp_after, grad_norm_megatron=m_stats["grad_norm"],
                   grad_norm_torch=t_stats["grad_norm"])
        del me
    return batch


def check_accumulation(model_dir: Path, batch: list[TrainSample]) -> None:
    """4. A train batch accumulated in pieces (rolloutpipe's streaming) gives the one-piece gradient.

    Gradients, not weights after the step, are compared: Adam's first update, g / (|g| + eps),
    turns the last-bit rounding of a near-zero gradient into a change of order lr."""
    from megatron.core.distributed import finalize_model_grads

    grads, stats = {}, {}
    for pieces in (1, 3):
        me = megatron_engine(model_dir, "float32")
        for i in range(pieces):
            me.accumulate(batch[i::pieces])
        total = sum(len(s.response_ids) for s in batch)
        finalize_model_grads([me.ddp])  # what step() does before the optimizer
        me.ddp.scale_gradients(1.0 / total)
        grads[pieces] = {n: p.main_grad.float().cpu().clone() for n, p in me.model.named_parameters()}
        stats[pieces] = me._acc["loss"] / total
        del me
    scale = max(float(g.abs().max()) for g in grads[1].values())
    gdiff = max(float((grads[1][n] - grads[3][n]).abs().max()) for n in grads[1])
    norm1 = sum(float(g.double().pow(2).sum()) for g in grads[1].values()) ** 0.5
    norm3 = sum(float(g.double().pow(2).sum()) for g in grads[3].values()) ** 0.5
    report("Megatron: batch in 3 accumulate calls vs 1 (float32)", gdiff <= 1e-5 * scale and abs(stats[1] - stats[3]) <= 1e-5 * abs(stats[1]),
           grad_max_abs_diff=gdiff, grad_max_abs=scale, grad_norm_1=norm1, grad_norm_3=norm3,
           loss_1=stats[1], loss_3=stats[3])


def check_local_run(out: Path) -> None:
    runs = out / "runs"
    cmd = [sys.executable, "-m", "rlctl", "launch", str(REPO / "recipes" / "quickstart.yaml"), "run.steps=8",
           "train.engine=megatron", "train.device=cuda", "rollout.device=cuda", "train.megatron.dtype=float32",
           "pipeline.mode=rolloutpipe", "pipeline.admission=frontier", "pipeline.check_weights=true",
           f"run.output_dir={runs}"]
    start = time.monotonic()
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=400)
    seconds = time.monotonic() - start
    if res.returncode != 0:
        report("local run, megatron trainer + 2 built-in servers on one GPU", False, seconds=seconds,
               error=res.stderr.strip().splitlines()[-1][:300] if res.stderr.strip() else "")
        return
    run_dir = next(runs.iterdir())
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    checked = [e for e in events if e["event"] == "weights_checked"]
    pieces = sum(e["event"] == "accumulate_end" for e in events)
    said = re.search(r"weight sync to \d+ server\(s\) by (\w+)", (run_dir / "logs" / "trainer-0.log").read_text())
    # The final policy (Megatron's save_policy): its version is the last optimizer step's, and
    # transformers loads it.
    final = json.loads((run_dir / "final" / "final.json").read_text())
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(run_dir / "final" / "hf")
    final_ok = final == {"steps": 8, "version": metrics[-1]["optimizer_steps"]}
    # One check after the initial sync (version 0) and one after each of the 8 steps.
    report("local run, megatron trainer + 2 built-in servers on one GPU",
           len(checked) == 1 + 8 and len(metrics) == 8 and final_ok, final_policy=final,
           steps=len(metrics), syncs_checked=len(checked), accumulate_calls=pieces, seconds=seconds,
           sync_backend=said[1] if said else "?", sync_time_median=sorted(m["sync_time"] for m in metrics)[len(metrics) // 2],
           reward_first=metrics[0]["reward_mean"], reward_last=metrics[-1]["reward_mean"],
           step_time_median=sorted(m["step_time"] for m in metrics)[len(metrics) // 2])


def check_broadcast(work: Path) -> None:
    """The Qwen3-0.6B shape (bf16) to a built-in server on the trainer's GPU, by gloo (staged
    through host memory) and by CUDA IPC, per bucket size; after each backend, every tensor the
    server holds is checked equal to the trainer's."""
    import aiohttp

    from rlctl.engines.rollout.client import RolloutClient
    from rlctl.engines.weightsync import WeightSender, tensor_sha256

    shape = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, max_position_embeddings=4096, tie_word_embeddings=True)
    model_dir = build_model(work / "qwen3-0.6b-shape", torch.bfloat16, **shape)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda()
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "rlctl.engines.rollout.builtin.server", "--model-path", str(model_dir),
                               "--port", str(port), "--device", "cuda:0", "--dtype", "bfloat16"],
                              stdout=open(work / "server.log", "wb"), stderr=subprocess.STDOUT, cwd=REPO)
    try:
        async def scenario():
            async with aiohttp.ClientSession() as s:
                c = RolloutClient(f"http://127.0.0.1:{port}", s)
                await c.wait_healthy(300)
                for backend, sizes in (("gloo", (64, 256, 1024)), ("ipc", (64, 256, 1024, 2048))):
                    with torch.no_grad():
                        for p in model.parameters():
                            p.add_(0.001)  # new weights for each backend: a check that can fail
                    weights = [(n, p.detach()) for n, p in model.named_parameters()]
                    nbytes = sum(t.numel() * t.element_size() for _, t in weights)
                    for bucket_mb in sizes:
                        sender = WeightSender([c], master_address="127.0.0.1", master_port=free_port(), backend=backend,
                                              bucket_bytes=bucket_mb << 20)
                        await sender.connect()
                        times = [(await sender.send(weights, version=f"{backend}-{bucket_mb}-{rep}")).seconds
                                 for rep in range(3)]
                        await sender.close()
                        best = min(times[1:])  # the first sync makes the buffers, as a run's first does
                        ok = None if backend == "gloo" else best <= 0.1
                        report(f"weight sync, {nbytes / 1e9:.2f} GB bf16, {backend}, bucket {bucket_mb} MiB", ok,
                               seconds=best, first_seconds=times[0], gb_per_s=nbytes / best / 1e9)
                    want = {n: tensor_sha256(t) for n, t in weights}
                    got = (await c.weight_checksums())["checksums"]
                    wrong = [n for n in want if got.get(n) != want[n]]
                    report(f"weight sync by {backend}: every tensor equal", not wrong, tensors=len(want), differing=len(wrong))
        asyncio.run(scenario())
    finally:
        server.kill()
        server.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-checks-out")))
    p.add_argument("--only", default="engines,qwen2,checkpoint,memory,run,broadcast")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    work = Path("/tmp/rlctl-gpu-checks")
    work.mkdir(exist_ok=True)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}", flush=True)
    steps = {"engines": lambda: check_engines(work), "qwen2": lambda: check_qwen2(work), "run": lambda: check_local_run(a.out),
             "broadcast": lambda: check_broadcast(work), "checkpoint": lambda: check_checkpoint(work),
             "memory": lambda: check_memory(work)}
    run_checks(steps, a.only.split(","), a.out / "gpu_checks.json")


if __name__ == "__main__":
    main()
