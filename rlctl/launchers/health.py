"""Is a rollout server up? The blocking check the launchers poll with: the local supervisor while
its servers start, and the Slurm job's `health` step before it starts the trainers. (The
controller's asyncio clients in rlctl/engines/ have their own.)"""

from __future__ import annotations

import urllib.request

HEALTH_TIMEOUT_S = 2.0


def healthy(url: str, timeout_s: float = HEALTH_TIMEOUT_S) -> bool:
    """GET url/health answers 200."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout_s) as resp:
            return resp.status == 200
    except OSError:
        return False
