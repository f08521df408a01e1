"""Fit the cost model to a measured run, so that `rlctl simulate` predicts this machine.

From the run's events (pure functions of them, plus the model's parameter count):
- training: the controller-observed duration of each train batch against the tokens it holds
  (prompt + response), by least squares: seconds = overhead + tokens * 6 * params / (F * mfu);
- decoding: per step and server, the sum of request durations over the tokens they produced is
  the time of one decode step at the mean concurrency seen; what the roofline model does not
  explain of it becomes the per-step overhead (on a CPU, Python and framework overhead dominate);
- lengths: without the long-tail workload, responses end at EOS well before the cap, so the
  simulation uses the measured median response length as its fixed length.
The result is a list of `sim.*` overrides; anything else in the recipe stays as it is.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from rlctl.errors import UsageError
from rlctl.metrics.spans import SpanKind, SpanPairer
from rlctl.recipe import Device, GpuKind, load_recipe
from rlctl.run.dir import RunDir
from rlctl.costs.model import HARDWARE, CostModel, ModelShape, algo_passes


def _least_squares(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Intercept and slope of y = a + b x (slope only through the origin when x does not vary)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return 0.0, my / mx if mx else 0.0
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - b * mx, b


def calibrate_run(run: RunDir) -> dict[str, Any]:
    """calibrate() on a measured run directory, with its servers, trainer ranks and workload."""
    info = run.read()
    procs = info.get("processes", {})
    recipe = load_recipe(run.recipe_path, check_paths=False)
    passes, critic = algo_passes(recipe)
    on_gpu = recipe.train.device is Device.CUDA
    return calibrate(run.events(), info["model_path"], servers=sum(r.startswith("rollout-") for r in procs),
                     trainer_ranks=sum(r.startswith("trainer-") for r in procs),
                     long_tail=recipe.rollout.sampling.long_tail.enabled,
                     flops_per_token=6 + 2 * passes + (8 if critic else 0),
                     gpu=recipe.sim.gpu if on_gpu else GpuKind.CPU,
                     max_running=recipe.rollout.max_running_requests)


def calibrate(events: list[dict[str, Any]], model_dir: str, servers: int, trainer_ranks: int,
              long_tail: bool, flops_per_token: float = 6.0, gpu: GpuKind = GpuKind.CPU,
              max_running: int | None = None) -> dict[str, Any]:
    """sim.* overrides (and the fixed response length) that make the cost model fit the events of
    a run on `gpu` (the recipe's sim.gpu for a run on CUDA: its kind is not recorded).
    `flops_per_token` per parameter: 6, plus the algorithm's extra passes (costs/model.py, algo_passes)."""
    hw = HARDWARE[gpu]
    params = model_parameters(model_dir)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    layers = int(config["num_hidden_layers"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_dim = int(config.get("num_key_value_heads", config["num_attention_heads"])) * int(head_dim)
    completed = [e for e in events if e["event"] == "group_completed"]
    if not completed:
        raise UsageError("--calibrate: the run has no completed groups; calibrate on a run that finished a step")
    prompt_tokens = round(statistics.fmean(e.get("prompt_tokens", 0) for e in completed)) or 1

    per_call, overhead, per_token = _train_cost(events, prompt_tokens)
    mfu_train = flops_per_token * params / (per_token * hw.bf16_flops * trainer_ranks) if per_token > 0 else 1.0
    step_s, concurrency = _decode_step(completed, max_running)
    lengths = sorted(n for e in completed for n in e["lengths"])
    context = prompt_tokens + max(1, lengths[len(lengths) // 2])
    shape = ModelShape.from_params_b(params / 1e9, layers=layers, kv_dim=kv_dim)
    model = CostModel(hw, shape, mean_context_tokens=context)
    base = model.decode_step_seconds(max(1, round(concurrency)))
    # The servers' busy time held the prefills too, which the cost model charges apart: per step,
    # the batch's requests' prefills spread over their tokens.
    step_s -= concurrency * model.prefill_seconds(prompt_tokens) / max(1.0, statistics.fmean(lengths))

    overrides = {
        "sim.gpu": gpu,
        "sim.params_b": params / 1e9,
        "sim.rollout_gpus": servers,
        "sim.trainer_gpus": trainer_ranks,
        "sim.tp": 1,
        "sim.prompt_tokens": prompt_tokens,
        "sim.context_tokens": context,
        "sim.layers": layers,
        "sim.kv_dim": kv_dim,
        "sim.hidden": int(config["hidden_size"]),
        "sim.vocab": int(config["vocab_size"]),
        "sim.reward_rate": statistics.fmean(r for e in completed for r in e["rewards"]),
        "sim.mfu_train": mfu_train,
        "sim.train_step_overhead_s": max(0.0, overhead),
        "sim.decode_step_overhead_s": max(0.0, step_s - base),
    }
    if per_call is not None:  # told apart from the step only when accumulate calls were seen
        overrides["sim.layer_launch_s"] = max(0.0, per_call) / layers
    if not long_tail:
        overrides["rollout.sampling.max_new_tokens"] = max(1, lengths[len(lengths) // 2])
    return overrides


def _train_cost(events: list[dict[str, Any]], prompt_tokens: int) -> tuple[float | None, float, float]:
    """(seconds per trainer call or None, seconds per optimizer step, seconds per token), one point per
    trainer call. A streamed train batch is accumulate calls and a final call that also steps;
    train_end counts the whole batch, so the final call's share is the rest. With calls of both
    kinds, y = call + step x [it steps] + per_token x tokens is fitted by least squares; with
    train calls only, a call and its step cannot be told apart and all goes to the step."""
    xs, ys, steps = [], [], []
    pieces: dict[tuple[int, int], tuple[float, float]] = {}
    pairer = SpanPairer()
    for e in sorted(events, key=lambda e: e["t"]):
        span = pairer.observe(e)
        if span is None or span.kind not in (SpanKind.TRAIN, SpanKind.ACCUMULATE):
            continue
        key = (e["step"], e["batch"])
        tokens, samples = e["tokens"], e["samples"]
        done_tokens, done_samples = pieces.get(key, (0.0, 0.0))
        if span.kind is SpanKind.ACCUMULATE:
            pieces[key] = (done_tokens + tokens, done_samples + samples)
        else:
            tokens, samples = tokens - done_tokens, samples - done_samples
        xs.append(tokens + samples * prompt_tokens)
        ys.append(span.seconds)
        steps.append(float(span.kind is SpanKind.TRAIN))
    if statistics.pstdev(xs) < 0.1 * statistics.fmean(xs):
        # Every batch about the same size: overhead and per-token cost cannot be told apart, and
        # need not be for batches of that size; charge it all per token.
        return None, 0.0, statistics.fmean(ys) / statistics.fmean(xs)
    if 0 < sum(steps) < len(steps):
        fitted = _least_squares_steps(xs, steps, ys)
        if fitted is not None:
            return fitted
    overhead, per_token = _least_squares(xs, ys)
    return None, overhead, per_token


def _least_squares_steps(xs: list[float], steps: list[float], ys: list[float]) -> tuple[float, float, float] | None:
    """(a, s, b) of y = a + s * step + b * x by the normal equations; None when singular."""
    rows = [(1.0, st, x) for x, st in zip(xs, steps, strict=True)]
    ata = [[sum(r[i] * r[j] for r in rows) for j in range(3)] for i in range(3)]
    aty = [sum(r[i] * y for r, y in zip(rows, ys, strict=True)) for i in range(3)]

    def det(m: list[list[float]]) -> float:
        return (m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1]) - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
                + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0]))

    d = det(ata)
    if abs(d) < 1e-12 * max(1.0, abs(ata[0][0] * ata[1][1] * ata[2][2])):
        return None
    solved = []
    for col in range(3):  # Cramer's rule
        m = [row[:] for row in ata]
        for i in range(3):
            m[i][col] = aty[i]
        solved.append(det(m) / d)
    return solved[0], solved[1], solved[2]


def _decode_step(completed: list[dict[str, Any]], max_running: int | None) -> tuple[float, float]:
    """(seconds, running batch) of one decode step: medians over each step and server. A request's
    span runs from when it was sent, so it includes its wait in the server's queue when more were
    sent than the server runs at once: the server ran min(outstanding, max_running) requests at
    each moment, each getting a token per step, so a step took the integral of that over time /
    tokens; the batch is its mean over the time the server was busy."""
    per_step: list[tuple[float, float]] = []
    by_key: dict[tuple[int, str], list[tuple[float, float, int]]] = {}
    for e in completed:
        for server, a, b, n in zip(e["servers"], e["starts"], e["ends"], e["lengths"]):
            by_key.setdefault((e["step"], server), []).append((a, b, n))
    for intervals in by_key.values():
        tokens = sum(n for _, _, n in intervals)
        running, busy = _running_integral([(a, b) for a, b, _ in intervals], max_running or math.inf)
        if tokens and busy > 0:
            per_step.append((running / tokens, running / busy))
    return statistics.median(s for s, _ in per_step), statistics.median(c for _, c in per_step)


def _running_integral(spans: list[tuple[float, float]], cap: float) -> tuple[float, float]:
    """(integral over time of min(requests outstanding, cap), time with any outstanding)."""
    edges = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans])
    area = busy = 0.0
    outstanding, last = 0, edges[0][0] if edges else 0.0
    for t, step in edges:
        if outstanding:
            area += min(outstanding, cap) * (t - last)
            busy += t - last
        outstanding, last = outstanding + step, t
    return area, busy


def model_parameters(model_dir: str) -> int:
    """Parameter count of a local HF model, from its safetensors headers (no tensors are read)."""
    import math
    import struct

    total = 0
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise UsageError(f"--calibrate: {model_dir}: no safetensors files to count parameters from; "
                         "calibrate on a run whose model directory still exists")
    for f in files:
        with f.open("rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
        total += sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")
    return total
