"""The run's timeline as Chrome trace JSON (opens in Perfetto / chrome://tracing)."""

from __future__ import annotations

from typing import Any

from rlctl.metrics.spans import SpanKind, SpanPairer

_INSTANTS = ("group_dropped", "server_up", "server_down")


def run_start_time(events: list[dict[str, Any]]) -> float:
    """When the run began: its run_start event, else its first step_start, else its first event.
    Events other writers stamped long before (a Slurm submission) do not move it."""
    for kind in ("run_start", "step_start"):
        found = [e["t"] for e in events if e["event"] == kind]
        if found:
            return min(found)
    return min((e["t"] for e in events), default=0.0)


def chrome_trace(events: list[dict[str, Any]], trainer_ranks: int = 1) -> dict[str, Any]:
    """One track per rollout server (each sample's request), one per trainer rank (train batches,
    weight syncs), and one for the controller (steps). Time 0 is the run's start; instants from
    before it (servers coming up, a Slurm submission) are left out, so the trace opens on the run."""
    t0 = run_start_time(events)
    out: list[dict[str, Any]] = []

    def us(t: float) -> float:
        return round((t - t0) * 1e6, 1)

    def span(name: str, pid: int, tid: int, start: float, end: float, **args: Any) -> None:
        out.append({"name": name, "ph": "X", "pid": pid, "tid": tid, "ts": us(start),
                    "dur": max(0.0, round((end - start) * 1e6, 1)), "args": args})

    servers = sorted({s for e in events if e["event"] == "group_completed" for s in e.get("servers", [])})
    tid_of = {s: i for i, s in enumerate(servers)}
    out += _track_names(tid_of, trainer_ranks)
    pairer = SpanPairer()
    for e in sorted(events, key=lambda e: e["t"]):
        kind = e["event"]
        closed = pairer.observe(e)
        if kind == "group_completed":
            for i, (server, a, b) in enumerate(zip(e.get("servers", []), e.get("starts", []), e.get("ends", []))):
                span(f"g{e['group']}", 1, tid_of[server], a, b, group=e["group"], sample=i, step=e["step"],
                     tokens=e["lengths"][i], reward=e["rewards"][i], version=e["versions"][i])
        elif closed is not None and closed.kind is SpanKind.STEP:
            span(f"step {e['step']}", 3, 0, closed.start["t"], e["t"], step=e["step"], version=e.get("version"))
        elif closed is not None:
            label = {SpanKind.TRAIN: f"train batch {e.get('batch')}",
                     SpanKind.ACCUMULATE: f"accumulate batch {e.get('batch')}",
                     SpanKind.SYNC: f"weight sync v{e.get('version', '?')}"}[closed.kind]
            for rank in range(trainer_ranks):
                span(label, 2, rank, closed.start["t"], e["t"], step=e["step"], version=e.get("version"))
        elif kind in _INSTANTS and e["t"] >= t0:
            out.append({"name": kind, "ph": "i", "s": "p", "pid": 3 if kind == "group_dropped" else 1,
                        "tid": tid_of.get(e.get("role"), 0), "ts": us(e["t"]),
                        "args": {k: v for k, v in e.items() if k not in ("t", "event")}})
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def _track_names(tid_of: dict[str, int], trainer_ranks: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}}
                                 for pid, name in ((1, "rollout servers"), (2, "trainer"), (3, "controller"))]
    for server, tid in tid_of.items():
        out.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": server}})
    for rank in range(trainer_ranks):
        out.append({"name": "thread_name", "ph": "M", "pid": 2, "tid": rank, "args": {"name": f"trainer-{rank}"}})
    out.append({"name": "thread_name", "ph": "M", "pid": 3, "tid": 0, "args": {"name": "steps"}})
    return out
