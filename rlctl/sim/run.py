"""The simulation's composition root: a recipe -> its pipeline on simulated engines, in virtual
time, recorded by the same Recorder as a real run.

`simulate_run` keeps the events in memory unless given a run directory, where they stream to
events.jsonl (and the records to metrics.jsonl) as the simulation goes.
"""

from __future__ import annotations

import gc
import os
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rlctl.metrics import KeptEvents, Recorder
from rlctl.data import Prompt, PromptStream
from rlctl.pipelines.build import build_pipeline
from rlctl.pipelines.evaluation import Evaluator, LoadedSet, read_set, set_sampling
from rlctl.pipelines.scoring import Score, inline_scorer
from rlctl.pipelines.servers import ServerSet
from rlctl.rewards.verifiers import scored_by
from rlctl.costs.recipe import cost_model
from rlctl.recipe import DataConfig, DataSource, EvalSet, Recipe, recipe_to_yaml
from rlctl.run.dir import SIMULATION_PREFIX, EventLog, RunDir, RunState, create_run_dir
from rlctl.sim.engines import SimRollout, SimTrainer
from rlctl.sim.loop import VirtualClock, run_virtual
from rlctl.sim.tools import sim_multi_turn


@dataclass
class SimulationResult:
    metrics: list[dict[str, Any]]
    """One record per step, as metrics.jsonl has them."""
    wall_seconds: float
    virtual_seconds: float
    """The time of the last event."""
    events: list[dict[str, Any]] | None
    """Every event, when the simulation kept them in memory (no run directory)."""
    evals: list[dict[str, Any]]
    """One record per held-out set per evaluation, as eval.jsonl has them."""


def simulate_run(recipe: Recipe, rd: RunDir | None = None,
                 on_step: Callable[[dict[str, Any]], None] | None = None) -> SimulationResult:
    """Run the recipe's pipeline in virtual time; with `rd`, record into that run directory.
    `on_step` sees each step's record as it is written (progress, benchmarks)."""
    sim = recipe.sim
    cost = cost_model(recipe)
    servers = [SimRollout(f"rollout-{i}", cost, recipe.rollout.max_running_requests)
               for i in range(sim.rollout_gpus // sim.tp)]
    metrics: list[dict[str, Any]] = []

    def on_record(record: dict[str, Any]) -> None:
        metrics.append(record)
        if rd is not None:
            rd.append_metrics(record)
        if on_step is not None:
            on_step(record)

    kept = KeptEvents() if rd is None else None
    recorder = Recorder(kept if rd is None else EventLog(rd.events_path), on_record)
    rng = random.Random(recipe.run.seed)
    prompt = [0] * sim.prompt_tokens
    clock, server_set = VirtualClock(), ServerSet(servers)
    score = inline_scorer(lambda ids: "", scored_by(lambda response, answer: float(rng.random() < sim.reward_rate)))
    # Simulated servers see token counts, not text: the prompts come from a built-in task (or
    # sim.dataset_prompts made-up rows), so a recipe whose data lives on a cluster's filesystem
    # simulates anywhere.
    prompts = None
    if sim.dataset_prompts:
        rows = [Prompt(-1, f"simulated prompt {i}", "") for i in range(sim.dataset_prompts)]
        prompts = PromptStream(DataConfig(source=DataSource.FILE), recipe.run.seed, rows=rows)
    multi_turn = sim_multi_turn(recipe, random.Random(recipe.run.seed + 1))
    pipeline = build_pipeline(
        replace(recipe, data=DataConfig()), servers, SimTrainer(cost, servers), clock, recorder.emit, lambda step: None,
        tokenize=lambda _: prompt, score=score, server_set=server_set, prompts=prompts,
        multi_turn=multi_turn,
    )
    evals: list[dict[str, Any]] = []
    sets = [simulated_set(recipe, s, prompt, score) for s in recipe.eval.sets]
    if any(sets):

        def on_eval(record: dict[str, Any]) -> None:
            evals.append(record)
            if rd is not None:
                rd.append_eval(record)

        pipeline.evaluate = Evaluator(recipe.eval, [s for s in sets if s], server_set,
                                      recipe.rollout.concurrency * len(servers), recorder.emit, clock,
                                      recorder.evaluated(on_eval), clock.now, multi_turn=multi_turn)
    start = time.perf_counter()
    # Small, acyclic objects (samples, groups) come and go by the hundred thousand each step: the
    # cyclic collector would only rescan them. Reference counting frees them; collect at the end.
    gc.disable()
    try:
        run_virtual(pipeline.run(recipe.run.steps))
    finally:
        gc.enable()
        recorder.close(completed=recorder.recorded == recipe.run.steps)
    return SimulationResult(metrics, time.perf_counter() - start, recorder.t_last, kept, evals)


def simulated_set(recipe: Recipe, s: EvalSet, prompt: list[int], score: Score) -> LoadedSet | None:
    """An eval set on simulated servers: its file's prompts when the file is on this machine, else
    `limit` prompts (None when neither says how many), each `sim.prompt_tokens` long."""
    prompts = read_set(s) if Path(s.path).expanduser().exists() else [Prompt(i, "", "") for i in range(s.limit)]
    if not prompts:
        return None
    return LoadedSet(s.label, prompts, [prompt] * len(prompts), set_sampling(recipe, s), s.samples, score)


def simulate_into_run_dir(recipe: Recipe, recipe_file: Path, overrides: list[str]) -> tuple[RunDir, SimulationResult]:
    """A run directory like a real run's (launcher `simulate`), named sim-<run.name>-... so that a
    name finds the recipe's real runs, not its simulations (rundir.SIMULATION_PREFIX). The
    simulation records into a hidden staging directory next to it, which becomes the run
    directory once the simulation is done: a run with no process behind it would look failed to
    `rlctl status` while it ran."""
    output_dir = Path(recipe.run.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".simulating-", dir=output_dir) as staging:
        result = simulate_run(recipe, RunDir(Path(staging)))
        info = {"launcher": "simulate", "mode": recipe.pipeline.mode, "steps_total": recipe.run.steps,
                "recipe_file": str(recipe_file), "overrides": overrides, "plan": None, "model_path": None,
                "simulation": {"wall_seconds": result.wall_seconds, "virtual_seconds": result.virtual_seconds}}
        rd = create_run_dir(output_dir, SIMULATION_PREFIX + recipe.run.name, recipe_to_yaml(recipe), info,
                            shared_group=recipe.run.shared_group)
        for recorded in (Path(staging) / "events.jsonl", Path(staging) / "metrics.jsonl", Path(staging) / "eval.jsonl"):
            if recorded.exists():
                os.replace(recorded, rd.path / recorded.name)
    rd.set_state(RunState.COMPLETED, "simulation done")
    return rd, result
