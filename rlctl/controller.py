"""The controller process: connects the pipeline to real servers and the trainer, and records.

It waits for every server and the trainer, has the trainer form the weight-sync group with the
servers, runs the pipeline for `run.steps` steps, and after each step appends that step's
metrics (computed from the events) to metrics.jsonl.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import aiohttp

from rlctl.engines.rollout.client import GenerateOutput, RolloutClient, SamplingRequest
from rlctl.errors import RunError
from rlctl.metrics import step_metrics
from rlctl.pipelines.build import build_pipeline
from rlctl.pipelines.core import MonotonicClock
from rlctl.plan import RunPlan
from rlctl.recipe import Recipe
from rlctl.rewards.verifiers import make_verifier
from rlctl.rundir import RunDir

log = logging.getLogger("rlctl.controller")

READY_TIMEOUT_S = 300.0


class NamedServer:
    """A RolloutClient under its role name (rollout-0, ...), as the scheduler's Rollout."""

    def __init__(self, name: str, client: RolloutClient) -> None:
        self.name = name
        self.client = client

    async def generate(self, input_ids: list[int], sampling: SamplingRequest, rid: str,
                       return_logprob: bool = True) -> GenerateOutput:
        return await self.client.generate(input_ids, sampling, rid, return_logprob)

    async def abort(self, rid: str) -> None:
        await self.client.abort(rid)


def sync_backend(recipe) -> str:
    """The weight-sync group's backend: train.sync_backend, or with `auto` NCCL when trainer and
    servers are on GPUs of different hosts (a Slurm run), gloo otherwise: NCCL refuses two ranks
    on one GPU, which a one-machine run may well have."""
    if recipe.train.sync_backend != "auto":
        return recipe.train.sync_backend
    on_gpus = recipe.train.device == "cuda" and (recipe.rollout.device == "cuda" or recipe.rollout.engine == "sglang")
    return "nccl" if on_gpus and recipe.launcher == "slurm" else "gloo"


class CheckedTrainer:
    """pipeline.check_weights: after every weight sync, the sha256 of every tensor on each server
    must equal the trainer's (built-in servers; slow, for tests and debugging)."""

    def __init__(self, trainer: TrainerClient, clients: list[RolloutClient], emit, clock) -> None:
        self.trainer, self.clients, self.emit, self.clock = trainer, clients, emit, clock

    async def accumulate(self, samples: list[dict[str, Any]]) -> dict[str, float]:
        return await self.trainer.accumulate(samples)

    async def train(self, samples: list[dict[str, Any]]) -> dict[str, float]:
        return await self.trainer.train(samples)

    async def sync_weights(self, version: int, pause_mode: str = "abort") -> dict[str, Any]:
        stats = await self.trainer.sync_weights(version, pause_mode)
        want = (await self.trainer.weight_checksums())["checksums"]
        for c in self.clients:
            got = (await c.weight_checksums())["checksums"]
            wrong = [n for n, h in want.items() if got.get(n) != h]
            if wrong:
                raise RunError(f"after the sync to version {version}, {c.url} differs from the trainer in "
                               f"{len(wrong)} of {len(want)} tensors (first: {wrong[0]})")
        self.emit("weights_checked", self.clock.now(), version=version, tensors=len(want), servers=len(self.clients))
        return stats


class TrainerClient:
    """The controller's side of the trainer service (engines/train/service.py)."""

    def __init__(self, url: str, session: aiohttp.ClientSession) -> None:
        self.url = url
        self.session = session

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            async with self.session.post(self.url + path, json=body) as resp:
                text = await resp.text()
                if resp.status != 200:  # the trainer's own errors are JSON, aiohttp's 500 page is not
                    raise RunError(f"trainer {path}: HTTP {resp.status}: {text.strip()[:300]}; see the trainer's log")
                return json.loads(text)
        except aiohttp.ClientError as e:
            raise RunError(f"trainer {self.url}{path}: unreachable ({e})") from None

    async def wait_healthy(self, timeout_s: float) -> None:
        probe = RolloutClient(self.url, self.session)  # same /health semantics
        await probe.wait_healthy(timeout_s)

    async def weight_checksums(self) -> dict[str, Any]:
        async with self.session.get(self.url + "/weight_checksums") as resp:
            return await resp.json()

    async def init_weight_sync(self, servers: list[str], master_address: str, master_port: int,
                               backend: str, bucket_mb: float, api_key: str = "") -> None:
        await self._post("/init_weight_sync", {"servers": servers, "master_address": master_address,
                                               "master_port": master_port, "backend": backend,
                                               "bucket_mb": bucket_mb, "api_key": api_key})

    async def accumulate(self, samples: list[dict[str, Any]]) -> dict[str, float]:
        return await self._post("/accumulate", {"samples": samples})

    async def train(self, samples: list[dict[str, Any]]) -> dict[str, float]:
        return await self._post("/train", {"samples": samples})

    async def sync_weights(self, version: int, pause_mode: str = "abort") -> dict[str, Any]:
        return await self._post("/sync_weights", {"version": str(version), "pause_mode": pause_mode})


async def run_controller(rd: RunDir, recipe: Recipe, plan: RunPlan, model_path: str) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    events: list[dict[str, Any]] = []

    def emit(kind: str, t: float, **fields: Any) -> None:
        events.append({"t": t, "event": kind, **fields})
        rd.event(kind, t=t, **fields)

    from rlctl.tracking import make_tracker

    tracker = make_tracker(rd, recipe)

    def on_step_end(step: int) -> None:
        m = step_metrics(events, step)
        m["time"] = time.time()
        rd.append_metrics(m)
        if tracker is not None:
            tracker.log_step(m)
        log.info("step %d: reward %.3f, step time %.2f s (rollout %.2f, train %.2f, sync %.2f)",
                 step, m["reward_mean"], m["step_time"], m["rollout_time"], m["train_time"], m["sync_time"])

    clock = MonotonicClock()
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        api_key = recipe.rollout.sglang.api_key if recipe.rollout.engine == "sglang" else ""
        clients = [RolloutClient(url, session, api_key or None) for url in plan.server_urls]
        for c in clients:
            await c.wait_healthy(READY_TIMEOUT_S)
        if recipe.rollout.engine == "sglang":
            from rlctl.engines.rollout.sglang import speaks

            for c in clients:
                info = await c.server_info()
                log.info("%s: SGLang %s (%s)", c.url, info.get("version"), speaks(str(info.get("version", ""))))
        trainer = TrainerClient(plan.trainer_url, session)
        await trainer.wait_healthy(READY_TIMEOUT_S)
        await trainer.init_weight_sync(plan.server_urls, plan.trainers[0].host, plan.weight_sync_port,
                                       backend=sync_backend(recipe), bucket_mb=recipe.train.sync_bucket_mb,
                                       api_key=api_key)
        emit("run_start", clock.now(), steps=recipe.run.steps, mode=recipe.pipeline.mode)
        if recipe.pipeline.check_weights:
            trainer = CheckedTrainer(trainer, clients, emit, clock)
        servers = [NamedServer(r.name, c) for r, c in zip(plan.rollout, clients)]
        pipeline = build_pipeline(
            recipe, servers, trainer, clock, emit, on_step_end,
            tokenize=lambda text: tokenizer(text)["input_ids"],
            detokenize=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
            verify=make_verifier(recipe.reward),
        )
        try:
            await pipeline.run(recipe.run.steps)
        finally:
            if tracker is not None:
                tracker.finish(ok=len(rd.metrics()) == recipe.run.steps)
