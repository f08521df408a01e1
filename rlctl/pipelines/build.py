"""Recipe -> the scheduler for its pipeline mode, over any servers and trainer (real or simulated)."""

from __future__ import annotations

import random
from collections.abc import Callable

from rlctl.data import MixedStream, Prompt, PromptStream, prompt_stream
from rlctl.engines.rollout.protocol import SamplingRequest
from rlctl.pipelines.admission import make_admission
from rlctl.pipelines.async_ import AsyncPipeline
from rlctl.pipelines.base import Pipeline
from rlctl.pipelines.core import GroupProducer, GroupRunner
from rlctl.pipelines.episode import MultiTurn
from rlctl.pipelines.groups import Shaping
from rlctl.pipelines.interfaces import Clock, EventSink, Rollout, Trainer
from rlctl.pipelines.servers import ServerSet
from rlctl.pipelines.rolloutpipe import RolloutPipePipeline
from rlctl.pipelines.scoring import Score
from rlctl.pipelines.sync import SyncPipeline
from rlctl.recipe import InflightAtUpdate, Overlong, PipelineMode, Recipe
from rlctl.rewards.failures import RewardErrors
from rlctl.workloads import LengthDistribution


def build_pipeline(recipe: Recipe, servers: list[Rollout], trainer: Trainer, clock: Clock, emit: EventSink,
                   on_step_end: Callable[[int], None], *, tokenize: Callable[[Prompt], list[int]],
                   score: Score, server_set: ServerSet | None = None,
                   prompts: PromptStream | MixedStream | None = None, multi_turn: MultiTurn | None = None) -> Pipeline:
    """The scheduler for the recipe's pipeline mode over any servers and trainer (real or simulated).
    `server_set`: the servers' ServerSet when the caller watches it (failover); one is made otherwise.
    `prompts`: the stream of prompts (by default the recipe's data). `multi_turn`: each sample a
    trajectory of turns (rollout.multi_turn; rlctl/control/multi_turn.py makes it for a run)."""
    s = recipe.rollout.sampling
    sampling = SamplingRequest(max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p,
                               top_k=s.top_k, stop_token_ids=list(s.stop_token_ids))
    lengths = None
    rngs: dict[str, random.Random] = {}
    if s.long_tail.enabled:
        lt = s.long_tail
        dist = LengthDistribution(s.max_new_tokens, lt.median_fraction, lt.sigma, lt.min_tokens, lt.truncated_fraction,
                                  lt.prompt_share)
        rng = rngs["lengths"] = random.Random(recipe.run.seed)
        lengths = lambda prompt: dist.sample(rng, prompt)  # noqa: E731
    p = recipe.pipeline
    admission = make_admission(p.admission, recipe.rollout.concurrency * len(servers), recipe.train.groups_per_batch)
    runner = GroupRunner(
        server_set or ServerSet(servers), admission, sampling, recipe.rollout.group_size, tokenize=tokenize, score=score,
        clock=clock, emit=emit, lengths=lengths,
        resume_aborted=p.mode is PipelineMode.ASYNC and p.inflight_at_update is InflightAtUpdate.ABORT_RESUME,
        reward_errors=RewardErrors.of(recipe.reward), multi_turn=multi_turn,
    )
    if prompts is None:
        prompts = prompt_stream(recipe.data, recipe.run.seed, prompt_tokens=lambda prompt: len(tokenize(prompt)))
        if prompts.rows:
            emit("data_loaded", clock.now(), rows=len(prompts.rows), left_out=prompts.left_out,
                 **({"by_source": prompts.by_source()} if isinstance(prompts, MixedStream) else {}))
    producer = GroupProducer(runner, prompts,
                             dynamic_sampling=recipe.rollout.dynamic_sampling, clock=clock, emit=emit,
                             max_equal_in_a_row=recipe.rollout.max_gen_batches * recipe.rollout.batch_size or None)
    common = dict(batch_size=recipe.rollout.batch_size, groups_per_batch=recipe.train.groups_per_batch,
                  clock=clock, emit=emit, on_step_end=on_step_end, over_provision=recipe.rollout.over_provision)
    pipeline: Pipeline
    if p.mode is PipelineMode.ASYNC:
        pipeline = AsyncPipeline(producer, trainer, admission=admission, max_staleness=p.max_staleness,
                                 sync_every=p.sync_every, inflight_at_update=p.inflight_at_update, **common)
    elif p.mode is PipelineMode.SYNC:
        pipeline = SyncPipeline(producer, trainer, **common)
    else:
        pipeline = RolloutPipePipeline(producer, trainer, stream_train=p.stream_train, **common)
    pipeline.rngs = rngs
    pipeline.shaping = shaping(recipe)
    return pipeline


def shaping(recipe: Recipe) -> Shaping:
    a = recipe.algo
    penalty = a.overlong is Overlong.PENALTY
    return Shaping(norm_by_std=a.norm_adv_by_std, max_new_tokens=recipe.rollout.sampling.max_new_tokens,
                   overlong_buffer=a.overlong_buffer if penalty else 0, overlong_penalty=a.overlong_penalty,
                   filter_truncated=a.overlong is Overlong.FILTER)
