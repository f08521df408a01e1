"""A process that takes a dead rollout server's port before the run starts it again (on a shared
node: anyone's job). What it hears opens nothing: probes carry no credential, and a request
carries only the dead process's own key (rlctl/process/auth.py role_key). The run does not take it for
its server (it answers /health, but no start of the run has recorded a new key), the real
server's restarts fail on the held port and say so, and once the port is free the server is
started again, rejoins with the weights, and the run goes on."""

from __future__ import annotations

import os
import signal
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from conftest import FAST, QUICKSTART, rejoined, rlctl, wait_for
from rlctl.process.auth import bearer, key_of, read_token
from rlctl.run.dir import RunDir

pytestmark = pytest.mark.e2e


class Impostor(ThreadingHTTPServer):
    """Answers every request as a healthy server would, and keeps what each one carried."""

    allow_reuse_address = True
    daemon_threads = True

    def __init__(self, port: int) -> None:
        self.heard: list[tuple[str, str | None]] = []

        class Handler(BaseHTTPRequestHandler):
            def _answer(handler) -> None:  # noqa: N805 - the handler's own self
                length = int(handler.headers.get("Content-Length") or 0)
                handler.rfile.read(length)
                self.heard.append((handler.path, handler.headers.get("Authorization")))
                body = b"" if handler.path.startswith("/health") else b'{"success": true}'
                handler.send_response(200)
                handler.send_header("Content-Type", "application/json")
                handler.send_header("Content-Length", str(len(body)))
                handler.end_headers()
                handler.wfile.write(body)

            do_GET = do_POST = _answer

            def log_message(handler, *args) -> None:  # noqa: N805
                pass

        super().__init__(("127.0.0.1", port), Handler)


def take_port(port: int, timeout: float = 5.0) -> Impostor:
    """Bind the port the moment the killed process has let it go."""
    return wait_for(lambda: _try_bind(port), timeout, f"port {port} to be free")


def _try_bind(port: int) -> Impostor | None:
    try:
        return Impostor(port)
    except OSError:
        return None


def opens(url: str, path: str, credential: str) -> int:
    request = urllib.request.Request(url + path, headers={"Authorization": credential})
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code


def test_a_process_on_a_dead_servers_port_learns_nothing_and_the_server_comes_back(tmp_path):
    res = rlctl("launch", "--detach", str(QUICKSTART), *FAST, "run.steps=5000", "rollout.max_restarts=60",
                f"run.output_dir={tmp_path / 'runs'}", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    rd = RunDir(tmp_path / "runs" / res.stdout.strip().splitlines()[-1])
    try:
        wait_for(lambda: any(e["event"] == "step_end" for e in rd.events()), 300, "the first step")
        token = read_token(rd.path)
        victim = rd.read()["processes"]["rollout-1"]
        old_key = key_of(token, rd.read()["processes"], "rollout-1")
        os.killpg(victim["pid"], signal.SIGKILL)
        impostor = take_port(victim["port"])
        threading.Thread(target=impostor.serve_forever, daemon=True).start()
        try:
            # Held while the run's own restarts of the server find the port taken, and its
            # watch keeps probing the impostor.
            wait_for(lambda: sum(e["event"] == "server_restarted" and e["role"] == "rollout-1"
                                 for e in rd.events()) >= 3, 180, "two restarts to find the port taken")
            wait_for(lambda: sum(p.startswith("/health") for p, _ in impostor.heard) >= 5, 60, "probes")
            steps_while_held = sum(e["event"] == "step_end" for e in rd.events())
        finally:
            impostor.shutdown()
            impostor.server_close()
        assert not any(e["event"] == "server_back" and e["server"] == "rollout-1" for e in rd.events())
        log = rd.log_path("rollout-1").read_text()
        assert "cannot listen on" in log and "another process holds the port" in log

        back = wait_for(lambda: rejoined(rd, "rollout-1"), 300, "rollout-1 to rejoin")
        wait_for(lambda: any(e["event"] == "step_end" and e["t"] > back["t"] for e in rd.events()), 300,
                 "a step after the rejoin")
        assert steps_while_held >= 1 or sum(e["event"] == "step_end" for e in rd.events()) > steps_while_held

        # What it heard: keyless probes, and at most the dead process's own key.
        heard = {auth for _, auth in impostor.heard}
        assert heard <= {None, f"Bearer {old_key}"}, heard
        assert all(auth is None for path, auth in impostor.heard if path.startswith("/health"))
        # That key opens nothing that lives: not the restarted server, the other one, the trainer.
        processes, plan = rd.read()["processes"], rd.read()["plan"]
        trainer = f"http://127.0.0.1:{plan['trainers'][0]['port']}"
        servers = [f"http://127.0.0.1:{r['port']}" for r in plan["rollout"]]
        assert key_of(token, processes, "rollout-1") != old_key
        for url, path in ((servers[0], "/get_model_info"), (servers[1], "/get_model_info"),
                          (trainer, "/weight_checksums")):
            assert opens(url, path, f"Bearer {old_key}") == 403, url
        assert opens(servers[1], "/get_model_info", bearer(key_of(token, processes, "rollout-1"))["Authorization"]) == 200
    finally:
        rlctl("cancel", str(rd.path), cwd=tmp_path)
