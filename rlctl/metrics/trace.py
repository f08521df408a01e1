"""The run's timeline as Chrome trace JSON (opens in Perfetto / chrome://tracing).

A damaged events.jsonl still gives a trace: events without a finite time `t` or a string
`event`, and events whose fields have the wrong shape, are left out and counted
(`otherData.skipped_events` in the trace, said by `rlctl trace`).
"""

from __future__ import annotations

import math
from typing import Any

from rlctl.metrics.spans import Span, SpanKind, SpanPairer

_INSTANTS = ("group_dropped", "server_up", "server_down")


def run_start_time(events: list[dict[str, Any]]) -> float:
    """When the run began: its run_start event, else its first step_start, else its first event.
    Events other writers stamped long before (a Slurm submission) do not move it."""
    for kind in ("run_start", "step_start"):
        found = [e["t"] for e in events if e["event"] == kind]
        if found:
            return min(found)
    return min((e["t"] for e in events), default=0.0)


def usable(event: Any) -> bool:
    """An event the trace can place: an object with a finite number `t` and a string `event`."""
    if not isinstance(event, dict) or not isinstance(event.get("event"), str):
        return False
    t = event.get("t")
    return isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t)


def _servers(e: dict[str, Any]) -> list[str]:
    servers = e.get("servers")
    return [s for s in servers if isinstance(s, str)] if isinstance(servers, list) else []


def _turn_servers(e: dict[str, Any]) -> list[str]:
    """The servers of a group of trajectories' turns (a sample's turns may go to several)."""
    turns = e.get("turns")
    if not isinstance(turns, list):
        return []
    return [t[0] for sample in turns if isinstance(sample, list) for t in sample if isinstance(t, list) and t
            and isinstance(t[0], str)]


def chrome_trace(events: list[dict[str, Any]], trainer_ranks: int = 1) -> dict[str, Any]:
    """One track per rollout server (each sample's request), one per trainer rank (train batches,
    weight syncs), and one for the controller (steps; and its held-out evaluations, when there are
    any, on a track of their own; a colocated run's turns of the devices on another). Time 0 is the run's start; instants from
    before it (servers coming up, a Slurm submission) are left out, so the trace opens on the run.
    Events it cannot place are left out and counted in `otherData.skipped_events`."""
    placed = [e for e in events if usable(e)]
    skipped = len(events) - len(placed)
    t0 = run_start_time(placed)
    servers = sorted({s for e in placed if e["event"] == "group_completed" for s in _servers(e) + _turn_servers(e)})
    tid_of = {s: i for i, s in enumerate(servers)}
    out = _track_names(tid_of, trainer_ranks)
    if any(e["event"] == "eval_end" for e in placed):
        out.append({"name": "thread_name", "ph": "M", "pid": 3, "tid": 1, "args": {"name": "evaluations"}})
    if any(e["event"] == "colocate_turn" for e in placed):
        out.append({"name": "thread_name", "ph": "M", "pid": 3, "tid": 2, "args": {"name": "colocated turns"}})
    pairer = SpanPairer()
    for e in sorted(placed, key=lambda e: e["t"]):
        try:
            out += _entries(e, pairer.observe(e), t0, tid_of, trainer_ranks)
        except (KeyError, IndexError, TypeError, ValueError):  # fields of the wrong shape
            skipped += 1
    trace: dict[str, Any] = {"traceEvents": in_lanes(out), "displayTimeUnit": "ms"}
    if skipped:
        trace["otherData"] = {"skipped_events": skipped}
    return trace


def _span(name: str, pid: int, tid: int, t0: float, start: float, end: float, **args: Any) -> dict[str, Any]:
    ts, until = round((start - t0) * 1e6, 1), round((end - t0) * 1e6, 1)  # one rounding of each end: no overlap made up
    return {"name": name, "ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": max(0.0, round(until - ts, 1)), "args": args}


LANE_STRIDE = 100_000
"""Lane k of track `tid` is drawn as thread tid + k * LANE_STRIDE (more than any track count)."""


def in_lanes(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Complete slices ("X") moved onto lanes, so that slices on one thread never partly overlap.

    The Chrome trace format draws the "X" events of one thread as a stack: each must end before
    the next begins, or enclose it; a rollout server runs many requests at once, whose spans
    overlap every which way. Each track's slices are dealt, in order of start, onto the first of
    its lanes that is free by then (lane 0 is the track itself): as many lanes as requests ever
    ran at once. Each extra lane is named after its track ("rollout-0 #2") and sorted under it.
    A slice's `children` (a trajectory's turns and tool calls, each within it) go on its lane."""
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in entries if e.get("name") == "thread_name"}
    lanes: dict[tuple[int, int], list[float]] = {}  # (pid, tid) -> when each lane is free again
    out: list[dict[str, Any]] = []
    for e in sorted((e for e in entries if e.get("ph") == "X"), key=lambda e: (e["ts"], -e["dur"])):
        free = lanes.setdefault((e["pid"], e["tid"]), [])
        k = next((i for i, until in enumerate(free) if until <= e["ts"]), len(free))
        free[k:k + 1] = [e["ts"] + e["dur"]]
        children = e.pop("children", [])
        out.append({**e, "tid": e["tid"] + k * LANE_STRIDE} if k else e)
        out += [{**c, "tid": e["tid"] + k * LANE_STRIDE} for c in children]  # nested in it, on its lane
    meta = [e for e in entries if e.get("ph") != "X"]
    for (pid, tid), free in sorted(lanes.items()):
        meta.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": tid * 1000}})
        for k in range(1, len(free)):
            lane = tid + k * LANE_STRIDE
            meta.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": lane,
                         "args": {"name": f"{names.get((pid, tid), tid)} #{k + 1}"}})
            meta.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": lane,
                         "args": {"sort_index": tid * 1000 + k}})
    return meta + out


def _entries(e: dict[str, Any], closed: Span | None, t0: float, tid_of: dict[str, int],
             trainer_ranks: int) -> list[dict[str, Any]]:
    """The trace entries of one event (none for most)."""
    kind = e["event"]
    if kind == "group_completed" and isinstance(e.get("turns"), list):
        return [trajectory_span(e, i, t0, tid_of) for i in range(len(e["turns"]))]
    if kind == "group_completed":
        return [_span(f"g{e['group']}", 1, tid_of[server], t0, float(a), float(b), group=e["group"], sample=i,
                      step=e["step"], tokens=e["lengths"][i], reward=e["rewards"][i], version=e["versions"][i])
                for i, (server, a, b) in enumerate(zip(e.get("servers", []), e.get("starts", []), e.get("ends", [])))]
    if kind == "colocate_turn":  # the move, its sync left out (a sync's own span is the trainer's)
        return [_span(f"to {e['to']}", 3, 2, t0, e["t"] - float(e["seconds"]), e["t"], seconds=e["seconds"],
                      trainer_bytes=e.get("trainer_bytes"), server_tags=e.get("server_tags"))]
    if closed is not None and closed.kind is SpanKind.STEP:
        return [_span(f"step {e['step']}", 3, 0, t0, closed.start["t"], e["t"], step=e["step"], version=e.get("version"))]
    if closed is not None and closed.kind is SpanKind.EVAL:
        return [_span(f"eval {e.get('set')} at v{e.get('version', '?')}", 3, 1, t0, closed.start["t"], e["t"],
                      set=e.get("set"), version=e.get("version"),
                      **{k: v for k, v in e.items() if k.startswith(("mean@", "pass@"))})]
    if closed is not None:
        label = {SpanKind.TRAIN: f"train batch {e.get('batch')}",
                 SpanKind.ACCUMULATE: f"accumulate batch {e.get('batch')}",
                 SpanKind.SYNC: f"weight sync v{e.get('version', '?')}"}[closed.kind]
        return [_span(label, 2, rank, t0, closed.start["t"], e["t"], step=e["step"], version=e.get("version"))
                for rank in range(trainer_ranks)]
    if kind in _INSTANTS and e["t"] >= t0:
        return [{"name": kind, "ph": "i", "s": "p", "pid": 3 if kind == "group_dropped" else 1,
                 "tid": tid_of.get(e.get("role"), 0), "ts": round((e["t"] - t0) * 1e6, 1),
                 "args": {k: v for k, v in e.items() if k not in ("t", "event")}}]
    return []


def trajectory_span(e: dict[str, Any], i: int, t0: float, tid_of: dict[str, int]) -> dict[str, Any]:
    """Sample i of a group of trajectories: one slice on its first turn's server, from its first
    request to its last turn's end, holding a slice per model turn (its server and tokens) and
    one per tool call (the tool's name, seconds, whether it failed)."""
    turns, tools = e["turns"][i], (e.get("tools") or [[]] * len(e["turns"]))[i]
    tid = tid_of[turns[0][0]]
    end = max([float(turns[-1][2]), *(float(a) + float(seconds) for _, a, seconds, _ in tools)])
    parent = _span(f"g{e['group']}", 1, tid, t0, float(turns[0][1]), end, group=e["group"], sample=i,
                   step=e["step"], tokens=e["lengths"][i], reward=e["rewards"][i], version=e["versions"][i],
                   turns=len(turns), tool_calls=len(tools))
    children = [_span(f"turn {k}", 1, tid, t0, float(a), float(b), server=server, tokens=tokens, versions=versions)
                for k, (server, a, b, tokens, versions) in enumerate(turns)]
    children += [_span(str(name), 1, tid, t0, float(a), float(a) + float(seconds), tool=name, seconds=seconds, ok=ok)
                 for name, a, seconds, ok in tools]
    parent["children"] = children
    return parent


def _track_names(tid_of: dict[str, int], trainer_ranks: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}}
                                 for pid, name in ((1, "rollout servers"), (2, "trainer"), (3, "controller"))]
    for server, tid in tid_of.items():
        out.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": server}})
    for rank in range(trainer_ranks):
        out.append({"name": "thread_name", "ph": "M", "pid": 2, "tid": rank, "args": {"name": f"trainer-{rank}"}})
    out.append({"name": "thread_name", "ph": "M", "pid": 3, "tid": 0, "args": {"name": "steps"}})
    return out


def pool_chrome_trace(events: list[dict[str, Any]]) -> dict[str, Any]:
    """A pool's events.jsonl (rlctl/launchers/pool/) as a Chrome trace: one track per device, on
    which each run's slices and each model move are spans, so the runs show interleaved."""
    out: list[dict[str, Any]] = []
    skipped = 0
    devices: set[int] = set()
    for e in events:
        if not usable(e) or e["event"] not in ("slice", "move"):
            continue
        try:
            start, seconds = float(e["start"]), float(e["seconds"])
            on = [int(e["device"])] if e["event"] == "slice" else [int(d) for d in e["devices"]]
            name = str(e["job"]) if e["event"] == "slice" else f"{e['job']}/{e['model']} {e['from']}->{e['to']}"
        except (KeyError, TypeError, ValueError):
            skipped += 1
            continue
        for d in on:
            devices.add(d)
            out.append({"name": name, "cat": e["event"], "ph": "X", "pid": 1, "tid": d,
                        "ts": start * 1e6, "dur": max(seconds, 0.0) * 1e6, "args": {"job": e["job"]}})
    meta = [{"name": "thread_name", "ph": "M", "pid": 1, "tid": d, "args": {"name": f"device {d}"}} for d in sorted(devices)]
    return {"traceEvents": meta + out, "displayTimeUnit": "ms", "otherData": {"skipped_events": skipped}}
