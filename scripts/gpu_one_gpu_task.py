"""The shipped one-GPU recipe (recipes/one-gpu-gsm8k.yaml) on a GPU machine, with a randomly
initialized model of Qwen3-0.6B's shape (scripts/tiny_task.py --shape qwen3-0.6b: weights cannot be
downloaded there) and its GSM8K-style data: do steps run and evaluations run, and what does an
evaluation of N prompts x 4 samples add to a step?

    python scripts/gpu_one_gpu_task.py [--steps 4] [--every 2] [--max-new-tokens 256] [--eval-prompts 128] [--work DIR]

The recipe runs as shipped but for run.steps, eval.every, run.save_every=0 and the paths (and
reward.verifier=numeric on a machine without math-verify, data as JSONL without pyarrow). Prints
each step (seconds: step, rollout, train, sync; reward; response length) and each evaluation
(after how many steps, seconds, mean@4, pass@4, response length), then the median evaluation's
seconds against the median step's. The random model's answers all run to the cap, so the cap
(--max-new-tokens, 256) and the evaluation (--eval-prompts x 4 samples, 128 x 4) are smaller than
the recipe's, to fit a 10-minute call. Writes results/gpu_one_gpu_task.json (commit, date, machine).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

from artifact import write_artifact  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--every", type=int, default=2)
    ap.add_argument("--work", type=Path, default=Path("/tmp/rlctl-one-gpu"))
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--eval-prompts", type=int, default=128)
    a = ap.parse_args(argv)
    fmt = "parquet" if importlib.util.find_spec("pyarrow") else "jsonl"
    subprocess.run([sys.executable, str(REPO / "scripts" / "tiny_task.py"), "--out", str(a.work), "--shape",
                    "qwen3-0.6b", "--format", fmt], check=True)
    # A random model never ends its answers: every one runs to the cap, so the cap (and the
    # evaluation's size) is what sets the time; a trained model's answers end far sooner.
    overrides = [f"model.path={a.work / 'models' / 'qwen3-0.6b-random'}", f"data.path=data/gsm8k/train.{fmt}",
                 f"run.steps={a.steps}", f"eval.every={a.every}", "run.save_every=0",
                 f"rollout.sampling.max_new_tokens={a.max_new_tokens}",
                 f"eval.sets=[{{path: data/gsm8k/test.{fmt}, name: gsm8k-test, limit: {a.eval_prompts}, samples: 4, "
                 f"temperature: 0.6, max_new_tokens: {a.max_new_tokens}}}]"]
    if not importlib.util.find_spec("math_verify"):
        overrides.append("reward.verifier=numeric")
    res = subprocess.run([sys.executable, "-m", "rlctl", "launch", str(REPO / "recipes" / "one-gpu-gsm8k.yaml"),
                          *overrides], cwd=a.work, capture_output=True, text=True)
    print(res.stderr[-4000:])
    if res.returncode != 0:
        return res.returncode
    run = a.work / "runs" / res.stdout.strip().splitlines()[-1]
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines() if line.strip()]
    steps = [{k: m.get(k) for k in ("step", "step_time", "rollout_time", "train_time", "sync_time", "reward_mean",
                                     "response_len_mean")} for m in metrics]
    evaluations = [{k: e.get(k) for k in ("steps", "version", "seconds", "prompts", "k", "mean@4", "pass@1", "pass@4",
                                          "response_len_mean", "versions")} for e in evals]
    print(f"{'step':>4} {'step s':>7} {'rollout':>7} {'train':>7} {'sync':>6} {'reward':>7} {'resp len':>8}")
    for m in steps:
        print(f"{m['step']:>4} {m['step_time']:7.2f} {m['rollout_time']:7.2f} {m['train_time']:7.2f} "
              f"{m['sync_time']:6.2f} {m['reward_mean']:7.3f} {m['response_len_mean']:8.1f}")
    print(f"{'eval after':>10} {'seconds':>8} {'mean@4':>7} {'pass@4':>7} {'resp len':>8}")
    for e in evaluations:
        print(f"{e['steps']:>10} {e['seconds']:8.2f} {e['mean@4']:7.3f} {e['pass@4']:7.3f} {e['response_len_mean']:8.1f}")
    step_s = statistics.median(m["step_time"] for m in steps)
    eval_s = statistics.median(e["seconds"] for e in evaluations)
    print(f"an evaluation of {a.eval_prompts} prompts x 4: {eval_s:.1f} s, {eval_s / step_s:.2f}x a step's "
          f"{step_s:.1f} s (medians)")
    path = write_artifact("gpu_one_gpu_task", {"recipe": "recipes/one-gpu-gsm8k.yaml", "overrides": overrides,
                                                "steps": steps, "evaluations": evaluations,
                                                "median_step_s": step_s, "median_eval_s": eval_s,
                                                "eval_to_step": eval_s / step_s})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
