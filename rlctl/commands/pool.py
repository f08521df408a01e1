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


@app.command("up", no_args_is_help=True)
def up(pool_file: Path = typer.Argument(..., help="The pool file (see recipes/pool/)."),
       overrides: list[str] | None = typer.Argument(None, help="KEY=VALUE overrides, e.g. pool.devices.count=2.")) -> None:
    """Start a pool's service (in the background) and wait until it answers."""
    import os
    import subprocess

    import yaml

    from rlctl.launchers.pool.pooldir import PoolDir
    from rlctl.recipe import Device, recipe_to_dict
    from rlctl.recipe.load import load_pool_file

    spec = load_pool_file(pool_file, overrides or [])
    d = spec.pool.devices
    cores = len(os.sched_getaffinity(0))
    if d.kind is Device.CPU and d.count * d.cpus_per_device > cores:
        raise UsageError(f"{pool_file}: pool.devices: {d.count} devices x {d.cpus_per_device} cores need "
                         f"{d.count * d.cpus_per_device} cores, this machine has {cores}; lower count or cpus_per_device")
    pd = PoolDir.create((Path(spec.pool.output_dir) / spec.pool.name).resolve(),
                        yaml.safe_dump(recipe_to_dict(spec), sort_keys=False))
    with pd.log_path.open("ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "rlctl.launchers.pool.service", "--pool-dir", str(pd.path)],
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + UP_TIMEOUT_S
    while not pd.alive():
        if proc.poll() is not None or time.monotonic() > deadline:
            from rlctl.tail import last_log_line

            proc.kill()
            raise RunError(f"pool {pd.name} did not come up: {last_log_line(pd.log_path) or 'no output'}; "
                           f"see {pd.log_path}")
        time.sleep(0.1)
    state = pd.read()
    print(f"pool {pd.name} up at {state['url']}: {d.count} {d.kind} device(s), {pd.path}")


@app.command("down", no_args_is_help=True)
def down(name: str = typer.Argument(..., help="The pool's name."),
         pools_dir: Path = typer.Option(Path("pools"), "--dir", help="Where pools are.")) -> None:
    """Detach every run (their engines stop; the runs fail) and stop the pool's service."""
    from rlctl.launchers.pool.client import request
    from rlctl.launchers.pool.pooldir import PoolDir
    from rlctl.rundir import pid_alive

    pd = PoolDir(pools_dir / name)
    pid = pd.read().get("pid")
    request(pd, "POST", "/shutdown", {})
    deadline = time.monotonic() + 60
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    print(f"pool {name} down")


@app.command("status")
def status(name: str = typer.Argument("", help="The pool's name (none: every pool)."),
           pools_dir: Path = typer.Option(Path("pools"), "--dir", help="Where pools are.")) -> None:
    """Devices (who holds each, memory, how busy) and runs (device time used against a dedicated
    placement) of a pool; without a name, every pool and its state."""
    from rlctl.launchers.pool.client import request
    from rlctl.launchers.pool.pooldir import PoolDir

    if not name:
        for path in sorted(p for p in pools_dir.glob("*") if (p / "pool.json").exists()):
            pd = PoolDir(path)
            print(f"{pd.name:<20} {'up' if pd.alive() else pd.read().get('state', '?'):<8} {path}")
        return
    pd = PoolDir(pools_dir / name)
    if not pd.alive():
        print(f"pool {name}: {pd.read().get('state', '?')} ({pd.path}); {len(pd.events())} events recorded")
        return
    print(render_status(request(pd, "GET", "/status")))


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
    return "\n".join(lines)
