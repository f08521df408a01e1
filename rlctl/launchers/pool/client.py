"""Talking to a live pool: the blocking calls of the CLI and a run's supervisor (attach, detach,
status, shutdown), and the lease a run's controller takes slices through (rlctl/plex/gates.py)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from rlctl.process.auth import LEASE_ROLE, bearer, role_key
from rlctl.errors import RunError
from rlctl.launchers.pool.pooldir import PoolDir

log = logging.getLogger("rlctl.pool")


def request(pd: PoolDir, method: str, path: str, body: dict[str, Any] | None = None,
            timeout_s: float = 10.0) -> dict[str, Any]:
    """One call to the pool's service with the pool's token; RunError saying why if it fails."""
    pd.require_up()
    url = pd.read()["url"] + path
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **bearer(pd.token())})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as e:
        try:
            why = json.loads(e.read()).get("error", e.reason)
        except ValueError:
            why = e.reason
        raise RunError(f"pool {pd.name}: {why}") from None
    except OSError as e:
        raise RunError(f"pool {pd.name} at {url}: {e}") from None


def attach(pd: PoolDir, run_dir: Path, timeout_s: float) -> dict[str, Any]:
    return request(pd, "POST", "/jobs", {"run_dir": str(run_dir.resolve())}, timeout_s=timeout_s)


def detach(pd: PoolDir, job: str, reason: str) -> dict[str, Any]:
    from urllib.parse import quote

    return request(pd, "DELETE", f"/jobs/{job}?reason={quote(reason)}", timeout_s=30.0)


class PoolLease:
    """The pool as one run's controller sees it: `slice` asks for the devices of a call, with the
    run's lease key (derived from its token: the token itself never goes to the pool's port), and
    gives them back when the call is done (also when it fails).

    Calls that need the same models join a slice already granted (one round trip to the pool
    for a batch of generates, not two per generate) while it is younger than the job's quantum;
    the slice goes back when its last call ends. After the quantum a new call asks again, so the
    pool can still pass the devices on."""

    def __init__(self, url: str, session, token: str, job: str = "") -> None:
        self.job = job
        """The run's job name in the pool, for the controller's wrappers."""
        self.url = url.rstrip("/")
        self.session = session
        self.headers = bearer(token)
        self.open: dict[tuple, _Shared] = {}

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        async with self.session.post(self.url + path, json=body, headers=self.headers) as resp:
            data = await resp.json(content_type=None)
            if resp.status != 200:
                raise RunError(f"pool: {path}: {data.get('error') if isinstance(data, dict) else data}")
            return data

    @asynccontextmanager
    async def slice(self, job: str, needs: list[tuple[str, Any]], kind: str) -> AsyncIterator[None]:
        key = (job, tuple((m, str(s)) for m, s in needs), kind)
        shared = self.open.get(key)
        if shared is None or shared.closing or time.monotonic() > shared.join_until:
            shared = self.open[key] = _Shared()
            shared.task = asyncio.ensure_future(self._post(f"/jobs/{job}/slice", {"needs": [list(k) for k in key[1]],
                                                                                   "kind": kind}))
        shared.users += 1
        try:
            granted = await asyncio.shield(shared.task)
            shared.join_until = min(shared.join_until, time.monotonic() + float(granted.get("join_s", 0.0)))
            if shared.renewing is None:
                shared.renewing = asyncio.ensure_future(self._renew(job, granted["call"], float(granted["lease_s"])))
            yield
        finally:
            shared.users -= 1
            if shared.users == 0:
                shared.closing = True
                if self.open.get(key) is shared:
                    del self.open[key]
                if shared.renewing is not None:
                    shared.renewing.cancel()
                if shared.task.done():
                    await self._give_back(job, shared.task)
                else:  # every caller left before the grant: give it back when it comes
                    shared.task.add_done_callback(lambda t: asyncio.ensure_future(self._give_back(job, t)))

    async def _renew(self, job: str, call: str, lease_s: float) -> None:
        """Renew the lease of a granted slice while its calls run (pool.lease_s: one not renewed
        is taken back). A lease the pool has taken back is not renewed again: the calls go on,
        and the next one asks for a slice anew."""
        while True:
            await asyncio.sleep(lease_s / 4)
            try:
                await self._post(f"/jobs/{job}/renew", {"call": call})
            except RunError as e:
                log.warning("%s; its calls go on without it", e)
                return

    async def _give_back(self, job: str, task: asyncio.Future) -> None:
        if not task.cancelled() and task.exception() is None:
            await asyncio.shield(self._post(f"/jobs/{job}/release", {"call": task.result()["call"]}))


class _Shared:
    def __init__(self) -> None:
        self.task: asyncio.Future | None = None
        self.users = 0
        self.closing = False
        self.join_until = float("inf")
        self.renewing: asyncio.Future | None = None
        """Renews the lease of the slice once it is granted."""


def pool_lease(pool: dict[str, Any], session, token: str) -> PoolLease:
    """The lease a run asks its pool for slices with (run.json's `pool`, written by the pool when
    it attached the run)."""
    return PoolLease(pool["url"], session, role_key(token, LEASE_ROLE, pool["job"]), pool["job"])


def server_names(servers: list) -> list[str]:
    """The names the pool gives a run's servers, in order."""
    return [f"rollout-{i}" for i in range(len(servers))]


def pooled_servers(lease: PoolLease, job: str, servers: list) -> list:
    """A run's servers with every generation inside a slice of its pool."""
    from rlctl.plex.gates import PooledRollout

    return [PooledRollout(s, lease, job, n) for s, n in zip(servers, server_names(servers), strict=True)]
