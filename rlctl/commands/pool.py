"""`rlctl pool up POOL.yaml` / `rlctl pool status [NAME]` / `rlctl pool down NAME`: a long-lived
pool of devices that runs with `launcher: pool` attach to (rlctl/launchers/pool/)."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import typer

from rlctl.errors import RunError, UsageError

app = typer.Typer(help="A shared pool of devices that several runs use at once (launcher: pool).",
                  no_args_is_help=True, add_completion=False)
UP_TIMEOUT_S = 30.0
SLURM_UP_TIMEOUT_S = 120.0
"""How long `pool up` waits for a Slurm pool's job to start and its service to answer; after
that it says the job is pending and `rlctl pool status NAME` tells when it is up."""


@app.command("up", no_args_is_help=True)
def up(pool_file: Path = typer.Argument(..., help="The pool file (see recipes/pool/)."),
       overrides: list[str] | None = typer.Argument(None, help="KEY=VALUE overrides, e.g. pool.devices.count=2.")) -> None:
    """Start a pool's service (in the background) and wait until it answers."""
    import os
    import subprocess

    import yaml

    from rlctl.launchers.pool.pooldir import PoolDir
    from rlctl.recipe import Device, Launcher, recipe_to_dict
    from rlctl.recipe.load import load_pool_file

    spec = load_pool_file(pool_file, overrides or [])
    d = spec.pool.devices
    cores = len(os.sched_getaffinity(0))
    on_slurm = spec.pool.launcher is Launcher.SLURM
    if d.kind is Device.CPU and not on_slurm and d.count * d.cpus_per_device > cores:
        raise UsageError(f"{pool_file}: pool.devices: {d.count} devices x {d.cpus_per_device} cores need "
                         f"{d.count * d.cpus_per_device} cores, this machine has {cores}; lower count or cpus_per_device")
    pd = PoolDir.create((Path(spec.pool.output_dir) / spec.pool.name).resolve(),
                        yaml.safe_dump(recipe_to_dict(spec), sort_keys=False))
    if on_slurm:
        _up_on_slurm(spec, pd)
        return
    with pd.log_path.open("ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "rlctl.launchers.pool.service", "--pool-dir", str(pd.path)],
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + UP_TIMEOUT_S
    while not pd.alive():
        if proc.poll() is not None or time.monotonic() > deadline:
            from rlctl.run.tail import last_log_line

            proc.kill()
            raise RunError(f"pool {pd.name} did not come up: {last_log_line(pd.log_path) or 'no output'}; "
                           f"see {pd.log_path}")
        time.sleep(0.1)
    state = pd.read()
    print(f"pool {pd.name} up at {state['url']}: {d.count} {d.kind} device(s), {pd.path}")


def _up_on_slurm(spec, pd) -> None:
    """sbatch the pool's job and wait for its service to answer, or say it is still pending."""
    from rlctl.launchers import slurm
    from rlctl.launchers.pool.slurm import submit_pool
    from rlctl.run.tail import last_log_line

    try:
        job_id = submit_pool(spec, pd.path)
    except RunError as e:
        pd.write(state="failed", reason=str(e))
        raise
    pd.write(launcher="slurm", job_id=job_id)
    deadline = time.monotonic() + SLURM_UP_TIMEOUT_S
    while not pd.alive():
        job = slurm.query([job_id]).get(job_id)
        if job is None or not job.active:
            pd.write(state="failed")
            raise RunError(f"pool {pd.name}: Slurm job {job_id} {job.describe() if job else 'is gone'} before the "
                           f"pool came up: {last_log_line(pd.log_path) or 'no output'}; see {pd.log_path}")
        if time.monotonic() > deadline:
            print(f"pool {pd.name}: Slurm job {job_id} is {job.describe()}; `rlctl pool status {pd.name}` says "
                  "when it is up")
            return
        time.sleep(0.5)
    state = pd.read()
    print(f"pool {pd.name} up at {state['url']}: {spec.pool.devices.count} {spec.pool.devices.kind} device(s) on "
          f"{' '.join(state['nodes'])} (Slurm job {job_id}), {pd.path}")


@app.command("down", no_args_is_help=True)
def down(name: str = typer.Argument(..., help="The pool's name."),
         pools_dir: Path = typer.Option(Path("pools"), "--dir", help="Where pools are.")) -> None:
    """Detach every run (their engines stop; the runs fail) and stop the pool's service."""
    from rlctl.launchers.pool.client import request
    from rlctl.launchers.pool.pooldir import PoolDir
    from rlctl.run.dir import pid_alive

    pd = PoolDir(pools_dir / name)
    state = pd.read()
    if state.get("launcher") == "slurm":
        _down_on_slurm(pd, state)
        return
    request(pd, "POST", "/shutdown", {})
    deadline = time.monotonic() + 60
    while pid_alive(state.get("pid")) and time.monotonic() < deadline:
        time.sleep(0.1)
    print(f"pool {name} down")


def _down_on_slurm(pd, state: dict[str, Any]) -> None:
    """Ask the service to detach every run and stop (its job then ends); a job whose service does
    not answer, or that does not end within a minute, is cancelled."""
    from rlctl.launchers import slurm
    from rlctl.launchers.pool.client import request

    job_id = state["job_id"]
    if pd.alive():
        request(pd, "POST", "/shutdown", {})
        deadline = time.monotonic() + 60
        while (job := slurm.query([job_id]).get(job_id)) is not None and job.active and time.monotonic() < deadline:
            time.sleep(0.5)
    job = slurm.cancel(job_id)
    if state.get("state") != "down":
        pd.write(state="down")
    print(f"pool {pd.name} down (Slurm job {job_id} {job.state if job else 'ended'})")


@app.command("status")
def status(name: str = typer.Argument("", help="The pool's name (none: every pool)."),
           pools_dir: Path = typer.Option(Path("pools"), "--dir", help="Where pools are."),
           as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")) -> None:
    """Devices (who holds each, memory, how busy) and runs (device time used against a dedicated
    placement) of a pool; without a name, every pool and its state."""
    import json

    from rlctl.launchers.pool.client import request
    from rlctl.launchers.pool.pooldir import PoolDir

    if not name:
        pools = [{"name": p.name, "state": _state_words(PoolDir(p)), "path": str(p)}
                 for p in sorted(p for p in pools_dir.glob("*") if (p / "pool.json").exists())]
        print(json.dumps(pools, indent=2) if as_json else "\n".join(
            f"{p['name']:<20} {p['state']:<8} {p['path']}" for p in pools), end="\n" if pools or as_json else "")
        return
    pd = PoolDir(pools_dir / name)
    if not pd.alive():
        down = {"name": name, "state": _state_words(pd), "path": str(pd.path), "events": len(pd.events())}
        print(json.dumps(down, indent=2) if as_json else
              f"pool {name}: {down['state']} ({pd.path}); {down['events']} events recorded")
        return
    answer = request(pd, "GET", "/status")
    print(json.dumps(answer, indent=2, default=str) if as_json else render_status(answer))


def _state_words(pd) -> str:
    """up, or what pool.json says (a service that says up but does not answer: not answering),
    and for a Slurm pool what Slurm says of its job."""
    if pd.alive():
        return "up"
    state = pd.read()
    words = state.get("state", "?") if state.get("state") != "up" else "not answering"
    if state.get("launcher") == "slurm" and state.get("job_id"):
        from rlctl.errors import RlctlError
        from rlctl.launchers import slurm

        try:
            job = slurm.query([state["job_id"]]).get(state["job_id"])
            words += f" (Slurm job {state['job_id']}: {job.describe() if job else 'gone'})"
        except RlctlError as e:
            words += f" (Slurm job {state['job_id']}: {e})"
    return words


@app.command("trace", no_args_is_help=True)
def trace(name: str = typer.Argument(..., help="The pool's name."),
          output: Path = typer.Option(..., "-o", "--output", help="The trace file to write (JSON)."),
          pools_dir: Path = typer.Option(Path("pools"), "--dir", help="Where pools are.")) -> None:
    """The pool's timeline for Perfetto: a track per device, each run's slices and model moves on it."""
    import json

    from rlctl.launchers.pool.pooldir import PoolDir
    from rlctl.metrics.trace import pool_chrome_trace

    pd = PoolDir(pools_dir / name)
    pd.read()  # no such pool: one line, exit 1
    data = pool_chrome_trace(pd.events())
    try:
        output.write_text(json.dumps(data))
    except OSError as e:
        raise UsageError(f"cannot write {output}: {e.strerror}") from None
    print(f"{output}: {len(data['traceEvents'])} trace events from pool {name}")


def render_status(s: dict[str, Any]) -> str:
    lines = [f"pool {s['name']}: up {s['uptime_s']:.0f} s, {len(s['devices'])} device(s)",
             f"{'device':>6}  {'holder':<34}{'memory GB':>14}{'busy':>7}"]
    for d, dev in s["devices"].items():
        busy = dev["busy_s"] / max(s["uptime_s"], 1e-9)
        lines.append(f"{d:>6}  {(dev['holder'] or '-'):<34}{dev['resident'] / 1e9:>6.2f}/{dev['capacity'] / 1e9:<7.2f}"
                     f"{busy:>7.0%}")
    lines.append(f"{'run':<34}{'share':>6}{'wall s':>9}{'used dev-s':>12}{'dedicated dev-s':>17}")
    for job, u in s["jobs"].items():
        lines.append(f"{job:<34}{u['share']:>6g}{u['wall_s']:>9.1f}{u['used_device_s']:>12.1f}"
                     f"{u['dedicated_device_s']:>17.1f}")
    for h in s.get("held", []):  # who holds a slice, and until when unless renewed (pool.lease_s)
        lines.append(f"held: {h['job']} ({h['kind']}) for {h['held_s']:.1f} s, lease {h['lease_left_s']:.1f} s left")
    for w in s.get("waiting", []):  # who waits, for whom
        by = ", ".join(w["blocked_by"]) or "moves"
        lines.append(f"waiting: {w['job']} ({w['kind']}) for device(s) {w['devices']}, held by {by}")
    return "\n".join(lines)
