"""Multi-GPU checks in one go, for a host with 2+ GPUs (nvidia-h200-x2 or larger):

    python -m pip install --no-deps --target /tmp/deps .device-wheels/*.whl
    NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD:/tmp/deps python scripts/multigpu_checks.py --out OUT_DIR

1. broadcast: a Qwen3-1.7B-shaped bf16 model sent by rlctl's WeightSender (HTTP announce + NCCL
   buckets) from GPU 0 to a built-in rollout server on each other GPU, for 3 bucket sizes, next to
   a plain NCCL broadcast of the same bytes from GPU 0 to the same GPUs, measured in the same run.
2. pipelines: scripts/bench_pipelines.py on the long-tail GPU workload (recipes/bench-longtail-gpu.yaml)
   with the trainer on GPU 0 and one built-in server on each other GPU, weight sync over NCCL:
   sync vs rolloutpipe (frontier and fifo admission).
3. megatron-tp2: Megatron with TP=2 on GPUs 0-1, two servers on GPUs 2-3 (one server on GPU 1 when
   the host has 2 GPUs), NCCL sync, pipeline.check_weights=true (each server's tensors hash like
   the trainer's after every sync).
`--cpu` runs check 1 on CPU with gloo and a tiny model: a smoke test of this script.
Prints one line per check and writes OUT_DIR/multigpu_checks.json and results/multigpu_checks.json
(--cpu: multigpu_checks-cpu; --only: multigpu_checks-ONLY); check 2 also writes
results/bench_pipelines-bench-longtail-gpu-NGPU.json (N: the GPUs of the host).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gpu_common import REPO, build_model, free_port, report, run_checks  # noqa: E402  (beside this script)


def _plain_receiver(rank: int, world: int, port: int, nbytes: int, device: str, backend: str, reps: int) -> None:
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(minutes=5))
    dev = torch.device(f"cuda:{rank}") if device == "cuda" else torch.device("cpu")
    buf = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    for _ in range(reps):
        dist.broadcast(buf, src=0)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    dist.destroy_process_group()


def plain_broadcast(nbytes: int, receivers: int, device: str, backend: str, reps: int = 3) -> float:
    """Seconds of the fastest of `reps` broadcasts of nbytes from rank 0 to `receivers` ranks."""
    port = free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_plain_receiver, args=(r, receivers + 1, port, nbytes, device, backend, reps))
             for r in range(1, receivers + 1)]
    for p in procs:
        p.start()
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=receivers + 1,
                            timeout=timedelta(minutes=5))
    buf = torch.ones(nbytes, dtype=torch.uint8, device="cuda:0" if device == "cuda" else "cpu")
    best = float("inf")
    for _ in range(reps):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        dist.broadcast(buf, src=0)
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    dist.destroy_process_group()
    for p in procs:
        p.join()
    return best


def check_broadcast(work: Path, cpu: bool) -> None:
    import aiohttp

    from rlctl.engines.rollout.client import RolloutClient
    from rlctl.engines.weightsync import WeightSender, tensor_sha256
    from transformers import AutoModelForCausalLM

    if cpu:
        shape = dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=64, tie_word_embeddings=True)
        receivers, backend, device, buckets = 1, "gloo", "cpu", (1, 4, 16)
    else:
        shape = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                     num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)
        receivers, backend, device, buckets = torch.cuda.device_count() - 1, "nccl", "cuda", (256, 1024, 2048)
    model_dir = work / ("tiny" if cpu else "qwen3-1.7b-shape")
    if not (model_dir / "config.json").exists():  # a 3.4 GB model is built once per machine
        build_model(model_dir, torch.bfloat16, max_position_embeddings=4096, **shape)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to("cuda:0" if not cpu else "cpu")
    weights = [(n, p.detach()) for n, p in model.named_parameters()]
    nbytes = sum(t.numel() * t.element_size() for _, t in weights)
    plain = plain_broadcast(nbytes, receivers, device, backend)
    report(f"plain {backend} broadcast, {nbytes / 1e9:.2f} GB to {receivers} rank(s)", None, seconds=plain,
           gb_per_s=nbytes / plain / 1e9)

    servers, urls = [], []
    for i in range(receivers):
        port = free_port()
        servers.append(subprocess.Popen(
            [sys.executable, "-m", "rlctl.engines.rollout.builtin.server", "--model-path", str(model_dir), "--port", str(port),
             "--device", "cpu" if cpu else f"cuda:{i + 1}", "--dtype", "bfloat16"],
            stdout=open(work / f"server-{i}.log", "wb"), stderr=subprocess.STDOUT, cwd=REPO))
        urls.append(f"http://127.0.0.1:{port}")
    try:
        async def scenario():
            async with aiohttp.ClientSession() as s:
                clients = [RolloutClient(u, s) for u in urls]
                for c in clients:
                    await c.wait_healthy(600)
                for mb in buckets:
                    sender = WeightSender(clients, master_address="127.0.0.1", master_port=free_port(), backend=backend,
                                          bucket_bytes=mb << 20)
                    await sender.connect()
                    best = min([(await sender.send(weights, version=f"{mb}-{rep}")).seconds for rep in range(3)])
                    await sender.close()
                    share = plain / best
                    report(f"rlctl weight broadcast, bucket {mb} MiB", share >= 0.85 if not cpu else None,
                           seconds=best, gb_per_s=nbytes / best / 1e9, of_plain=share)
                want = {n: tensor_sha256(t) for n, t in weights}
                for i, c in enumerate(clients):
                    got = (await c.weight_checksums())["checksums"]
                    wrong = [n for n in want if got.get(n) != want[n]]
                    report(f"server {i}: every tensor equal after the {backend} syncs", not wrong, differing=len(wrong))
        asyncio.run(scenario())
    finally:
        for p in servers:
            p.kill()
            p.wait()


def check_pipelines(out: Path) -> None:
    n = torch.cuda.device_count()
    servers = list(range(1, n))
    cmd = [sys.executable, str(REPO / "scripts" / "bench_pipelines.py"), "--recipe", str(REPO / "recipes" / "bench-longtail-gpu.yaml"),
           "--modes", "sync,rolloutpipe-frontier,rolloutpipe-fifo", "--json", str(out / "pipelines.json"),
           "--artifact", f"bench_pipelines-bench-longtail-gpu-{n}gpu",
           "train.gpus=[0]", f"rollout.gpus={servers}", f"rollout.servers={len(servers)}", "train.sync_backend=nccl"]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=1500)
    print(res.stdout, flush=True)
    ok = res.returncode == 0
    report("disaggregated bench (trainer GPU 0, servers on the rest, NCCL sync)", ok,
           error=res.stderr.strip().splitlines()[-1][:300] if not ok and res.stderr.strip() else "-")


def check_megatron_tp2(out: Path) -> None:
    # With 4+ GPUs the servers get their own; with 2 one server shares GPU 1 with trainer rank 1
    # (every NCCL group still has one rank per GPU: TP over 0-1, weight sync over 0 and 1).
    servers = [2, 3] if torch.cuda.device_count() >= 4 else [1]
    runs = out / "runs-tp2"
    cmd = [sys.executable, "-m", "rlctl", "launch", str(REPO / "recipes" / "quickstart.yaml"), "run.steps=6",
           "train.engine=megatron", "train.device=cuda", "rollout.device=cuda", "train.ranks=2", "train.megatron.tp=2",
           "train.megatron.dtype=float32", "train.gpus=[0,1]", f"rollout.gpus={servers}", f"rollout.servers={len(servers)}",
           "train.sync_backend=nccl",
           "pipeline.check_weights=true", f"run.output_dir={runs}"]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=900)
    checked = 0
    if res.returncode == 0:
        events = [json.loads(x) for x in next(runs.iterdir()).joinpath("events.jsonl").read_text().splitlines()]
        checked = sum(e["event"] == "weights_checked" for e in events)
    # one check after the initial sync (version 0) and one after each of the 6 steps
    report(f"megatron TP=2 on GPUs 0-1, servers on GPUs {servers}, weights equal after every sync", res.returncode == 0 and checked == 1 + 6,
           syncs_checked=checked, error=res.stderr.strip().splitlines()[-1][:300] if res.returncode else "-")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "multigpu-out")))
    p.add_argument("--only", default="broadcast,pipelines,megatron-tp2")
    p.add_argument("--cpu", action="store_true", help="check 1 on CPU with gloo (a smoke test of this script)")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    work = Path("/tmp/rlctl-multigpu")
    work.mkdir(exist_ok=True)
    if not a.cpu and torch.cuda.device_count() < 2:
        raise SystemExit(f"needs 2+ GPUs, this host has {torch.cuda.device_count()} (--cpu for a smoke test)")
    steps = {"broadcast": lambda: check_broadcast(work, a.cpu), "pipelines": lambda: check_pipelines(a.out),
             "megatron-tp2": lambda: check_megatron_tp2(a.out)}
    run_checks(steps, ["broadcast"] if a.cpu else a.only.split(","), a.out / "multigpu_checks.json",
               "multigpu_checks-cpu" if a.cpu else None)


if __name__ == "__main__":
    main()
