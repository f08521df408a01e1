"""VllmClient: one vLLM server (or a built-in server emulating one), for the controller and the trainer.

The controller asks every rollout client the same things (generate, abort, pause, continue); this
client asks them of vLLM's OpenAI server in dev mode, in the shapes vLLM's own source gives
(tests/test_vllm_contract.py derives each one from the wheels of the releases rlctl speaks):

- generate: POST /v1/completions with the prompt as token ids, `logprobs: 0` (the sampled token's
  log-prob only), `return_token_ids`, `return_tokens_as_token_ids` (no tokenizer needed for the
  log-prob entries) and `return_weight_versions` (spans [start, end) of output tokens and the
  weight version that sampled them). The request id is ours; vLLM runs it as "cmpl-{id}-0".
- abort: POST /abort_requests {"request_ids": ["cmpl-{id}-0"]} (dev mode); an unknown id is no error.
- pause: POST /pause?mode=abort (a query parameter; the body is not read); POST /resume. Replies
  carry `status` ("paused", "resumed"), not `success`. While paused, new requests are refused
  with 503 (ServiceUnavailableError): generate waits and sends them again.
- version: GET /version; the weight version: GET /weight_info; ranks: GET /get_world_size.
- sleep mode (dev mode, and --enable-sleep-mode for memory to move): POST /sleep?level=&mode=,
  POST /wake_up?tags=..., GET /is_sleeping, POST /release_kv_cache_memory; SGLang's
  release/resume_memory_occupation calls map onto them for a colocated run's turns.

A dev route that answers 404 means a server started without VLLM_SERVER_DEV_MODE=1.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from rlctl.engines.rollout.client import RolloutClient
from rlctl.engines.rollout.protocol import GenerateOutput, SamplingRequest
from rlctl.errors import RunError, ServerUnreachable

PAUSED_RETRY_S = 0.05
"""How soon a request refused with 503 is first sent again (then twice as long each time, up to 0.25 s)."""
RETRY_LIMIT_S = 1800.0
"""How long a server may keep refusing with 503 (paused for a sync of a large model, or its
queue full) before the request fails."""


def engine_request_id(rid: str) -> str:
    """The id vLLM's completions handler runs a one-prompt request under (its abort key)."""
    return f"cmpl-{rid}-0"


def completion_body(input_ids: list[int], sampling: SamplingRequest, rid: str, model: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt": list(input_ids),
        "max_tokens": sampling.max_new_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": max(sampling.top_k, 0),  # vLLM: 0 = all (it takes -1 too, "but prefer 0")
        "stop_token_ids": list(sampling.stop_token_ids),
        "ignore_eos": sampling.ignore_eos,
        "logprobs": 0,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "return_weight_versions": True,
        "request_id": rid,
    }
    if model:
        body["model"] = model
    return body


def finish_reason(choice: dict[str, Any]) -> dict[str, Any]:
    """vLLM's finish_reason string as the controller reads SGLang's: {"type": ...}."""
    reason = choice.get("finish_reason")
    out: dict[str, Any] = {"type": str(reason) if reason is not None else ""}
    if choice.get("stop_reason") is not None:
        out["matched"] = choice["stop_reason"]
    return out


class VllmClient(RolloutClient):
    protocol = "vllm"

    def __init__(self, *args: Any, model: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.model = model
        """The served model's name (vLLM's --served-model-name, its model path by default); None: vLLM's own default."""

    def __repr__(self) -> str:
        return f"VllmClient({self.url})"

    async def _get_json(self, path: str) -> Any:
        async with self.session.get(self.url + path, headers=self.headers) as resp:
            if resp.status == 404 and path in DEV_GETS + SLEEP_GETS:
                raise RunError(f"{self.url}{path}: not found: the server was started without VLLM_SERVER_DEV_MODE=1, "
                               "which vLLM needs for the routes a trainer drives")
            if resp.status != 200:
                raise RunError(f"{self.url}{path}: HTTP {resp.status}: {(await resp.text())[:200]}")
            return await resp.json()

    async def _control(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            return await super()._control(path, body)
        except RunError as e:
            if "(HTTP 404)" in str(e):
                raise RunError(f"{self.url}{path.split('?')[0]}: not found: the server was started without "
                               "VLLM_SERVER_DEV_MODE=1, which vLLM needs for the routes a trainer drives") from None
            raise

    # -- health and info -----------------------------------------------------------------------

    async def version(self) -> str:
        return str((await self._get_json("/version"))["version"])

    async def world_size(self) -> int:
        """Ranks this server's workers take in the weight-transfer group (TP x PP x DP)."""
        return int((await self._get_json("/get_world_size"))["world_size"])

    async def weight_version(self) -> str:
        return str((await self._get_json("/weight_info"))["weight_version"])

    async def server_info(self) -> dict[str, Any]:
        """What the controller and the sender ask of any server, gathered from vLLM's routes."""
        version, world = await asyncio.gather(self.version(), self.world_size())
        return {"version": version, "tp_size": world}

    async def needs_update_session(self) -> bool:
        return True  # start_weight_update ... finish_weight_update, always

    # -- generation ----------------------------------------------------------------------------

    async def generate(self, input_ids: list[int], sampling: SamplingRequest, rid: str,
                       return_logprob: bool = True) -> GenerateOutput:
        body = completion_body(input_ids, sampling, rid, self.model)
        delay, deadline = PAUSED_RETRY_S, asyncio.get_running_loop().time() + RETRY_LIMIT_S
        while True:
            try:
                async with await self._post("/v1/completions", body) as resp:
                    status = resp.status
                    data = await resp.json(content_type=None) if status in (200, 503) else await resp.text()
            except aiohttp.ClientError as e:
                raise ServerUnreachable(f"{self.url}/v1/completions: server unreachable ({e})") from None
            if status == 503 and asyncio.get_running_loop().time() < deadline:  # paused for a sync: sent again
                await asyncio.sleep(delay)
                delay = min(2 * delay, 0.25)
                continue
            if status != 200:
                raise RunError(f"{self.url}/v1/completions: HTTP {status}: {str(data)[:200]}")
            break
        choice = data["choices"][0]
        output_ids = [int(t) for t in choice.get("token_ids") or []]
        logprobs = [float(x) for x in ((choice.get("logprobs") or {}).get("token_logprobs") or [])]
        spans = choice.get("weight_versions") or []
        # A sample generated across an update (pause mode keep) has several spans: the oldest counts.
        stamp = str(spans[0]["version"]) if spans else await self.weight_version()
        usage = data.get("usage") or {}
        return GenerateOutput(
            rid=rid, output_ids=output_ids, logprobs=logprobs, finish_reason=finish_reason(choice),
            weight_version=stamp, prompt_tokens=int(usage.get("prompt_tokens", len(input_ids))),
            completion_tokens=len(output_ids), text=choice.get("text"))

    async def abort(self, rid: str = "", abort_all: bool = False) -> None:
        body = {} if abort_all else {"request_ids": [engine_request_id(rid)]}
        await self._control("/abort_requests", body)

    async def pause_generation(self, mode: str = "abort") -> None:
        await self._control(f"/pause?mode={mode}", {})

    async def continue_generation(self) -> None:
        await self._control("/resume", {})

    async def flush_cache(self, timeout_s: float = 60.0) -> None:
        """vLLM's pause clears the caches itself (clear_cache defaults to true)."""

    async def is_paused(self) -> bool:
        return bool((await self._get_json("/is_paused"))["is_paused"])

    # -- sleep mode (a colocated run's turns: rlctl/control/colocate.py) ------------------------

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """Pause the scheduler (mode) and, level 1, move the weights to host memory and drop the KV
        cache; level 2 drops both. Memory moves only on a server started with --enable-sleep-mode."""
        await self._control(f"/sleep?level={level}&mode={mode}", {})

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        """Wake those tags (all without any); True once nothing sleeps and scheduling resumed."""
        query = "&".join(f"tags={t}" for t in tags or [])
        return (await self._control("/wake_up" + (f"?{query}" if query else ""), {})).get("status") == "awake"

    async def is_sleeping(self) -> bool:
        return bool((await self._get_json("/is_sleeping"))["is_sleeping"])

    async def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """SGLang's call in vLLM's terms: the weights go with the KV cache (/sleep level 1: the
        weights kept in host memory, as a turn back that is no sync needs them); the KV cache
        alone after a completed pause (/release_kv_cache_memory)."""
        if tags is None or "weights" in tags:
            await self.sleep(1, "abort")
        else:
            await self.pause_generation("abort")
            await self._control("/release_kv_cache_memory", {})

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        await self.wake_up(tags)

    # -- weight transfer (the receiving side lives in the server's workers) ----------------------

    async def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        await self._control("/init_weight_transfer_engine", {"init_info": init_info})

    async def start_weight_update(self) -> None:
        await self._control("/start_weight_update", {})

    async def update_weights(self, *, names: list[str], dtype_names: list[str], shapes: list[list[int]]) -> None:
        await self._control("/update_weights", {"update_info": {"names": names, "dtype_names": dtype_names,
                                                                "shapes": shapes}})

    async def finish_weight_update(self, weight_version: str | None) -> None:
        await self._control("/finish_weight_update", {"weight_version": weight_version})

    async def shutdown_weight_transfer_engine(self) -> None:
        await self._control("/shutdown_weight_transfer_engine", {})

    async def update_weight_version(self, new_version: str) -> None:
        await self._control("/update_weight_version", {"new_version": new_version})


DEV_GETS = ("/is_paused", "/weight_info", "/get_world_size")
"""GET routes of vLLM's RL router, which it registers only in dev mode: a 404 there means dev mode is off."""
SLEEP_GETS = ("/is_sleeping",)
"""GET routes of vLLM's sleep router, dev mode only as well."""

