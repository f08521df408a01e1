"""The built-in server gives its memory back and takes it again: SGLang's
/release_memory_occupation and /resume_memory_occupation (docs/sglang.md), for a pool that
multiplexes several runs' models on one device.

SGLang's contract, the same in 0.5.15.post1, 0.5.21 and 0.5.23 (tests/test_memory_states.py
checks it against each wheel): GET or POST with a ReleaseMemoryOccupationReqInput body
`{"tags": [...] | null}`, the tags those of sglang/srt/constants.py (`kv_cache`, `weights`,
`cuda_graph`; null or [] = all); success is HTTP 200 with a JSON `null` body (the handler
returns nothing); a failure is _create_error_response: 400 `{"error": {"message": ...}}`.
The scheduler asserts the server is idle (from 0.5.21 requests queued behind a pause do not
count); SGLang dies on that assertion, and on resuming a tag it never released. This server
refuses both with the error reply instead and stays up, and refuses a tag SGLang does not name
(SGLang records it and frees nothing).

What each tag holds here (rlctl/engines/memory.py moves the bytes):
- weights: the flat parameter buffer, to pinned host memory from a GPU, to a file in a private
  directory (--offload-dir) from the CPU; the flattened-bucket receive buffer is dropped (a
  sync makes it again). Until resumed, /generate is refused and so are weight updates and reads.
- kv_cache: the engine keeps no cache between requests (engine.py's BatchCache lives as its
  requests run), only the rows of requests aborted while no step ran since: those are freed.
- cuda_graph: the server captures no CUDA graphs; nothing to free.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

from rlctl.engines.memory import MemoryTags, ModelWeights, PrivateDir
from rlctl.engines.rollout.builtin.state import ServerState, error
from rlctl.engines.rollout.protocol import parse_version

TAGS = ("kv_cache", "weights", "cuda_graph")  # sglang/srt/constants.py GPU_MEMORY_ALL_TYPES
NOT_IDLE = "release_memory_occupation should be called only when server is idle."  # SGLang's assertion
IDLE_IGNORES_PAUSED_WAITING_SINCE = (0, 5, 21)


class KvCache:
    """The rows the engine's batch cache still holds; freed, and made afresh by later requests."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def nbytes(self) -> int:
        return self.engine.cache_bytes()

    def release(self, where: PrivateDir) -> int:
        n = self.engine.cache_bytes()
        self.engine.drop_cache()
        return n

    def resume(self) -> int:
        return 0


class Dropped:
    """Memory nothing needs back: `drop()` frees it and the next user makes it again."""

    def __init__(self, nbytes, drop) -> None:
        self.nbytes, self.drop = nbytes, drop

    def release(self, where: PrivateDir) -> int:
        n = self.nbytes()
        self.drop()
        return n

    def resume(self) -> int:
        return 0


def unprocessable(msg: str, kind: str = "missing") -> web.Response:
    """FastAPI's reply to a body that does not validate against the route's struct."""
    return web.json_response({"detail": [{"type": kind, "loc": ["body"], "msg": msg}]}, status=422)


async def read_tags(request: web.Request) -> list[str] | None | web.Response:
    """`tags` of a Release/ResumeMemoryOccupationReqInput body (GET or POST); a 422 for a body
    that is missing or not one. Fields of the struct other than tags (rid) are taken and unused."""
    raw = await request.read()
    if not raw:
        return unprocessable("Field required")
    try:
        body = json.loads(raw)
    except ValueError:
        return unprocessable("JSON decode error", "json_invalid")
    if not isinstance(body, dict):
        return unprocessable("Input should be an object", "model_type")
    tags = body.get("tags")
    if tags is not None and not (isinstance(tags, list) and all(isinstance(t, str) for t in tags)):
        return unprocessable("tags: Input should be a valid list of strings", "list_type")
    return tags


class MemoryRoutes:
    def __init__(self, state: ServerState, weights: Any) -> None:
        self.state = state
        self.weights = weights
        """The WeightRoutes: their update lock (no release in the middle of an update) and scratch buffer."""
        self.lock = asyncio.Lock()
        self.params: ModelWeights | None = None

    def setup(self) -> None:
        """Once the model is loaded: the parts under each tag."""
        engine, w = self.state.engine, self.weights
        scratch = Dropped(lambda: sum(t.numel() for t in w.scratch), lambda: w.scratch.clear())
        self.params = ModelWeights(engine.model, self.state.flat)
        parts = {"kv_cache": [KvCache(engine)], "weights": [scratch, self.params], "cuda_graph": []}
        self.state.memory = MemoryTags({t: parts[t] for t in TAGS}, engine.device, self.state.args.offload_dir)

    def _idle(self) -> bool:
        emulated = parse_version(self.state.args.emulate_sglang) if self.state.args.emulate_sglang else None
        ignore_paused = emulated is None or emulated >= IDLE_IGNORES_PAUSED_WAITING_SINCE
        return self.state.engine.idle_for_release(ignore_paused)

    async def _move(self, request: web.Request, release: bool) -> web.Response:
        tags = await read_tags(request)
        if isinstance(tags, web.Response):
            return tags
        memory = self.state.memory
        if memory is None:
            return error("the model is still loading")
        try:
            names = memory.select(tags)
        except ValueError as e:
            return error(str(e))
        failed = await self.move(names, release)
        return error(failed) if failed else web.json_response(None)  # SGLang's handler returns nothing: 200, `null`

    async def move(self, names: list[str], release: bool) -> str | None:
        """Release or resume the memory under `names` (tags known to MemoryTags); why not, or
        None. While anything is released no step runs and generation waits (engine.hold)."""
        memory, engine = self.state.memory, self.state.engine
        if memory is None:
            return "the model is still loading"
        async with self.lock, self.weights.update_lock:
            if release:
                if not self._idle():
                    return NOT_IDLE
                engine.hold(True)  # from here no step runs and /generate is refused
            else:
                resident = [t for t in names if t not in memory.released]
                if resident:
                    return f"cannot resume {resident[0]!r}: it is not released"
            try:
                await asyncio.get_running_loop().run_in_executor(None, self._in_lock, memory, release, names)
            except Exception as e:  # noqa: BLE001 - a tag moves whole or not at all (MemoryTags); say why
                return f"{'release' if release else 'resume'}_memory_occupation failed: {e}"
            finally:
                engine.hold(bool(memory.released))
        return None

    def _in_lock(self, memory: MemoryTags, release: bool, names: list[str]) -> None:
        with self.state.engine.model_lock:
            (memory.release if release else memory.resume)(names)

    async def release_memory_occupation(self, request: web.Request) -> web.Response:
        return await self._move(request, release=True)

    async def resume_memory_occupation(self, request: web.Request) -> web.Response:
        return await self._move(request, release=False)

    async def memory(self, request: web.Request) -> web.Response:
        """rlctl-only: what the weights take on the device, and what is there now (for the pool)."""
        memory = self.state.memory
        if memory is None:
            return web.Response(status=503, text="loading")
        resident = memory.resident()
        return web.json_response({"weights_bytes": self.params.nbytes(),
                                  "resident": {"weights": resident["weights"], "kv_cache": resident["kv_cache"]}})
