"""Long samples on rlctl's Megatron trainer, for the GPU machine: peak memory and time of one
forward and backward per sample length and per train.megatron setting (attention x recompute),
next to transformers' own model with SDPA attention and next to the planner's prediction.

    python -m pip install --no-deps --target /tmp/deps .device-wheels/*.whl   # megatron-core, omegaconf
    PYTHONPATH=$PWD:/tmp/deps python scripts/gpu_long_samples.py [--lengths 2048,4096,...] [--settings ...]

The model: Qwen3-1.7B's shape (hidden 2048, 28 layers, 16 heads, 8 KV heads, FFN 6144, vocab
151936, tied embeddings), random weights, bf16; --model qwen3-4b: Qwen3-4B's (hidden 2560, 36
layers, 32 heads, FFN 9728), results/gpu_long_samples-qwen3-4b.json. One sample of each length (256 prompt tokens,
the rest response), trained by MegatronTrainEngine.accumulate() and step() as a run trains it.
For each setting and length: a warm-up accumulate() and step() (the optimizer's state is made at
the first step), then the measured accumulate():
- peak: torch.cuda.max_memory_allocated() during it, the optimizer state resident; step peak: the
  same during the optimizer step that follows (the optimizer's temporaries);
- fwd+bwd: that peak less the optimizer state (what transformers' column holds: weights,
  gradients and the pass itself);
- seconds: its wall time, synchronized;
- plan: costs/memory.py's trainer_memory for the same recipe keys and micro-batch, in total and
  less its optimizer part, and how far the measured peak is from it.
A length that runs out of memory is written "OOM" and the longer ones are not tried. Each setting
runs in a process of its own (Megatron keeps buffers and groups in module globals).
transformers: Qwen3ForCausalLM (attn_implementation="sdpa", bf16) on the same weights, forward
with labels and backward, peak and time of the second of two passes.

Writes results/gpu_long_samples.json (commit, date, machine) and prints the table.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from artifact import write_artifact  # noqa: E402
from rlctl.engines.train.base import TrainSample  # noqa: E402
from rlctl.process.topology import free_ports  # noqa: E402
from rlctl.recipe import MegatronAttention, MegatronConfig, Recompute, TrainConfig  # noqa: E402

GIB = 1024**3
QWEN3_1_7B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                  tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6)
MODELS = {"qwen3-1.7b": QWEN3_1_7B,
          "qwen3-4b": {**QWEN3_1_7B, "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
                       "num_attention_heads": 32}}
"""Qwen3-1.7B's shape (the planner's constants were measured on it) and Qwen3-4B's (a shape they
were not: how well they carry over)."""
SETTINGS = {
    "sdpa/full": (MegatronAttention.SDPA, Recompute.FULL),
    "sdpa/none": (MegatronAttention.SDPA, Recompute.NONE),
    "local/full": (MegatronAttention.LOCAL, Recompute.FULL),
    "local/selective": (MegatronAttention.LOCAL, Recompute.SELECTIVE),
    "local/none": (MegatronAttention.LOCAL, Recompute.NONE),
}
PROMPT = 256


def build_model(path: Path, shape: dict) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if (path / "config.json").exists():
        return path
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(Qwen3Config(**shape)).to(torch.bfloat16)
    model.save_pretrained(path)
    del model
    torch.cuda.empty_cache()
    return path


def sample(length: int, vocab: int, seed: int) -> TrainSample:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (length,), generator=g).tolist()
    r = length - PROMPT
    return TrainSample(ids[:PROMPT], ids[PROMPT:], advantage=1.0, logprobs=[-1.0] * r, weight_version=0)


def engine(model_dir: Path, attention: MegatronAttention, recompute: Recompute, micro_tokens: int):
    from megatron.core import parallel_state

    from rlctl.engines.train.megatron_engine import MegatronTrainEngine

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    cfg = TrainConfig(lr=1e-6, micro_batch_tokens=micro_tokens,
                      megatron=MegatronConfig(attention=attention, recompute_granularity=recompute))
    return MegatronTrainEngine(str(model_dir), cfg, 1.0, 0, 1, device="cuda:0",
                               init_method=f"tcp://127.0.0.1:{free_ports(1)[0]}")


def plan(model_dir: Path, attention: MegatronAttention, recompute: Recompute, tokens: int) -> tuple[float, float]:
    """(the planner's bytes per GPU, the same less the optimizer) for this trainer."""
    from rlctl.costs.memory import TrainLayout, trainer_memory
    from rlctl.costs.shape import model_shape
    from rlctl.recipe import recipe_from_yaml

    recipe = recipe_from_yaml(  # one sample of `tokens`: PROMPT of prompt, the rest response (its S x S scores)
        f"model: {{path: {model_dir}}}\nrollout: {{engine: sglang, sampling: {{max_new_tokens: {tokens - PROMPT}}}}}\n"
        f"sim: {{prompt_tokens: {PROMPT}}}\n"
        f"train: {{engine: megatron, device: cuda, micro_batch_tokens: {tokens}, "
        f"megatron: {{attention: {attention.value}, recompute_granularity: {recompute.value}}}}}\n", "gpu_long_samples")
    m = trainer_memory(recipe, model_shape(recipe), TrainLayout(micro_batch_tokens=tokens), tokens)
    return m.total, m.total - m.parts["optimizer"]


def measure(fn, *args) -> tuple[float, float]:
    """(peak bytes, seconds) of fn(*args) on the GPU."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    fn(*args)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated(), time.perf_counter() - start


def free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def megatron_rows(model_dir: Path, name: str, lengths: list[int]) -> list[dict]:
    attention, recompute = SETTINGS[name]
    eng = engine(model_dir, attention, recompute, max(lengths))
    rows, failed = [], None
    for n in lengths:
        predicted, predicted_pass = plan(model_dir, attention, recompute, n)
        row = {"setting": name, "tokens": n, "plan_gib": predicted / GIB, "plan_fwd_bwd_gib": predicted_pass / GIB}
        if failed:
            rows.append({**row, "oom": True, "skipped_after": failed})
            continue
        s = sample(n, QWEN3_1_7B["vocab_size"], seed=n)
        try:
            eng.accumulate([s])
            eng.step()
            peak, seconds = measure(eng.accumulate, [s])
            step_peak, _ = measure(eng.step)
        except torch.OutOfMemoryError:
            failed = n
            eng.ddp.zero_grad_buffer()
            from rlctl.engines.train.base import new_accumulator

            eng._acc = new_accumulator()
            free()
            rows.append({**row, "oom": True})
            continue
        opt = eng.memory()["optimizer_bytes"]
        top = max(peak, step_peak)  # the optimizer step's temporaries may top the micro-batch's peak
        rows.append({**row, "oom": False, "peak_gib": peak / GIB, "step_peak_gib": step_peak / GIB,
                     "fwd_bwd_gib": (peak - opt) / GIB, "seconds": seconds, "plan_error": (predicted - top) / top})
        free()
    del eng
    free()
    return rows


def hf_pass(model, ids: torch.Tensor) -> None:
    model(input_ids=ids, labels=ids).loss.backward()


def hf_rows(model_dir: Path, lengths: list[int]) -> list[dict]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa").cuda()
    model.train()
    rows = []
    for n in lengths:
        s = sample(n, QWEN3_1_7B["vocab_size"], seed=n)
        ids = torch.tensor([s.prompt_ids + s.response_ids], device="cuda")

        try:
            hf_pass(model, ids)
            model.zero_grad(set_to_none=False)
            peak, seconds = measure(hf_pass, model, ids)
            model.zero_grad(set_to_none=False)
            rows.append({"setting": "hf/sdpa", "tokens": n, "oom": False, "peak_gib": peak / GIB, "fwd_bwd_gib": peak / GIB,
                         "seconds": seconds})
        except torch.OutOfMemoryError:
            rows.append({"setting": "hf/sdpa", "tokens": n, "oom": True})
        model.zero_grad(set_to_none=False)
        free()
    del model
    free()
    return rows


def table(rows: list[dict]) -> str:
    hf = {r["tokens"]: r for r in rows if r["setting"] == "hf/sdpa" and not r["oom"]}
    out = [f"{'setting':16} {'tokens':>6} {'peak GiB':>9} {'step GiB':>9} {'fwd+bwd':>8} {'x HF':>5} {'s':>6} {'x HF':>5} "
           f"{'plan GiB':>9} {'plan err':>8}"]
    for r in rows:
        if r["oom"]:
            why = f"not run (OOM at {r['skipped_after']})" if r.get("skipped_after") else "OOM"
            out.append(f"{r['setting']:16} {r['tokens']:>6} {why:>46} {r.get('plan_gib', float('nan')):>9.1f}")
            continue
        h = hf.get(r["tokens"])
        mem_x = f"{r['fwd_bwd_gib'] / h['fwd_bwd_gib']:.2f}" if h else "-"
        time_x = f"{r['seconds'] / h['seconds']:.2f}" if h else "-"
        plan = f"{r['plan_gib']:>9.1f} {r['plan_error']:>+8.1%}" if "plan_gib" in r else f"{'-':>9} {'-':>8}"
        step = f"{r['step_peak_gib']:>9.1f}" if "step_peak_gib" in r else f"{'-':>9}"
        out.append(f"{r['setting']:16} {r['tokens']:>6} {r['peak_gib']:>9.1f} {step} {r['fwd_bwd_gib']:>8.1f} {mem_x:>5} "
                   f"{r['seconds']:>6.2f} {time_x:>5} {plan}")
    return "\n".join(out)


def one(name: str, model_dir: Path, lengths: list[int]) -> list[dict]:
    return hf_rows(model_dir, lengths) if name == "hf/sdpa" else megatron_rows(model_dir, name, lengths)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="2048,4096,8192,16384,32768")
    p.add_argument("--settings", default=",".join(["hf/sdpa", *SETTINGS]))
    p.add_argument("--work", type=Path, default=Path("/tmp/rlctl-long-samples"))
    p.add_argument("--model", choices=sorted(MODELS), default="qwen3-1.7b")
    p.add_argument("--one", help=argparse.SUPPRESS)  # a child process: one setting, rows as JSON to --rows
    p.add_argument("--rows", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    model_dir = a.work / f"{a.model}-shape"
    if a.one:
        a.rows.write_text(json.dumps(one(a.one, model_dir, lengths)))
        return
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}", flush=True)
    build_model(model_dir, MODELS[a.model])
    rows = []
    for name in a.settings.split(","):  # each in a process of its own: nothing of one setting is left for the next
        out = a.work / f"rows-{a.model}-{name.replace('/', '-')}.json"
        out.unlink(missing_ok=True)
        child = subprocess.run([sys.executable, __file__, "--one", name, "--rows", str(out), "--lengths", a.lengths,
                                "--work", str(a.work), "--model", a.model], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if child.returncode or not out.exists():
            print(f"{name}: failed ({child.returncode}): {child.stderr[-2000:]}", flush=True)
            continue
        rows += json.loads(out.read_text())
        print(table([r for r in rows if r["setting"] in ("hf/sdpa", name)]), flush=True)
    print(table(rows), flush=True)
    name = "gpu_long_samples" + ("" if a.model == "qwen3-1.7b" else f"-{a.model}")
    write_artifact(name, {"model": a.model, "shape": MODELS[a.model], "prompt_tokens": PROMPT, "rows": rows,
                                        "device": torch.cuda.get_device_name(0), "torch": torch.__version__})


if __name__ == "__main__":
    main()
