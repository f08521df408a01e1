"""The controller's side of the trainer service (rlctl/engines/train/service.py), the trainer
twin of rlctl/engines/rollout/client.py."""

from __future__ import annotations

import json
import time
from typing import Any

import aiohttp

from rlctl.process.auth import bearer
from rlctl.engines.rollout.client import wait_healthy
from rlctl.errors import RunError
from rlctl.process.watchdog import CallTimer
from rlctl.recipe.checks import clip_message


def refusal(text: str) -> str:
    """What a refusing trainer said, on one line: its own errors are JSON with a `message`
    (aiohttp's 500 page is not). A long path in it is cut in its middle and the whole kept to 400
    characters, so the end of the message, which says what to do, is not what is lost."""
    try:
        said = json.loads(text)
        message = said["message"] if isinstance(said, dict) and isinstance(said.get("message"), str) else text
    except ValueError:
        message = text
    return clip_message(" ".join(message.split()))


class TrainerClient:
    def __init__(self, url: str, session: aiohttp.ClientSession, token: str | None = None,
                 timer: CallTimer | None = None) -> None:
        self.url = url
        self.session = session
        self.set_key(token)
        self.timer = timer
        """Each call's deadline (rlctl/process/watchdog.py); None: calls wait as long as they take."""

    def set_key(self, key: str | None) -> None:
        """The trainer's own key (rlctl/process/auth.py role_key), asked by every route but /health."""
        self.headers = bearer(key)

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return json.loads(await self._call("POST", path, body))

    async def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> str:
        """The reply's text; RunError when the trainer refuses, cannot be reached, or does not
        answer before the call's deadline (a frozen or hung trainer)."""
        timeout = self.timer.timeout(path) if self.timer else None
        start = time.monotonic()
        try:
            async with self.session.request(method, self.url + path, json=body, headers=self.headers,
                                            timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                text = await resp.text()
                if resp.status != 200:
                    raise RunError(f"trainer {path}: HTTP {resp.status}: {refusal(text)}; see the trainer's log")
        except aiohttp.ClientError as e:
            raise RunError(f"trainer {self.url}{path}: unreachable ({e})") from None
        except TimeoutError:
            assert self.timer is not None and timeout is not None
            raise RunError(f"trainer {path}: no answer within {timeout:.0f} s ({self.timer.explain(path)}): the "
                           "trainer is frozen or hung; see its log") from None
        if self.timer:
            self.timer.observe(path, time.monotonic() - start)
        return text

    async def wait_healthy(self, timeout_s: float) -> None:
        await wait_healthy(self.session, self.url, timeout_s)

    async def info(self) -> dict[str, Any]:
        """{version, ranks, parameters, memory: {weights_bytes, optimizer_bytes, resident: {weights, optimizer}}}."""
        return json.loads(await self._call("GET", "/info"))

    async def weight_checksums(self) -> dict[str, Any]:
        return json.loads(await self._call("GET", "/weight_checksums"))

    async def init_weight_sync(self, servers: list[dict[str, str]], master_address: str, master_port: int,
                               backend: str, bucket_mb: float, protocol: str = "sglang",
                               server: dict[str, Any] | None = None, from_ranks: list[list[int]] | None = None) -> None:
        """`servers`: each one's url, role and key_id (rlctl/control/controller.py RunKeys.servers);
        `protocol`: what the servers speak ("sglang" or "vllm"); `server`: for vLLM, what they
        hold their weights as ({"dtype", "model_path"}), which vLLM has no route to tell;
        `from_ranks`: colocated, the trainer ranks that hand each server its weights (None: rank 0)."""
        await self._post("/init_weight_sync", {"servers": servers, "master_address": master_address,
                                               "master_port": master_port, "backend": backend,
                                               "bucket_mb": bucket_mb, "protocol": protocol, "server": server,
                                               "from_ranks": from_ranks})

    async def accumulate(self, samples: list[dict[str, Any]]) -> dict[str, float]:
        return await self._post("/accumulate", {"samples": samples})

    async def train(self, samples: list[dict[str, Any]]) -> dict[str, float]:
        return await self._post("/train", {"samples": samples})

    async def sync_weights(self, version: int, pause_mode: str = "abort") -> dict[str, Any]:
        return await self._post("/sync_weights", {"version": str(version), "pause_mode": pause_mode})

    async def save_checkpoint(self, path: str) -> dict[str, Any]:
        """The trainer writes its part of a checkpoint (weights as HF, optimizer, RNG) into path."""
        return await self._post("/save_checkpoint", {"dir": path})

    async def save_policy(self, path: str) -> dict[str, Any]:
        """The trainer writes the policy alone into path/hf (a completed run's final policy)."""
        return await self._post("/save_policy", {"dir": path})

    async def load_checkpoint(self, path: str) -> dict[str, Any]:
        """The trainer continues from the checkpoint in path; returns its weight version."""
        return await self._post("/load_checkpoint", {"dir": path})

    async def release_memory_occupation(self, tags: list[str] | None = None) -> dict[str, Any]:
        """Every rank moves `tags` (weights, optimizer; None = both) to host memory, between train
        steps: {"released": [tags moved now], "bytes", "seconds"}."""
        return await self._post("/release_memory_occupation", {"tags": tags})

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> dict[str, Any]:
        """Bring them back, bit for bit: {"resumed": [tags moved now], "bytes", "seconds"}."""
        return await self._post("/resume_memory_occupation", {"tags": tags})
