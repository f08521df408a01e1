"""rlctl's weight sync against the plain collective of the same bytes, side by side, per bucket size.

    python scripts/bench_weightsync.py [--shape qwen3-0.6b] [--dtype bfloat16] [--backend gloo]
                                       [--device cpu] [--servers 1] [--bucket-mb 64,256,1024]
                                       [--rounds 3] [--run RUN_DIR]

One model of the given shape (random weights, saved once under ~/.cache/rlctl/bench-models) is
served by --servers built-in rollout servers. For each bucket size, interleaved round by round:
- plain: this process broadcasts the model's bytes, in buckets of that size, to as many plain
  receiver processes over a group of the same backend and size: buffers allocated and touched
  once on both sides, a warm-up round, then the timed one (the collective alone, at its best);
- rlctl: rlctl's WeightSender syncs the same tensors to the servers (pause, announce each bucket
  over HTTP, broadcast, load, continue), the whole protocol the run uses; one sync to warm up (as
  every sync of a run but the first finds its buffers made), then the timed one.
With --backend ipc the servers share this process's device and the yardstick is a plain copy of
the same bytes on that device (what a server reading the trainer's memory must do at least).
The table shows the medians over rounds, GB/s, and rlctl's time as a share of the plain one's
(plain / rlctl: 1.0 = as fast as the collective alone). --run prints the median share of a step
that a run's weight syncs took (metrics.jsonl's sync_time / step_time), for the bench recipes.
Writes results/bench_weightsync-BACKEND-DEVICE.json (e.g. bench_weightsync-ipc-cuda), the shape,
the servers and the bucket format added to the name when they are not the defaults.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from artifact import write_artifact

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SHAPES = {  # Qwen3 configurations: the real 0.6B's shape, and smaller ones for a quick look
    "qwen3-0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "small": dict(vocab_size=32768, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_dir(shape: str, dtype: str) -> Path:
    """A random model of this shape and dtype, built once."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    path = Path.home() / ".cache" / "rlctl" / "bench-models" / f"{shape}-{dtype}"
    if (path / "config.json").is_file():
        return path
    torch.manual_seed(0)
    cfg = Qwen3Config(max_position_embeddings=4096, **SHAPES[shape])
    model = Qwen3ForCausalLM(cfg).to(getattr(torch, dtype))
    model.save_pretrained(path)
    return path


def trainer_weights(path: Path, device: str) -> list:
    """The weights as the torch trainer holds them: every named parameter (tied embeddings once),
    all views of one buffer (rlctl/engines/weightsync/flat.py)."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlctl.engines.weightsync.flat import flatten_parameters

    model = AutoModelForCausalLM.from_pretrained(path, dtype="auto").to(device)
    flatten_parameters(model)
    with torch.no_grad():
        return [(n, p.detach()) for n, p in model.named_parameters()]


def receiver(init: str, rank: int, world: int, backend: str, device: str, sizes: list[int], rounds: int) -> None:
    """A plain receiver: join the group, then receive `rounds` times buckets of these sizes."""
    import torch
    import torch.distributed as dist

    from rlctl.engines.weightsync import init_custom_process_group

    torch.set_num_threads(1)
    group = init_custom_process_group(backend=backend, init_method=init, world_size=world, rank=rank,
                                      group_name="plain")
    bufs = [torch.zeros(n, dtype=torch.uint8, device=device) for n in sizes]  # allocated and touched once
    for _ in range(rounds):
        for b in bufs:
            dist.broadcast(b, src=0, group=group)
    dist.barrier(group=group)


def bucket_sizes(weights: list, bucket_bytes: int) -> list[int]:
    from rlctl.engines.weightsync import TensorMeta, dtype_name, plan_buckets

    metas = [TensorMeta(n, dtype_name(t.dtype), tuple(t.shape), t.numel() * t.element_size()) for n, t in weights]
    return [sum(m.nbytes for m in b) for b in plan_buckets(metas, bucket_bytes)]


def plain_copy(weights: list, a: argparse.Namespace, bucket_bytes: int) -> float:
    """IPC's yardstick: one copy of the model's bytes, bucket by bucket, into buffers of this
    process on the same device (a server reading the trainer's memory copies no faster)."""
    import torch

    sizes = bucket_sizes(weights, bucket_bytes)
    src = [torch.ones(n, dtype=torch.uint8, device=a.device) for n in sizes]
    dst = [torch.zeros(n, dtype=torch.uint8, device=a.device) for n in sizes]
    for _ in range(2):  # a warm-up round first, as the best case
        if a.device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        for s, d in zip(src, dst, strict=True):
            d.copy_(s)
        if a.device.startswith("cuda"):
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    return seconds


def plain(weights: list, a: argparse.Namespace, bucket_bytes: int) -> float:
    """One plain broadcast of the model's bytes in buckets of bucket_bytes; its seconds."""
    import torch
    import torch.distributed as dist

    if a.backend == "ipc":
        return plain_copy(weights, a, bucket_bytes)

    from rlctl.engines.weightsync import destroy_process_group, init_custom_process_group

    sizes = bucket_sizes(weights, bucket_bytes)
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = [subprocess.Popen([sys.executable, __file__, "--receiver", init, str(r + 1), str(a.servers + 1), a.backend,
                               a.device, ",".join(map(str, sizes))], cwd=REPO) for r in range(a.servers)]
    group = init_custom_process_group(backend=a.backend, init_method=init, world_size=a.servers + 1, rank=0,
                                      group_name="plain")
    bufs = [torch.ones(n, dtype=torch.uint8, device=a.device) for n in sizes]  # the bytes, in memory, ready
    for _timed in (False, True):  # a warm-up round first, as the best case of the collective alone
        if a.device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        for b in bufs:
            dist.broadcast(b, src=0, group=group)
        if a.device.startswith("cuda"):
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    dist.barrier(group=group)
    destroy_process_group(group)
    for p in procs:
        p.wait(timeout=120)
    return seconds


async def rlctl_sync(clients: list, weights: list, a: argparse.Namespace, bucket_bytes: int, version: str) -> float:
    from rlctl.engines.weightsync import WeightSender

    sender = WeightSender(clients, master_address="127.0.0.1", master_port=free_port(), backend=a.backend,
                          bucket_bytes=bucket_bytes, flattened=a.format == "flattened")
    await sender.connect()
    try:
        await sender.send(weights, version=version + "-warm")  # as in a run: buffers made by an earlier sync
        stats = await sender.send(weights, version=version)
    finally:
        await sender.close()
    return stats.seconds


async def measure(a: argparse.Namespace, weights: list, ports: list[int]) -> dict[int, dict[str, list[float]]]:
    import aiohttp

    from rlctl.engines.rollout.client import RolloutClient

    out: dict[int, dict[str, list[float]]] = {mb: {"plain": [], "rlctl": []} for mb in a.bucket_mb}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        clients = [RolloutClient(f"http://127.0.0.1:{p}", session) for p in ports]
        for c in clients:
            await c.wait_healthy(600)
        for r in range(a.rounds):
            for mb in a.bucket_mb:
                out[mb]["plain"].append(await asyncio.get_running_loop().run_in_executor(
                    None, plain, weights, a, mb << 20))
                out[mb]["rlctl"].append(await rlctl_sync(clients, weights, a, mb << 20, f"{mb}-{r}"))
                print(f"round {r}, {mb} MiB: plain {out[mb]['plain'][-1]:.3f} s, rlctl {out[mb]['rlctl'][-1]:.3f} s",
                      flush=True)
    return out


def run_share(run: Path) -> dict | None:
    """Prints and returns the median share of a step that the run's weight syncs took."""
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    shares = [m["sync_time"] / m["step_time"] for m in metrics[1:] if m.get("step_time")]
    if not shares:
        print(f"{run}: no steps to read")
        return None
    out = {"run": run.name, "steps": len(shares), "sync_share_of_step": statistics.median(shares),
           "sync_s": statistics.median(m["sync_time"] for m in metrics[1:])}
    print(f"{run.name}: weight sync is {out['sync_share_of_step']:.1%} of a step (median over {len(shares)} steps; "
          f"sync {out['sync_s']:.3f} s)")
    return out


def artifact_name(a: argparse.Namespace) -> str:
    name = f"bench_weightsync-{a.backend}-{a.device.split(':')[0]}"
    name += "" if a.shape == "qwen3-0.6b" else f"-{a.shape}"
    name += "" if a.servers == 1 else f"-{a.servers}servers"
    return name + ("" if a.format == "flattened" else f"-{a.format}")


def table(a: argparse.Namespace, out: dict[int, dict[str, list[float]]], nbytes: int, tensors: int) -> dict:
    """Prints the medians per bucket size; returns them with every round's seconds."""
    print(f"\n{a.shape} {a.dtype}: {nbytes / 1e9:.2f} GB in {tensors} tensors; {a.backend} on {a.device}, "
          f"1 sender + {a.servers} receiver(s); rlctl's buckets {a.format}; medians over {a.rounds} round(s)")
    print(f"{'bucket MiB':>10} {'plain s':>9} {'plain GB/s':>10} {'rlctl s':>9} {'rlctl GB/s':>10} {'rlctl/plain':>11}")
    buckets = {}
    for mb, t in out.items():
        pl, rl = statistics.median(t["plain"]), statistics.median(t["rlctl"])
        buckets[mb] = {"plain_s": t["plain"], "rlctl_s": t["rlctl"], "plain_median_s": pl, "rlctl_median_s": rl,
                       "plain_gb_per_s": nbytes / pl / 1e9, "rlctl_gb_per_s": nbytes / rl / 1e9, "plain_over_rlctl": pl / rl}
        print(f"{mb:>10} {pl:>9.3f} {nbytes / pl / 1e9:>10.2f} {rl:>9.3f} {nbytes / rl / 1e9:>10.2f} {pl / rl:>11.2f}")
    return {"shape": a.shape, "dtype": a.dtype, "bytes": nbytes, "tensors": tensors, "backend": a.backend,
            "device": a.device, "servers": a.servers, "format": a.format, "rounds": a.rounds, "buckets_mib": buckets}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--receiver":
        init, rank, world, backend, device, sizes = sys.argv[2:8]
        receiver(init, int(rank), int(world), backend, device, [int(s) for s in sizes.split(",")], 2)
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--backend", choices=["gloo", "nccl", "ipc"], default="gloo")
    p.add_argument("--device", default="cpu")
    p.add_argument("--servers", type=int, default=1)
    p.add_argument("--bucket-mb", type=lambda s: [int(x) for x in s.split(",")], default=[64, 256, 1024])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--format", choices=["flattened", "tensors"], default="flattened",
                   help="rlctl's buckets: one flattened uint8 tensor each (what a run sends), or tensor by tensor")
    p.add_argument("--run", type=Path, default=None)
    a = p.parse_args()
    import torch

    torch.set_num_threads(1)
    path = model_dir(a.shape, a.dtype)
    weights = trainer_weights(path, a.device)
    nbytes = sum(t.numel() * t.element_size() for _, t in weights)
    ports = [free_port() for _ in range(a.servers)]
    servers = [subprocess.Popen([sys.executable, "-m", "rlctl.engines.rollout.builtin.server", "--model-path", str(path),
                                 "--port", str(port), "--device", a.device, "--dtype", a.dtype],
                                cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for port in ports]
    try:
        out = asyncio.run(measure(a, weights, ports))
    finally:
        for s in servers:
            s.kill()
            s.wait()
    figures = table(a, out, nbytes, len(weights))
    figures["run_share"] = run_share(a.run) if a.run else None
    write_artifact(artifact_name(a), figures)


if __name__ == "__main__":
    main()
