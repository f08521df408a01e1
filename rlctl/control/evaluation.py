"""A run's held-out evaluations (the eval section, rlctl/recipe/eval.py) as the controller makes
them: each set read and rendered (the run's chat template) when the run starts, so a malformed
row fails the start, not the first evaluation, and scored by the run's scoring processes or, for
a set with a reward section of its own, by its own. The Evaluator (rlctl/pipelines/evaluation.py)
records each evaluation as an eval_start / eval_end event pair (a span of the trace), one record
in the run directory's eval.jsonl and the tracker (wandb: eval/<set>/<metric>); `rlctl status`
and `rlctl compare` read eval.jsonl (rlctl/run/evals.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlctl.data.chat import PromptRenderer
from rlctl.pipelines.episode import MultiTurn
from rlctl.pipelines.evaluation import Evaluator, LoadedSet, read_set, set_sampling
from rlctl.pipelines.interfaces import Clock, EventSink
from rlctl.pipelines.scoring import PooledScorer, Score
from rlctl.pipelines.servers import ServerSet
from rlctl.recipe import Recipe


def make_evaluator(recipe: Recipe, renderer: PromptRenderer, servers: ServerSet, run_score: Score,
                   emit: EventSink, clock: Clock, record: Callable[[dict[str, Any]], None],
                   wall_clock: Callable[[], float], n_servers: int, multi_turn: MultiTurn | None = None
                   ) -> Evaluator | None:
    """The recipe's evaluations (None without eval sets). A set without a reward section of its
    own is scored by the run's scorer; one with it, by a scoring process of its own. With the
    run's `multi_turn`, every response is a trajectory, as in training."""
    cfg = recipe.eval
    if not cfg.sets:
        return None
    loaded, own = [], []
    for s in cfg.sets:
        prompts = read_set(s)
        ids = [renderer.ids(p) for p in prompts]  # a prompt the template cannot render fails the start
        score: Score = run_score
        if s.reward is not None:
            scorer = PooledScorer(renderer.response_text, s.reward, workers=1)
            own.append(scorer)
            score = scorer
        loaded.append(LoadedSet(s.label, prompts, ids, set_sampling(recipe, s), s.samples, score))
    return Evaluator(cfg, loaded, servers, recipe.rollout.concurrency * max(1, n_servers), emit, clock,
                     record, wall_clock, own, multi_turn)
