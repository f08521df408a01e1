"""Scoring off the event loop: a slow verifier must not stall the requests in flight."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from rlctl.data import Prompt
from rlctl.engines.rollout.client import RolloutClient, SamplingRequest
from rlctl.pipelines.admission import FifoAdmission
from rlctl.pipelines.core import GroupRunner, ServerSet
from rlctl.pipelines.scoring import PooledScorer, Score, inline_scorer
from rlctl.recipe import RewardConfig
from rlctl.rewards.verifiers import Scored, make_verifier
from rlctl.run.dir import RunClock

pytestmark = pytest.mark.process

SLOW_S = 0.3
TICK_S = 0.01


def slow_reward(tmp_path, monkeypatch) -> RewardConfig:
    """A user's reward function, loaded by import path, that takes SLOW_S to score and notes when
    it ran (in scorings.log), as start and end times."""
    (tmp_path / "slow_reward.py").write_text(
        "import time\n\n\n"
        "def score(response, answer):\n"
        "    start = time.time()\n"
        f"    time.sleep({SLOW_S})\n"
        f"    with open({str(tmp_path / 'scorings.log')!r}, 'a') as f:\n"
        "        f.write(f'{start} {time.time()}\\n')\n"
        "    return float(response == answer)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return RewardConfig(verifier="function", function="slow_reward:score")


async def generate(url: str, score: Score, groups: int = 3, group_size: int = 4) -> tuple[float, float]:
    """Generate and score `groups` groups on a real server; (the longest the event loop was held
    up, seconds taken)."""
    loop = asyncio.get_running_loop()
    stalls = [0.0]
    done = asyncio.Event()

    async def heartbeat() -> None:
        while not done.is_set():
            t = loop.time()
            await asyncio.sleep(TICK_S)
            stalls.append(loop.time() - t - TICK_S)

    async with aiohttp.ClientSession() as session:
        runner = GroupRunner(ServerSet([RolloutClient(url, session, name="rollout-0")]), FifoAdmission(),
                             SamplingRequest(max_new_tokens=16, ignore_eos=True), group_size,
                             tokenize=lambda text: [1, 22], score=score, clock=RunClock(),
                             emit=lambda kind, t, **fields: None)
        beat = asyncio.ensure_future(heartbeat())
        t0 = loop.time()
        await asyncio.gather(*(runner.run(runner.new_group(i, 0, Prompt(i, "max(1,2)=", "2"))) for i in range(groups)))
        seconds = loop.time() - t0
        done.set()
        await beat
    return max(stalls), seconds


def test_slow_verifier_does_not_stall_generation(start_server, tiny_model_dir, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    reward = slow_reward(tmp_path, monkeypatch)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)

    def detokenize(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    url = start_server(0, "--weight-version", "0")  # as if the run had sent its weights (version 0)
    pooled = PooledScorer(detokenize, reward, workers=4)

    async def when_ready() -> tuple[float, float]:
        await pooled.ready()
        return await generate(url, pooled)

    try:
        stall, seconds = asyncio.run(when_ready())
    finally:
        pooled.close()
    # Scoring on the loop, as the scheduler used to, holds every request up for each scoring:
    # the measure sees that.
    inline_stall, inline_seconds = asyncio.run(generate(url, inline_scorer(detokenize, make_verifier(reward))))
    assert inline_stall >= 0.9 * SLOW_S
    assert stall < SLOW_S / 3, f"the event loop stalled {stall:.3f} s while scoring in the pool"
    assert seconds < inline_seconds / 2


def test_pooled_scorings_in_flight_are_bounded(tiny_model_dir, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    reward = slow_reward(tmp_path, monkeypatch)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    responses = [tokenizer("max(1,2)=")["input_ids"][: n + 1] for n in range(8)]
    answer = tokenizer.decode(responses[3], skip_special_tokens=True)
    scorer = PooledScorer(lambda ids: tokenizer.decode(ids, skip_special_tokens=True), reward, workers=2)

    async def main() -> list[tuple[str, Scored]]:
        return await asyncio.gather(*(scorer(ids, Prompt(i, "max(1,2)=", answer)) for i, ids in enumerate(responses)))

    try:
        out = asyncio.run(main())
    finally:
        scorer.close()
    texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in responses]
    assert out == [(t, Scored(float(t == answer))) for t in texts]
    spans = [tuple(map(float, line.split())) for line in (tmp_path / "scorings.log").read_text().splitlines()]
    assert len(spans) == 8
    most = max(sum(a <= t < b for a, b in spans) for t, _ in spans)
    assert most == 2, f"{most} scorings ran at once"
