"""Admission policies on their own (rlctl/pipelines/admission.py): which waiting request goes to
the servers next, and what the length-aware one learns (rlctl/pipelines/lengths.py). The policies
in whole runs are in test_pipelines.py; their effect on step time in scripts/bench_pipelines.py."""

from __future__ import annotations

import asyncio

import pytest

from rlctl.pipelines.admission import FrontierAdmission, LongestAdmission, make_admission
from rlctl.pipelines.lengths import LengthModel
from rlctl.recipe import Admission


def admitted_order(admission, requests: list[tuple[tuple[int, int], str]]) -> list[tuple[int, int]]:
    """Fill the bound with a held request, queue `requests`, then free one slot at a time: the
    order the waiting requests are let through. Driven by events, never by waiting: a task calls
    acquire() in the same step as it says it is queuing (acquire queues before it awaits), and
    each slot freed lets exactly one waiting request through, which says so."""
    order: list[tuple[int, int]] = []
    queued, admitted = asyncio.Event(), asyncio.Event()

    async def one(key, prompt, last):
        if last:
            queued.set()  # the tasks run in order: every earlier one has queued already
        await admission.acquire(key, prompt)
        order.append(key)
        admitted.set()

    async def main():
        await admission.acquire((-1, 0))  # the bound is 1: everything else waits
        tasks = [asyncio.create_task(one(k, p, i == len(requests) - 1)) for i, (k, p) in enumerate(requests)]
        await queued.wait()
        for _ in requests:
            admitted.clear()
            admission.release()
            await admitted.wait()
        await asyncio.gather(*tasks)

    asyncio.run(main())
    return order


def test_the_length_model_expects_a_prompts_mean_shrunk_toward_the_runs():
    m = LengthModel(max_prompts=2)
    assert m.expected_tokens("a") == 0.0  # nothing seen
    m.finished("a", 100)
    m.finished("a", 300)
    m.finished("b", 20)
    assert m.mean_tokens == 140
    assert m.expected_tokens("a") == pytest.approx((400 + 140) / 3)
    assert m.expected_tokens("never seen") == 140
    m.finished("c", 40)  # a third prompt: the least recently seen one ("a") is forgotten
    assert m.expected_tokens("a") == m.mean_tokens


def test_longest_admission_keeps_frontiers_batch_order_and_goes_longest_first_within_a_batch():
    lengths = LengthModel()
    for prompt, tokens in [("long", 900), ("long", 1100), ("short", 10), ("mid", 300)]:
        lengths.finished(prompt, tokens)
    requests = [((0, 0), "short"), ((1, 0), "mid"), ((1, 1), "mid"), ((2, 0), "long"),  # batch 0 (2 groups a batch)
                ((3, 0), "new"), ((4, 0), "long"), ((5, 0), "short")]  # batch 1, batch 2
    longest = admitted_order(LongestAdmission(1, groups_per_batch=2, lengths=lengths), requests)
    # batch 0: groups 0 and 1; batch 1: groups 2 and 3 (a prompt never seen expects the mean, 462)
    assert longest == [(1, 0), (1, 1), (0, 0), (2, 0), (3, 0), (4, 0), (5, 0)]
    assert admitted_order(FrontierAdmission(1), requests) == sorted(k for k, _ in requests)


def test_every_policy_is_made_from_the_recipe_and_learns_only_if_length_aware():
    assert type(make_admission(Admission.FRONTIER, 4)) is FrontierAdmission
    longest = make_admission(Admission.LONGEST, 4, groups_per_batch=8)
    assert isinstance(longest, LongestAdmission) and longest.bound == 4 and longest.groups_per_batch == 8
    longest.finished("p", 50)
    assert longest.lengths.expected_tokens("p") == 50
    make_admission(Admission.FIFO, 4).finished("p", 50)  # the others take the call and keep nothing
