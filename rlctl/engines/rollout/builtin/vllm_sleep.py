"""vLLM's sleep mode, as the built-in server emulating vLLM answers it (dev routes, as in vLLM's
vllm/entrypoints/serve/dev/sleep/api_router.py of 0.33.0 and 0.34.0; tests/test_vllm_contract.py).

    POST /sleep?level=0|1|2&mode=abort|wait|keep   pause the scheduler; level >= 1 also puts the
         weights and the KV cache to sleep. {"status": "sleeping", "level": L}
    POST /wake_up[?tags=weights&tags=kv_cache]     wake those tags (all without any); scheduling
         resumes once nothing sleeps. {"status": "awake" | "sleeping", "tags": [...] | null}
    GET  /is_sleeping                              {"is_sleeping": paused or anything asleep}
    POST /release_kv_cache_memory                  after a completed pause, with everything awake:
         the KV cache to sleep. {"status": "kv_cache_released"}

What vLLM does, the emulation does (vllm/v1/engine/core.py, vllm/v1/executor/abstract.py): a
second sleep while the weights sleep is a warning and no change; a wake with a tag that is not
asleep is a warning and no change; /release_kv_cache_memory without a completed pause, or with
something asleep, is refused (a RuntimeError: 500). Memory moves only for a server started with
--enable-sleep-mode (vLLM's CuMem pool holds only what was allocated under it); without it the
tags change and nothing leaves the device. Difference that remains: level 2 keeps the weights'
bytes, where vLLM discards them (a weight update must follow before serving).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from aiohttp import web

from rlctl.engines.rollout.builtin.vllm_routes import PAUSE_MODES, error_response

if TYPE_CHECKING:
    from rlctl.engines.rollout.builtin.memory_routes import MemoryRoutes
    from rlctl.engines.rollout.builtin.state import ServerState
    from rlctl.engines.rollout.builtin.vllm_routes import VllmRoutes

log = logging.getLogger("rlctl.rollout")

SLEEP_TAGS = ("weights", "kv_cache")
"""vLLM's SLEEP_TAGS: what a sleep of level 1 or 2 puts to sleep."""


def query_error(field: str, kind: str, msg: str) -> web.Response:
    """FastAPI's 422 for a query parameter that fails its type or bounds."""
    return web.json_response({"detail": [{"type": kind, "loc": ["query", field], "msg": msg}]}, status=422)


class VllmSleep:
    def __init__(self, state: ServerState, routes: VllmRoutes, memory: MemoryRoutes) -> None:
        self.state, self.routes, self.memory = state, routes, memory
        self.sleeping: set[str] = set()
        """The executor's sleeping_tags."""

    def table(self) -> list[tuple[str, str, object]]:
        return [("POST", "/sleep", self.sleep), ("POST", "/wake_up", self.wake_up),
                ("GET", "/is_sleeping", self.is_sleeping),
                ("POST", "/release_kv_cache_memory", self.release_kv_cache_memory)]

    async def _move(self, tags: list[str], release: bool) -> web.Response | None:
        """The tags' memory off the device or back, where sleep mode is on; a 500 if that fails."""
        if not self.state.args.enable_sleep_mode:
            return None
        failed = await self.memory.move(tags, release)
        return error_response(failed, 500, "InternalServerError") if failed else None

    async def sleep(self, request: web.Request) -> web.Response:
        try:
            level = int(request.query.get("level", "1"))
        except ValueError:
            return query_error("level", "int_parsing", "Input should be a valid integer")
        if not 0 <= level <= 2:
            return query_error("level", "less_than_equal" if level > 2 else "greater_than_equal",
                               "Input should be less than or equal to 2" if level > 2 else
                               "Input should be greater than or equal to 0")
        mode = request.query.get("mode", "abort")
        if mode not in PAUSE_MODES:
            return query_error("mode", "literal_error", f"Input should be one of {PAUSE_MODES}")
        await self.routes.pause_scheduler(mode)
        if level >= 1:
            if "weights" in self.sleeping:
                log.warning("Executor is already sleeping.")
            else:
                failed = await self._move([t for t in SLEEP_TAGS if t not in self.sleeping], release=True)
                if failed is not None:
                    return failed
                self.sleeping |= set(SLEEP_TAGS)
        return web.json_response({"status": "sleeping", "level": level})

    async def wake_up(self, request: web.Request) -> web.Response:
        tags = request.query.getall("tags", []) or None
        woken = [t for t in (tags or SLEEP_TAGS) if t != "scheduling" and t in self.sleeping]
        if not self.sleeping:
            log.warning("Executor is not sleeping.")
        elif tags and any(t not in self.sleeping for t in tags if t != "scheduling"):
            log.warning("Tag %s is not in sleeping tags %s", tags, sorted(self.sleeping))
        elif woken:
            failed = await self._move(woken, release=False)
            if failed is not None:
                return failed
            self.sleeping -= set(woken)
        awake = not self.sleeping
        if awake:
            self.routes.resume_scheduler()
        return web.json_response({"status": "awake" if awake else "sleeping", "tags": tags})

    async def is_sleeping(self, request: web.Request) -> web.Response:
        return web.json_response({"is_sleeping": self.routes.paused or bool(self.sleeping)})

    async def release_kv_cache_memory(self, request: web.Request) -> web.Response:
        engine = self.state.engine
        if not (self.routes.paused and engine is not None and engine.idle):
            return error_response("release_kv_cache_memory() requires a completed pause first", 500,
                                  "InternalServerError")
        if self.sleeping:
            return error_response("release_kv_cache_memory() requires all executor memory to be resident", 500,
                                  "InternalServerError")
        failed = await self._move(["kv_cache"], release=True)
        if failed is not None:
            return failed
        self.sleeping.add("kv_cache")
        return web.json_response({"status": "kv_cache_released"})
