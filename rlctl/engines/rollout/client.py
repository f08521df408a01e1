"""One async client for the SGLang HTTP protocol: it drives real SGLang and the built-in server.

Request bodies carry only fields of SGLang's own request structs, and replies are read in the
shapes SGLang's handlers give (tests/test_sglang_contract.py derives both from SGLang's source);
a refusal becomes a RunError naming the server, the endpoint and the server's message.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from rlctl.engines.rollout.protocol import UPDATE_SESSION_SINCE, GenerateOutput, SamplingRequest, parse_version
from rlctl.errors import RunError, ServerUnreachable

__all__ = ["GenerateOutput", "RolloutClient", "SamplingRequest", "healthy", "wait_healthy"]

HEALTH_POLL_S = 0.2


async def healthy(session: aiohttp.ClientSession, url: str) -> bool:
    """GET url/health answers 200 within 5 s (rollout servers and the trainer service alike)."""
    try:
        async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=5)) as resp:
            return resp.status == 200
    except (TimeoutError, aiohttp.ClientError):
        return False


async def wait_healthy(session: aiohttp.ClientSession, url: str, timeout_s: float,
                       alive: Callable[[], bool] = lambda: True) -> None:
    """Poll url/health until it answers; RunError when `alive()` says its process is gone or
    after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await healthy(session, url):
            return
        if not alive():
            raise RunError(f"{url}: server process exited before it became healthy; see its log")
        await asyncio.sleep(HEALTH_POLL_S)
    raise RunError(f"{url}: not healthy after {timeout_s:.0f} s; see its log")


class RolloutClient:
    """One server. `name` is how the scheduler's pool and the events call it (its role name,
    rollout-0, ...; its URL by default)."""

    def __init__(self, url: str, session: aiohttp.ClientSession, api_key: str | None = None, *,
                 name: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.name = name or self.url
        self.session = session
        self.set_key(api_key)

    def set_key(self, api_key: str | None) -> None:
        """The credential every request but the probes carries (this server's own key in a run)."""
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def __repr__(self) -> str:
        return f"RolloutClient({self.url})"

    async def _get_json(self, path: str) -> Any:
        async with self.session.get(self.url + path, headers=self.headers) as resp:
            if resp.status != 200:
                raise RunError(f"{self.url}{path}: HTTP {resp.status}: {(await resp.text())[:200]}")
            return await resp.json()

    async def _post(self, path: str, body: dict[str, Any]) -> aiohttp.ClientResponse:
        try:
            return await self.session.post(self.url + path, json=body, headers=self.headers)
        except aiohttp.ServerDisconnectedError:
            # A pooled keep-alive connection the server closed just as the request went out: the
            # server never saw the request, so it is sent once more on a fresh connection.
            return await self.session.post(self.url + path, json=body, headers=self.headers)

    async def _control(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST a control request. SGLang answers these in two shapes (tests/test_sglang_contract.py
        derives them from its source): {"success", "message", ...} with 200 or 400, and, for
        pause/continue_generation, {"message", "status": "ok"} with 200. Taken: HTTP 200 and no
        `success: false`; anything else is a refusal, reported with the server's message."""
        try:
            async with await self._post(path, body) as resp:
                status, text = resp.status, await resp.text()
        except aiohttp.ClientError as e:
            raise ServerUnreachable(f"{self.url}{path}: server unreachable ({e})") from None
        try:
            data = json.loads(text) if text else {}
        except ValueError:
            data = text
        if status != 200 or (isinstance(data, dict) and data.get("success") is False):
            msg = data.get("message", data.get("detail", data)) if isinstance(data, dict) else str(data)
            if isinstance(data, dict) and isinstance(data.get("error"), dict):  # _create_error_response's shape
                msg = data["error"].get("message", msg)
            raise RunError(f"{self.url}{path}: refused (HTTP {status}): {str(msg)[:300]}")
        return data if isinstance(data, dict) else {}

    # -- health and info -----------------------------------------------------------------------

    async def wait_healthy(self, timeout_s: float, alive: Callable[[], bool] = lambda: True) -> None:
        await wait_healthy(self.session, self.url, timeout_s, alive)

    async def server_info(self) -> dict[str, Any]:
        return await self._get_json("/server_info")

    async def model_info(self) -> dict[str, Any]:
        return await self._get_json("/model_info")

    async def weight_version(self) -> str:
        return str((await self.model_info())["weight_version"])

    async def needs_update_session(self) -> bool:
        """Does this server refuse weight updates outside /begin_weight_update ... /end?"""
        info = await self.server_info()
        if "weight_update_session" in info:
            return bool(info["weight_update_session"])
        version = parse_version(str(info.get("version", "")))
        return version is not None and version >= UPDATE_SESSION_SINCE

    # -- generation ----------------------------------------------------------------------------

    async def generate(self, input_ids: list[int], sampling: SamplingRequest, rid: str,
                       return_logprob: bool = True) -> GenerateOutput:
        body = {
            "input_ids": input_ids,
            "sampling_params": sampling.to_json(),
            "return_logprob": return_logprob,
            "logprob_start_len": -1,
            "rid": rid,
        }
        try:
            async with await self._post("/generate", body) as resp:
                if resp.status != 200:
                    raise RunError(f"{self.url}/generate: HTTP {resp.status}: {(await resp.text())[:200]}")
                data = await resp.json()
        except aiohttp.ClientError as e:
            raise ServerUnreachable(f"{self.url}/generate: server unreachable ({e})") from None
        meta = data["meta_info"]
        logprobs = [item[0] for item in meta.get("output_token_logprobs") or []]
        return GenerateOutput(
            rid=rid,
            output_ids=list(data["output_ids"]),
            logprobs=logprobs,
            finish_reason=meta.get("finish_reason") or {},
            weight_version=str(meta.get("weight_version", "")),
            prompt_tokens=int(meta.get("prompt_tokens", len(input_ids))),
            completion_tokens=int(meta.get("completion_tokens", len(data["output_ids"]))),
            text=data.get("text"),
        )

    async def abort(self, rid: str = "", abort_all: bool = False) -> None:
        async with await self._post("/abort_request", {"rid": rid, "abort_all": abort_all}):
            pass

    async def pause_generation(self, mode: str = "abort") -> None:
        await self._control("/pause_generation", {"mode": mode})

    async def continue_generation(self) -> None:
        await self._control("/continue_generation", {})

    async def flush_cache(self, timeout_s: float = 60.0) -> None:
        """SGLang answers 400 while requests run: retry until it takes."""
        deadline = time.monotonic() + timeout_s
        while True:
            async with await self._post("/flush_cache", {}) as resp:
                if resp.status == 200:
                    return
            if time.monotonic() > deadline:
                raise RunError(f"{self.url}/flush_cache: still busy after {timeout_s:.0f} s")
            await asyncio.sleep(0.05)

    # -- weight sync (receiver side of the group lives in the server) --------------------------

    async def init_weights_update_group(self, *, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str, backend: str) -> None:
        await self._control("/init_weights_update_group", {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        })

    async def begin_weight_update(self) -> None:
        await self._control("/begin_weight_update", {})

    async def end_weight_update(self) -> None:
        await self._control("/end_weight_update", {})

    async def update_weights_from_distributed(self, *, names: list[str], dtypes: list[str],
                                              shapes: list[list[int]], group_name: str,
                                              weight_version: str | None, flattened: bool) -> None:
        await self._control("/update_weights_from_distributed", {
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": group_name,
            "flush_cache": True,
            "abort_all_requests": False,
            "weight_version": weight_version,
            "load_format": "flattened_bucket" if flattened else None,
        })

    async def update_weights_from_tensor(self, payloads: list[str], *, weight_version: str | None,
                                         load_format: str | None = "flattened_bucket") -> None:
        """Hand over one bucket in place (rlctl/engines/weightsync/ipc.py): `payloads` holds one
        pickle per TP rank of the server, base64 as SGLang's HTTP route takes it: a flattened
        bucket (ipc.dumps_bucket), or with load_format None a list of (name, tensor) (ipc.dumps)."""
        await self._control("/update_weights_from_tensor", {
            "serialized_named_tensors": payloads,
            "load_format": load_format,
            "flush_cache": True,
            "abort_all_requests": False,
            "weight_version": weight_version,
        })

    async def update_weight_version(self, new_version: str) -> None:
        await self._control("/update_weight_version", {"new_version": new_version, "abort_all_requests": False})

    async def destroy_weights_update_group(self, group_name: str) -> None:
        await self._control("/destroy_weights_update_group", {"group_name": group_name})

    async def weight_checksums(self) -> dict[str, Any]:
        """Built-in server only."""
        return await self._get_json("/rlctl/weight_checksums")

    # -- memory (a shared pool multiplexes several runs' models on one device) -------------------

    async def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Give back the memory under `tags` (SGLang's `kv_cache`, `weights`, `cuda_graph`; None =
        all). The server must be idle (nothing running; queued requests only behind a pause), and
        serves nothing until it is resumed. SGLang answers 200 with a `null` body."""
        await self._control("/release_memory_occupation", {"tags": tags})

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Take the memory under `tags` back (None = all); each must have been released."""
        await self._control("/resume_memory_occupation", {"tags": tags})

    async def memory(self) -> dict[str, Any]:
        """Built-in server only: {"weights_bytes": int, "resident": {"weights": bool, "kv_cache": bool}}."""
        return await self._get_json("/rlctl/memory")
