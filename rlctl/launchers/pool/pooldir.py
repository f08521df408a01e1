"""A pool's directory, like a run's: pool.yaml (the resolved pool file), pool.json (state, pid,
url), events.jsonl (every job, slice and model move), logs/, and its token (0600), in a
directory only its owner can enter (0700)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlctl.process.auth import TOKEN_FILE, create_token, read_token_file
from rlctl.errors import RunError
from rlctl.run.dir import append_jsonl, now_iso, pid_alive, read_jsonl, write_atomic


class PoolDir:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def spec_path(self) -> Path:
        return self.path / "pool.yaml"

    @property
    def state_path(self) -> Path:
        return self.path / "pool.json"

    @property
    def events_path(self) -> Path:
        return self.path / "events.jsonl"

    @property
    def log_path(self) -> Path:
        return self.path / "logs" / "pool.log"

    def token(self) -> str:
        try:
            return read_token_file(self.path / TOKEN_FILE)
        except ValueError as e:
            raise RunError(str(e)) from None

    def read(self) -> dict[str, Any]:
        try:
            return json.loads(self.state_path.read_text())
        except FileNotFoundError:
            raise RunError(f"no pool at {self.path} (start one with `rlctl pool up POOL.yaml`)") from None
        except (OSError, ValueError) as e:
            raise RunError(f"{self.state_path}: unreadable ({e})") from None

    def write(self, **fields: Any) -> None:
        data = self.read() if self.state_path.exists() else {}
        data.update(fields)
        write_atomic(self.state_path, json.dumps(data, indent=2) + "\n")

    def alive(self) -> bool:
        """Its service is up: its process here, or on a Slurm pool (whose service runs on a node)
        its /health."""
        from rlctl.launchers.health import healthy

        try:
            state = self.read()
        except RunError:
            return False
        if state.get("state") != "up":
            return False
        if state.get("launcher") == "slurm":
            return healthy(state["url"])
        return pid_alive(state.get("pid"), "rlctl.launchers.pool")

    def require_up(self, key: str = "", then: str = "") -> None:
        """RunError unless the pool's service is up: saying where it was looked for and how to
        start it (its own pool.yaml when it has run here before); `key` names the recipe key
        that chose it, `then` says what else would do."""
        if self.alive():
            return
        spec = self.spec_path if self.spec_path.is_file() else "POOL.yaml"
        raise RunError(f"{key + ': ' if key else ''}pool {self.name} is not up in {self.path.parent}; "
                       f"start it with `rlctl pool up {spec}`{then}")

    def event(self, kind: str, t: float, **fields: Any) -> None:
        append_jsonl(self.events_path, {"t": t, "event": kind, **fields})

    def events(self) -> list[dict[str, Any]]:
        return read_jsonl(self.events_path) if self.events_path.exists() else []

    @classmethod
    def create(cls, path: Path, spec_yaml: str) -> PoolDir:
        """Make (or reuse, when its service is down) the pool's directory, with a new token."""
        pd = cls(path)
        if pd.alive():
            raise RunError(f"pool {pd.name} is already up (pid {pd.read()['pid']}); `rlctl pool down {pd.name}` first")
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        path.chmod(0o700)
        (path / "logs").mkdir(exist_ok=True)
        create_token(path)
        write_atomic(pd.spec_path, spec_yaml)
        write_atomic(pd.state_path, json.dumps({"name": pd.name, "state": "starting", "created": now_iso()}) + "\n")
        pd.events_path.touch()
        return pd
