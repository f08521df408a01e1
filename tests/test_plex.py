"""The pool's scheduler under virtual time: slices, quanta, gangs, memory moves, shares, placement."""

from __future__ import annotations

import asyncio

import pytest

from rlctl.errors import RunError
from rlctl.plex.placement import Block, Layout, co_location_fits
from rlctl.plex.scheduler import Model, SliceScheduler, State
from rlctl.plex.state import snapshot
from rlctl.sim.loop import VirtualClock, run_virtual

A, W, OFF = State.ACTIVE, State.WEIGHTS, State.OFFLOADED


class Moves:
    """A mover that takes `seconds` per move and records them."""

    def __init__(self, seconds: float = 0.5) -> None:
        self.seconds = seconds
        self.done: list[tuple[str, str, State, State]] = []

    async def __call__(self, model: Model, to: State) -> None:
        before = model.state
        await asyncio.sleep(self.seconds)
        self.done.append((model.job, model.name, before, to))


def scheduler(devices: dict[int, float], events: list, quantum_s: float = 5.0, mover: Moves | None = None):
    return SliceScheduler(devices, VirtualClock(), mover or Moves(),
                          lambda kind, t, **f: events.append({"event": kind, "t": t, **f}), quantum_s=quantum_s)


async def call(s: SliceScheduler, job: str, needs, kind: str, seconds: float, log: list) -> None:
    async with s.slice(job, needs, kind):
        start = asyncio.get_running_loop().time()
        await asyncio.sleep(seconds)
        log.append((job, kind, start, asyncio.get_running_loop().time()))


def test_one_job_at_a_time_per_device_and_the_quantum_passes_it_on():
    events, log = [], []

    async def main():
        s = scheduler({0: 100.0}, events, quantum_s=5.0)
        s.add_job("a", [Model("a", "r", (0,), 10, 10)])
        s.add_job("b", [Model("b", "r", (0,), 10, 10)])

        async def stream(offset: float):  # two workers, 2 s calls, 1 s apart: a never has none running
            await asyncio.sleep(offset)
            while asyncio.get_running_loop().time() < 30:
                await call(s, "a", [("r", A)], "generate", 2.0, log)

        async def late():
            await asyncio.sleep(1.5)
            await call(s, "b", [("r", A)], "generate", 3.0, log)

        await asyncio.gather(stream(0.0), stream(1.0), late())

    run_virtual(main())
    b_start = next(start for job, _, start, _ in log if job == "b")
    # a holds until its quantum (5 s) is over and the calls it has running then end: then b.
    assert 6.0 <= b_start <= 7.0
    spans = sorted((start, end, job) for job, _, start, end in log)
    for (_, e1, j1), (s2, _, j2) in zip(spans, spans[1:]):
        assert j1 == j2 or s2 >= e1 - 1e-9, "two jobs ran on one device at once"


def test_a_sync_that_paused_its_own_generates_is_not_blocked_by_a_waiting_gang():
    """b's generates on device 1 wait for b's sync (an in-place pause); a's train needs devices 0
    and 1. With partial holds or a reservation that outranks b, nothing would ever move."""
    events, log = [], []

    async def main():
        s = scheduler({0: 100.0, 1: 100.0}, events)
        s.add_job("a", [Model("a", "t", (0, 1), 10, 10)])
        s.add_job("b", [Model("b", "t", (0,), 10, 10), Model("b", "r", (1,), 10, 10)])
        synced = asyncio.Event()

        async def paused_generate():
            async with s.slice("b", [("r", A)], "generate"):
                await synced.wait()
                log.append(("b", "generate", 0, asyncio.get_running_loop().time()))

        async def sync():
            await asyncio.sleep(1.0)
            await call(s, "b", [("t", W), ("r", W)], "sync", 1.0, log)
            synced.set()

        async def train():
            await asyncio.sleep(0.5)
            await call(s, "a", [("t", A)], "train", 1.0, log)

        await asyncio.wait_for(asyncio.gather(paused_generate(), sync(), train()), timeout=100)

    run_virtual(main())
    assert [k for _, k, _, _ in log] == ["sync", "generate", "train"]


def test_memory_cap_is_kept_by_moving_idle_models_out_first():
    events, log = [], []
    moves = Moves(0.5)

    async def main():
        s = scheduler({0: 100.0}, events, mover=moves)
        s.add_job("a", [Model("a", "r", (0,), 30, 50)])  # active 80: fits alone
        s.add_job("b", [Model("b", "t", (0,), 30, 40)])  # active 70: starts offloaded
        assert s.models[("b", "t")].state is OFF
        await call(s, "a", [("r", A)], "generate", 1.0, log)
        await call(s, "b", [("t", A)], "train", 1.0, log)
        await call(s, "a", [("r", A)], "generate", 1.0, log)
        return s

    s = run_virtual(main())
    # b in: a's KV out first (80 -> 30), then b's weights and optimizer in (30 + 70 = 100).
    assert moves.done[:2] == [("a", "r", A, W), ("b", "t", OFF, A)]
    # a back: b must give up all but 0 of its 70 (30 + 70 would exceed 100 again with a's 80).
    assert moves.done[2:] == [("b", "t", A, W), ("b", "t", W, OFF), ("a", "r", W, A)]
    assert s.resident(0) <= 100.0
    moved = [e for e in events if e["event"] == "move"]
    assert all(e["ok"] for e in moved) and len(moved) == 5


def test_a_larger_share_gets_more_device_time():
    events = []

    async def main():
        s = scheduler({0: 100.0}, events, quantum_s=2.0, mover=Moves(0.0))
        s.add_job("small", [Model("small", "r", (0,), 10, 10)], share=1.0)
        s.add_job("big", [Model("big", "r", (0,), 10, 10)], share=2.0)

        async def busy(job: str, offset: float):  # two workers each: a job always has a call running
            await asyncio.sleep(offset)
            while asyncio.get_running_loop().time() < 120:
                await call(s, job, [("r", A)], "generate", 0.5, [])

        await asyncio.gather(busy("small", 0.0), busy("small", 0.25), busy("big", 0.0), busy("big", 0.25))
        return snapshot(s)["jobs"]

    jobs = run_virtual(main())
    ratio = jobs["big"]["used_s"] / jobs["small"]["used_s"]
    assert 1.6 < ratio < 2.5, jobs


def chains(shares: dict[str, float], devices: dict[str, tuple[int, int]], until: float,
           starts: dict[str, float] | None = None, events: list | None = None) -> tuple[dict, float]:
    """Jobs that each make one call at a time, as a run's controller does: a generate on its
    server's device, 20 ms of its own work, a train on its trainer's device, 20 ms, and again
    (no moves: every model fits), from `starts` on (joining then). Each job's device time, and
    the devices' busy time."""
    events = [] if events is None else events

    async def main():
        s = scheduler({0: 100.0, 1: 100.0}, events, quantum_s=2.0, mover=Moves(0.0))

        async def run(job: str):
            await asyncio.sleep((starts or {}).get(job, 0.0))
            server, trainer = devices[job]
            s.add_job(job, [Model(job, "r", (server,), 10, 10), Model(job, "t", (trainer,), 10, 10)], share=shares[job])
            while asyncio.get_running_loop().time() < until:
                await call(s, job, [("r", A)], "generate", 0.3, [])
                await asyncio.sleep(0.02)
                await call(s, job, [("t", A)], "train", 0.3, [])
                await asyncio.sleep(0.02)

        await asyncio.gather(*(run(j) for j in devices))
        return snapshot(s)

    snap = run_virtual(main())
    busy = sum(d["busy_s"] for d in snap["devices"].values())
    return snap["jobs"], busy


def test_a_larger_share_gets_more_of_a_device_its_calls_come_to_one_at_a_time():
    """Two runs on one device, each making one call at a time: handed over at every call
    boundary, they would alternate call by call whatever their shares. The device waits a moment
    for the job more than a quantum behind its share, so the share-2 job gets about twice the
    time; with equal shares it never waits, and the two split it evenly."""
    jobs, _ = chains({"small": 1.0, "big": 2.0}, {"small": (0, 0), "big": (0, 0)}, 120.0)
    ratio = jobs["big"]["used_s"] / jobs["small"]["used_s"]
    assert 1.6 < ratio < 2.4, jobs
    jobs, busy = chains({"a": 1.0, "b": 1.0}, {"a": (0, 0), "b": (0, 0)}, 120.0)
    assert 0.9 < jobs["a"]["used_s"] / jobs["b"]["used_s"] < 1.1, jobs
    assert busy > 0.98 * 120.0  # never idle while the other job waited (only the last calls' ends stick out)


def test_a_run_that_joins_late_is_not_owed_what_the_others_used_before():
    """a has the device to itself for 60 s; b joins with the same share. From then on they split
    it: b is not served first until it has used as much as a did alone."""
    events: list = []
    chains({"a": 1.0, "b": 1.0}, {"a": (0, 0), "b": (0, 0)}, 120.0, starts={"b": 60.0}, events=events)
    after = {j: sum(max(0.0, e["t"] - max(e["start"], 61.0)) for e in events if e["event"] == "slice" and e["job"] == j)
             for j in ("a", "b")}
    assert 0.8 < after["a"] / after["b"] < 1.25, after


def test_runs_whose_calls_alternate_devices_are_not_kept_waiting():
    """Two runs with their servers and trainers crossed over two devices: each comes back to a
    device only after a call on the other, so waiting for it would only idle the device. Shares
    1 and 2 then cost no device time: both devices stay busy."""
    jobs, busy = chains({"a": 1.0, "b": 2.0}, {"a": (0, 1), "b": (1, 0)}, 120.0)
    assert busy > 0.85 * 2 * 120.0, (busy, jobs)


def test_a_job_that_leaves_fails_its_waiting_calls_and_frees_the_device():
    events, log = [], []

    async def main():
        s = scheduler({0: 100.0}, events)
        s.add_job("a", [Model("a", "r", (0,), 10, 10)])
        s.add_job("b", [Model("b", "r", (0,), 10, 10)])
        hold = asyncio.create_task(call(s, "a", [("r", A)], "generate", 50.0, log))
        await asyncio.sleep(0.1)
        waiting = asyncio.create_task(call(s, "b", [("r", A)], "generate", 1.0, log))
        await asyncio.sleep(0.1)
        hold.cancel()
        s.remove_job("a")
        await waiting
        with pytest.raises(RunError, match="not in the pool"):
            await call(s, "a", [("r", A)], "generate", 1.0, log)

    run_virtual(main())
    assert [(j, k) for j, k, _, _ in log] == [("b", "generate")]
    assert log[0][2] < 2.0


def test_admission_refuses_a_model_bigger_than_a_device():
    s = SliceScheduler({0: 100.0}, VirtualClock(), Moves())
    with pytest.raises(RunError, match="needs .* GiB on device 0"):
        s.add_job("a", [Model("a", "t", (0,), 60, 50)])


def test_placement_crosses_two_jobs_rollouts_and_trainers():
    layout = Layout(dict.fromkeys(range(4), 100.0))
    blocks = [Block("rollout", 2, 10, 50, load=0.65, parts=2), Block("trainer", 2, 10, 30, load=0.33)]
    a = {m.name: m.devices for m in layout.place("a", blocks)}
    b = {m.name: m.devices for m in layout.place("b", blocks)}
    assert set(a["rollout-0"] + a["rollout-1"]) == set(b["trainer"])
    assert set(b["rollout-0"] + b["rollout-1"]) == set(a["trainer"])
    models = [Model("a", "r", (0,), 10, 50), Model("b", "t", (0,), 10, 50)]
    assert co_location_fits(models, {0: 100.0}) == {0: (120.0, 100.0)}
    with pytest.raises(RunError, match="needs 2 devices; the pool has 1"):
        Layout({0: 100.0}).place("c", [Block("trainer", 2, 1, 1)])


def test_simulated_pool_of_two_sync_jobs_costs_less_than_dedicated(tmp_path):
    """Two sync jobs crossed on 16 simulated H200s (each alone would hold 16): the pool is the
    CLI's own path (`rlctl simulate POOL.yaml`), timed against each job alone."""
    from pathlib import Path

    from conftest import rlctl_here

    job = Path(__file__).resolve().parent.parent / "recipes" / "pool" / "sim-job.yaml"
    pool = tmp_path / "pool.yaml"
    pool.write_text(f"pool: {{name: t, quantum_s: 30}}\nsim: {{gpu: h200, gpus: 16}}\njobs:\n"
                    f"  - {{recipe: {job}, name: a, overrides: [run.steps=2]}}\n"
                    f"  - {{recipe: {job}, name: b, overrides: [run.steps=2, run.seed=3]}}\n")
    from rlctl.recipe.load import load_pool_file
    from rlctl.sim.pool import simulate_pool

    result = simulate_pool(load_pool_file(pool))
    assert result.held_gpu_s < 0.7 * result.dedicated_gpu_s
    assert all(1.0 <= j.slowdown < 1.25 for j in result.jobs), [(j.name, j.slowdown) for j in result.jobs]
    assert len(result.co_location) == 16  # a KV cache and a trainer do not fit on one H200 together
    kinds = {e["event"] for e in result.events}
    assert {"slice", "move", "job_added"} <= kinds
    out = rlctl_here("simulate", str(pool), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "fewer than dedicated" in out.stdout and "naive co-location: does not fit on 16 of 16 GPUs" in out.stdout


def trainers_in_pieces(moves: Moves, quantum_s: float, pieces: int, piece_s: float, gap_s: float,
                       events: list, log: list) -> list:
    """Two jobs whose trainers cannot both be active on one device (20 + 50 of 100 each), each
    training `pieces` pieces of piece_s with gap_s between them (the controller's own work);
    the promotions the mover made."""

    async def main():
        s = scheduler({0: 100.0}, events, quantum_s=quantum_s, mover=moves)
        s.add_job("a", [Model("a", "t", (0,), 20, 50)])
        s.add_job("b", [Model("b", "t", (0,), 20, 50)])

        async def train(job: str):
            for _ in range(pieces):
                await call(s, job, [("t", A)], "train", piece_s, log)
                await asyncio.sleep(gap_s)

        await asyncio.gather(train("a"), train("b"))

    run_virtual(main())
    return [m for m in moves.done if m[3] is A]


def test_models_are_not_moved_out_and_back_at_every_call_boundary():
    """Pieces with short gaps: a device waits a moment for its holder's next piece until its
    quantum is over, so the models swap about once per quantum, not once per piece."""
    promotions = trainers_in_pieces(Moves(0.5), 10.0, 40, 1.0, 0.01, [], [])
    # 80 s of calls in turns of ~10 s: ~8 swaps; without waiting, one per piece (~80).
    assert 4 <= len(promotions) <= 14, len(promotions)


def test_turns_grow_with_what_a_switch_costs():
    """Trainers that take 2.5 s to move out or in, training in 10 s pieces with 1 s between them:
    with a 5 s quantum and a device kept only linger_s, every piece would swap (5 s of moves per
    10 s of work). The pool measures the moves, keeps a device for its holder as long as a switch
    would take, and makes a turn last until the moves are at most switch_overhead of it: a few
    swaps, and both jobs still take turns."""
    events, log = [], []
    promotions = trainers_in_pieces(Moves(2.5), 5.0, 12, 10.0, 1.0, events, log)
    assert 2 <= len(promotions) <= 8, len(promotions)  # one per piece would be ~23
    turns = [job for job, *_ in sorted(log, key=lambda x: x[2])]
    switches = sum(a != b for a, b in zip(turns, turns[1:]))
    assert switches >= 2  # neither job waited for the other to finish all its pieces
    moved = sum(e["seconds"] for e in events if e["event"] == "move")
    assert moved / max(end for *_, end in log) < 0.15


@pytest.mark.parametrize("beside", [False, True])
def test_a_sync_runs_beside_the_holders_when_its_models_are_in_place(beside):
    """b's weight sync needs its trainer (device 1) and its server (device 0) as weights only,
    while a generates on device 0 for 4 s. Held as a slice it waits for a's generate; beside
    (a CPU pool) it runs at once, and meanwhile b's models cannot be demoted: a's call that
    needs their memory waits for it."""
    events, log = [], []

    async def main():
        s = SliceScheduler({0: 100.0, 1: 100.0}, VirtualClock(), Moves(0.1),
                           lambda kind, t, **f: events.append({"event": kind, "t": t, **f}),
                           beside=frozenset({"sync"} if beside else ()))
        s.add_job("b", [Model("b", "r", (0,), 10, 10), Model("b", "t", (1,), 10, 10)])
        s.add_job("a", [Model("a", "r", (0,), 10, 10), Model("a", "big", (1,), 70, 20)])  # offloaded: no room

        async def b_sync():
            await asyncio.sleep(1.0)
            await call(s, "b", [("r", W), ("t", W)], "sync", 2.0, log)

        async def a_big():  # needs b's trainer demoted (90 + 20 > 100) while b's sync runs
            await asyncio.sleep(1.5)
            await call(s, "a", [("big", A)], "train", 1.0, log)

        await asyncio.gather(call(s, "a", [("r", A)], "generate", 4.0, log), b_sync(), a_big())
        return snapshot(s)["jobs"]

    used = run_virtual(main())
    starts = {(job, kind): (start, end) for job, kind, start, end in log}
    sync_start, sync_end = starts[("b", "sync")]
    if beside:
        assert sync_start == pytest.approx(1.0)  # beside a's generate on device 0
        assert starts[("a", "train")][0] >= sync_end  # b's trainer was not demoted under its sync
        b = used["b"]  # 2 s on each of its two devices, besides its trainer's demotion for a
        assert b["used_s"] - b["moved_s"] == pytest.approx(4.0, abs=0.01) and b["moved_s"] > 0
        assert {e["device"] for e in events if e["event"] == "slice" and e.get("beside")} == {0, 1}
    else:
        assert sync_start >= 4.0  # after a's generate let device 0 go
        assert not any(e.get("beside") for e in events)
