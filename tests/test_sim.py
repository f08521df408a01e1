"""The simulation substrate: virtual-time loop, cost model, length distribution, simulated server."""

from __future__ import annotations

import asyncio
import math
import random
import time

import pytest

from rlctl.workloads import LengthDistribution
from rlctl.sim import (
    HARDWARE,
    CostModel,
    ModelShape,
    SimServer,
    SimulationDeadlock,
    VirtualClock,
    VirtualTimeLoop,
    run_virtual,
)

# --- virtual-time loop ---------------------------------------------------------------------------


def test_long_sleep_costs_no_wall_time() -> None:
    async def main() -> float:
        await asyncio.sleep(1e6)
        return asyncio.get_running_loop().time()

    t0 = time.perf_counter()
    assert run_virtual(main()) == 1e6
    assert time.perf_counter() - t0 < 10  # did not wait: a real loop would sleep 11 days


def test_timers_fire_in_order_at_their_times() -> None:
    async def main() -> list[tuple[str, float]]:
        loop = asyncio.get_running_loop()
        fired: list[tuple[str, float]] = []
        for name, delay in [("c", 3.0), ("a", 1.0), ("b1", 2.0), ("b2", 2.0), ("d", 10.5)]:
            loop.call_later(delay, lambda n=name: fired.append((n, loop.time())))
        loop.call_later(5.0, lambda: None).cancel()  # cancelled: the clock must not stop at 5
        await asyncio.sleep(20)
        return fired

    assert run_virtual(main()) == [("a", 1.0), ("b1", 2.0), ("b2", 2.0), ("c", 3.0), ("d", 10.5)]


def test_gather_of_sleeps_ends_at_the_longest() -> None:
    async def main() -> float:
        clock = VirtualClock()
        assert clock.now() == 0.0
        await asyncio.gather(asyncio.sleep(1), asyncio.sleep(2), asyncio.sleep(3))
        return clock.now()

    assert run_virtual(main()) == 3.0


def test_queue_condition_wait_for_and_futures() -> None:
    async def main() -> dict[str, object]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[int] = asyncio.Queue(maxsize=2)
        cond = asyncio.Condition()
        state = {"n": 0}
        got: list[tuple[int, float]] = []

        async def producer() -> None:
            for i in range(5):
                await asyncio.sleep(1)
                await queue.put(i)

        async def consumer() -> None:
            for _ in range(5):
                got.append((await queue.get(), loop.time()))
                async with cond:
                    state["n"] += 1
                    cond.notify_all()

        async def waiter() -> float:
            async with cond:
                await cond.wait_for(lambda: state["n"] == 5)
            return loop.time()

        fut: asyncio.Future[str] = loop.create_future()
        loop.call_later(7, fut.set_result, "done")
        tasks = [asyncio.create_task(producer()), asyncio.create_task(consumer())]
        waited = await waiter()
        await asyncio.gather(*tasks)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(loop.create_future(), timeout=100)
        t_timeout = loop.time()
        return {"got": got, "waited": waited, "fut": await fut, "t_timeout": t_timeout, "end": loop.time()}

    out = run_virtual(main())
    assert out["got"] == [(i, float(i + 1)) for i in range(5)]
    assert out["waited"] == 5.0
    assert out["t_timeout"] == 105.0
    assert out["fut"] == "done"
    assert out["end"] == 105.0


def test_deadlock_raises_instead_of_hanging() -> None:
    async def main() -> None:
        await asyncio.get_running_loop().create_future()

    with pytest.raises(SimulationDeadlock):
        run_virtual(main())


def test_run_virtual_uses_a_fresh_closed_loop() -> None:
    loops: list[asyncio.AbstractEventLoop] = []

    async def main() -> None:
        loops.append(asyncio.get_running_loop())

    run_virtual(main())
    run_virtual(main())
    assert all(isinstance(x, VirtualTimeLoop) and x.is_closed() for x in loops)
    assert loops[0] is not loops[1]


# --- cost model ----------------------------------------------------------------------------------

H200 = HARDWARE["h200"]
M7 = ModelShape.from_params_b(7)


def test_model_shape() -> None:
    assert M7.params == 7e9 and M7.weight_bytes == 14e9
    # Llama-3-8B: 32 layers, 8 KV heads of 128 -> 128 KiB per token.
    assert ModelShape.from_params_b(8, layers=32, kv_dim=1024).kv_bytes_per_token == 128 * 1024
    # The estimate from the parameter count lands within 10% of that.
    assert ModelShape.from_params_b(8).kv_bytes_per_token == pytest.approx(128 * 1024, rel=0.1)


def test_cost_model_formulas() -> None:
    cost = CostModel(H200, M7, gpus_per_server=2, trainer_gpus=8)
    kv = 2048 * M7.kv_bytes_per_token
    layers = (7e9 / (12 * 128**2)) ** (1 / 3)
    hidden = 128 * layers

    def tp2(batch):  # two all-reduces per layer of the batch's bf16 hidden states between 2 GPUs
        return 2 * layers * (1e-5 + 2 * (1 / 2) * batch * hidden * 2 / 450e9)

    # Small batches: memory-bound, weights read once per step, plus each request's KV cache.
    assert cost.decode_step_seconds(1) == pytest.approx((14e9 + kv) / (4.8e12 * 0.7 * 2) + tp2(1))
    assert cost.decode_step_seconds(64) == pytest.approx((14e9 + 64 * kv) / (4.8e12 * 0.7 * 2) + tp2(64))
    # Short contexts and large batches: compute-bound.
    short = CostModel(H200, M7, mean_context_tokens=1, decode_step_overhead_s=0.001)
    assert short.decode_step_seconds(4096) == pytest.approx(2 * 7e9 * 4096 / (989e12 * 0.5) + 0.001)
    assert cost.prefill_seconds(1000) == pytest.approx(2 * 7e9 * 1000 / (989e12 * 0.5 * 2))
    # 8 data-parallel ranks: the compute, then a ring all-reduce of 7e9 fp32 gradients.
    allreduce = 2 * 7 / 8 * 4 * 7e9 / 50e9
    assert cost.train_seconds(10**6) == pytest.approx(6 * 7e9 * 1e6 / (989e12 * 0.4 * 8) + allreduce)
    assert cost.train_seconds(10**6, step=False) == pytest.approx(6 * 7e9 * 1e6 / (989e12 * 0.4 * 8))
    assert CostModel(H200, M7, train_step_overhead_s=2.0).train_seconds(0) == 2.0
    assert cost.broadcast_seconds() == pytest.approx(14e9 / (50e9 * 0.8))
    assert cost.kv_capacity_tokens() == int((141e9 * 2 * 0.9 - 14e9) / M7.kv_bytes_per_token)
    # Slower hardware is slower at everything.
    a100 = CostModel(HARDWARE["a100"], M7, gpus_per_server=2, trainer_gpus=8)
    assert a100.decode_step_seconds(8) > cost.decode_step_seconds(8)
    assert a100.train_seconds(1000) > cost.train_seconds(1000)


def test_length_distribution_is_long_tailed() -> None:
    dist = LengthDistribution(max_tokens=16384)
    rng = random.Random(1234)
    xs = sorted(dist.sample(rng) for _ in range(20_000))
    assert 1 <= xs[0] and xs[-1] == 16384
    median, p99 = xs[len(xs) // 2], xs[int(0.99 * len(xs))]
    top5 = sum(xs[int(0.95 * len(xs)):]) / sum(xs)
    print(f"p99/median = {p99 / median:.2f}, top-5% token share = {top5:.3f}")
    assert 7 <= p99 / median <= 13
    assert 0.25 <= top5 <= 0.42


def test_length_distribution_bounds_and_validation() -> None:
    dist = LengthDistribution(max_tokens=100, median_fraction=0.5, sigma=2.0, min_tokens=10)
    rng = random.Random(0)
    assert all(10 <= dist.sample(rng) <= 100 for _ in range(2000))
    with pytest.raises(ValueError):
        LengthDistribution(max_tokens=10, min_tokens=20)
    with pytest.raises(ValueError):
        LengthDistribution(max_tokens=10, median_fraction=0)


def test_a_prompts_samples_share_its_length_when_prompt_share_is_set() -> None:
    """prompt_share r: the same prompt text gives alike lengths (in any run: the share is fixed by
    the text), the spread over prompts keeps the distribution's shape, and r = 0 draws exactly as
    before (no prompt in the draw)."""
    import statistics

    dist, plain = LengthDistribution(16384, prompt_share=0.8), LengthDistribution(16384)
    rng = random.Random(7)
    by_prompt = {p: [dist.sample(rng, f"problem {p}") for _ in range(16)] for p in range(300)}
    again = {}
    for p in range(300):  # another run's draws, in another order
        other = random.Random(1000 + p)
        again[p] = [dist.sample(other, f"problem {p}") for _ in range(16)]
    logs = {p: [math.log(x) for x in xs if x < 16384] for p, xs in by_prompt.items()}
    within = statistics.fmean(statistics.pvariance(v) for v in logs.values() if len(v) > 1)
    total = statistics.pvariance([x for v in logs.values() for x in v])
    assert within < 0.4 * total  # 80% of the body's log-variance is the prompt's
    medians = [statistics.median(by_prompt[p]) for p in range(300)]
    assert statistics.correlation(medians, [statistics.median(again[p]) for p in range(300)]) > 0.7
    truncated = sum(x == 16384 for xs in by_prompt.values() for x in xs) / (300 * 16)
    assert 0.02 < truncated < 0.09  # the prompts' rates average to truncated_fraction (0.05)
    a, b = random.Random(3), random.Random(3)
    assert [plain.sample(a, f"p{i}") for i in range(50)] == [plain.sample(b) for _ in range(50)]
    with pytest.raises(ValueError, match="prompt_share"):
        LengthDistribution(100, prompt_share=1.0)


# --- simulated server ----------------------------------------------------------------------------

COST = CostModel(H200, M7)
P = 200  # prompt tokens


def step(batch: int) -> float:
    return COST.decode_step_seconds(batch)


def test_single_request_takes_prefill_plus_n_steps() -> None:
    server = SimServer("s0", COST, max_running=8)
    t_start, t_end, tokens = run_virtual(server.generate(P, 100))
    assert (t_start, tokens) == (0.0, 100)
    assert t_end == pytest.approx(COST.prefill_seconds(P) + 100 * step(1))
    assert server.tokens_generated == 100
    assert server.busy_seconds == pytest.approx(t_end)


def test_two_requests_share_the_batch_then_the_longer_runs_alone() -> None:
    server = SimServer("s0", COST, max_running=8)

    async def main() -> list[tuple[float, float, int]]:
        return list(await asyncio.gather(server.generate(P, 10), server.generate(P, 20)))

    (s1, e1, n1), (s2, e2, n2) = run_virtual(main())
    first = COST.prefill_seconds(2 * P) + 10 * step(2)  # both prompts prefill in the first step
    assert s1 == s2 == 0.0 and (n1, n2) == (10, 20)
    assert e1 == pytest.approx(first)
    assert e2 == pytest.approx(first + 10 * step(1))
    assert server.tokens_generated == 30


def test_max_running_one_serializes() -> None:
    server = SimServer("s0", COST, max_running=1)

    async def main() -> list[tuple[float, float, int]]:
        return list(await asyncio.gather(*(server.generate(P, 50) for _ in range(3))))

    one = COST.prefill_seconds(P) + 50 * step(1)
    results = run_virtual(main())
    for i, (start, end, tokens) in enumerate(results):
        assert start == pytest.approx(i * one)
        assert end == pytest.approx((i + 1) * one)
        assert tokens == 50


def test_arrival_mid_step_joins_at_the_next_boundary() -> None:
    server = SimServer("s0", COST, max_running=8)
    p = COST.prefill_seconds(P)

    async def late() -> tuple[float, float, int]:
        await asyncio.sleep(p + 10.5 * step(1))
        return await server.generate(P, 20)

    async def main() -> list[tuple[float, float, int]]:
        return list(await asyncio.gather(server.generate(P, 100), late()))

    (_, end_a, _), (start_b, end_b, _) = run_virtual(main())
    assert start_b == pytest.approx(p + 11 * step(1))
    assert end_b == pytest.approx(start_b + p + 20 * step(2))
    assert end_a == pytest.approx(end_b + 69 * step(1))


def test_pause_stops_progress_until_resume() -> None:
    server = SimServer("s0", COST, max_running=8)
    p = COST.prefill_seconds(P)

    async def main() -> tuple[tuple[float, float, int], int, float]:
        task = asyncio.create_task(server.generate(P, 100))
        await asyncio.sleep(p + 10.5 * step(1))
        server.pause()  # takes effect at the end of the step in progress
        await asyncio.sleep(500)
        progress = (server.tokens_generated, server.busy_seconds)
        server.resume()
        return await task, *progress

    (_, end, tokens), paused_tokens, paused_busy = run_virtual(main())
    assert paused_tokens == 11
    assert paused_busy == pytest.approx(p + 11 * step(1))
    assert tokens == 100
    assert end == pytest.approx(p + 10.5 * step(1) + 500 + 89 * step(1))
    assert server.busy_seconds == pytest.approx(p + 100 * step(1))


def test_abort_all_returns_partial_results() -> None:
    server = SimServer("s0", COST, max_running=1)
    p = COST.prefill_seconds(P)
    t_abort = p + 40.5 * step(1)

    async def main() -> tuple[int, list[tuple[float, float, int]], tuple[float, float, int]]:
        tasks = [asyncio.create_task(server.generate(P, n)) for n in (100, 50)]
        await asyncio.sleep(t_abort)
        aborted = server.abort_all()
        results = list(await asyncio.gather(*tasks))
        return aborted, results, await server.generate(P, 10)

    aborted, (a, b), after = run_virtual(main())
    assert aborted == 2
    assert a[0] == 0.0 and a[1] == pytest.approx(t_abort) and a[2] == 40
    assert b == (pytest.approx(t_abort), pytest.approx(t_abort), 0)
    assert after[0] == pytest.approx(t_abort)
    assert after[1] == pytest.approx(t_abort + p + 10 * step(1))
    assert server.tokens_generated == 50
    assert server.busy_seconds == pytest.approx(after[1])


@pytest.mark.timeout(120)  # a hang guard only; scripts/bench_simulate.py measures the speed
def test_many_long_tailed_requests_on_four_servers_all_end_in_virtual_time() -> None:
    """4 servers x 256 running, 32768 requests of long-tailed lengths up to 16k: every request gets
    its tokens, and every server's busy time fits in the virtual span."""
    cost = CostModel(H200, ModelShape.from_params_b(8))
    dist = LengthDistribution(max_tokens=16384)
    rng = random.Random(0)
    lengths = [dist.sample(rng) for _ in range(32768)]
    servers = [SimServer(f"s{i}", cost, max_running=256) for i in range(4)]

    async def main() -> tuple[list[tuple[float, float, int]], float]:
        results = await asyncio.gather(*(servers[i % 4].generate(P, n) for i, n in enumerate(lengths)))
        return list(results), asyncio.get_running_loop().time()

    results, t_end = run_virtual(main())
    assert [r[2] for r in results] == lengths
    assert sum(s.tokens_generated for s in servers) == sum(lengths)
    assert all(s <= e <= t_end for s, e, _ in results)
    assert max(r[1] for r in results) == t_end
    assert all(0 < s.busy_seconds <= t_end for s in servers)


def test_abort_one_request_frees_its_place():
    cost = CostModel(HARDWARE["h200"], ModelShape.from_params_b(1.0))

    async def scenario():
        server = SimServer("s", cost, max_running=1)
        long = asyncio.ensure_future(server.generate(10, 1000, key="long"))
        short = asyncio.ensure_future(server.generate(10, 5, key="short"))
        await asyncio.sleep(cost.decode_step_seconds(1) * 10.5)
        server.abort("long")
        t0, t1, tokens = await long
        assert 10 <= tokens <= 11
        s0, s1, stokens = await short
        assert stokens == 5 and s0 == t1  # the short one ran as soon as the long one left
        return server

    run_virtual(scenario())
