"""TokenDoor: the run's token on every route of a vLLM server but /health.

vLLM's own api-key middleware guards only /v1, /v2, /inference and /cohere; the dev routes a
trainer drives (/pause, /update_weights, ...) would be open. vLLM adds this class with
`--middleware rlctl.engines.rollout.vllm.auth.TokenDoor` (it calls `TokenDoor(app)`), so it reads
the token where vLLM reads its own: VLLM_API_KEY in the server's environment. Plain ASGI, no
imports beyond the standard library: it loads inside vLLM's process.

Every method asks, OPTIONS included. vLLM's own check lets OPTIONS through unasked (for a
browser's CORS preflight, serve/middleware/authenticate.py), but behind it an OPTIONS request that
is no preflight goes on to the routes, and the /metrics mount (prometheus' app) answers it with
the server's metrics whatever the method. A run's clients never send OPTIONS, and a run's vLLM
allows no browser origin anyway (--allowed-origins is empty by default, so vLLM's CORS middleware
refuses every preflight): nothing is lost by asking.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os

OPEN_PATHS = frozenset({"/health"})


class TokenDoor:
    def __init__(self, app, token: str | None = None) -> None:
        self.app = app
        token = token if token is not None else os.environ.get("VLLM_API_KEY", "")
        if not token:
            raise RuntimeError("TokenDoor: VLLM_API_KEY is not set; the server would be open to anyone")
        self.digest = hashlib.sha256(token.encode()).digest()

    def allowed(self, scope) -> bool:
        path = scope["path"].removeprefix(scope.get("root_path", ""))  # as vLLM's own check reads it
        if path in OPEN_PATHS:
            return True
        for name, value in scope.get("headers", ()):
            if name.lower() == b"authorization":
                scheme, _, given = value.decode("latin-1").partition(" ")
                return scheme.lower() == "bearer" and hmac.compare_digest(
                    hashlib.sha256(given.encode()).digest(), self.digest)
        return False

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket") or self.allowed(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = json.dumps({"error": "Unauthorized"}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
