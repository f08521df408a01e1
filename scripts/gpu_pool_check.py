"""Megatron trainers in a pool, on the GPU machine:

    python -m pip install --no-deps --target /tmp/deps .device-wheels/*.whl   # megatron-core, omegaconf
    PYTHONPATH=$PWD:/tmp/deps python scripts/gpu_pool_check.py --out OUT_DIR

A one-GPU pool (recipes/pool/gpu.yaml) with a memory cap that holds one run's models but not two
runs' (memory_gb): two quickstart runs with train.engine=megatron (one fp32, one bf16) and their
built-in servers on the GPU, pipeline.check_weights=true (after every weight sync each server's
tensors hash like the trainer's). The pool must move the trainers' memory out and back between
their turns (release_memory / resume_memory, rlctl/engines/train/megatron_memory.py) for both
runs to finish. Prints what each run did and the pool's moves; writes OUT_DIR/gpu_pool_check.json
and results/gpu_pool_check.json.
Exit 1 unless both runs completed with every sync checked and the pool moved a Megatron trainer.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from artifact import write_artifact

REPO = Path(__file__).resolve().parents[1]


def rlctl(*args: str, cwd: Path) -> str:
    res = subprocess.run([sys.executable, "-m", "rlctl", *args], cwd=cwd, capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        raise SystemExit(f"rlctl {' '.join(args[:2])} failed: {res.stderr.strip()[-800:]}")
    return res.stdout.strip()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--memory-gb", type=float, default=0.012, help="the pool's cap (the runs' estimates: ~8 MB each)")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    rlctl("pool", "up", str(REPO / "recipes" / "pool" / "gpu.yaml"), f"pool.devices.memory_gb={a.memory_gb}",
          "pool.quantum_s=1", cwd=a.out)
    try:
        common = [str(REPO / "recipes" / "quickstart.yaml"), f"run.steps={a.steps}", "train.engine=megatron",
                  "train.device=cuda", "rollout.device=cuda", "pipeline.check_weights=true", "launcher=pool",
                  "pool.name=gpu", "--detach"]
        ids = [rlctl("launch", *common, "train.megatron.dtype=float32", "run.name=fp32", cwd=a.out).splitlines()[-1],
               rlctl("launch", *common, "train.megatron.dtype=bfloat16", "run.name=bf16", "run.seed=1",
                     cwd=a.out).splitlines()[-1]]
        deadline = time.monotonic() + 500
        while time.monotonic() < deadline:
            infos = [json.loads((a.out / "runs" / r / "run.json").read_text()) for r in ids]
            if all(i["state"] in ("completed", "failed", "cancelled") for i in infos):
                break
            time.sleep(1)
    finally:
        rlctl("pool", "down", "gpu", cwd=a.out)
    events = [json.loads(x) for x in (a.out / "pools" / "gpu" / "events.jsonl").read_text().splitlines() if x]
    moves = [e for e in events if e["event"] == "move" and e["model"] == "trainer"]
    result = {"moves_of_trainers": len(moves), "moved_bytes": sum(e.get("bytes", 0) for e in moves),
              "move_s": [round(e["seconds"], 3) for e in moves][:12], "runs": {}}
    ok = bool(moves) and all(e["ok"] for e in moves)
    for rid, info in zip(ids, infos, strict=True):
        run_events = [json.loads(x) for x in (a.out / "runs" / rid / "events.jsonl").read_text().splitlines() if x]
        checked = sum(e["event"] == "weights_checked" for e in run_events)
        result["runs"][rid] = {"state": info["state"], "reason": info.get("exit_reason"), "syncs_checked": checked,
                               "usage": (info.get("pool") or {}).get("usage")}
        ok = ok and info["state"] == "completed" and checked == a.steps + 1
    result["ok"] = ok
    print(json.dumps(result, indent=2))
    (a.out / "gpu_pool_check.json").write_text(json.dumps(result, indent=2))
    write_artifact("gpu_pool_check", {"steps": a.steps, "memory_gb": a.memory_gb, **result})
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
