"""The project's exceptions: one line a user can act on, and the exit code that goes with it."""

from __future__ import annotations


class RlctlError(Exception):
    """An error the user can cause and fix. The CLI prints `error: <message>` and exits."""

    exit_code = 1


class UsageError(RlctlError):
    """Bad command-line usage or an unknown run id (exit 2)."""

    exit_code = 2


class RecipeError(UsageError):
    """A recipe that cannot be used: names the file, the key and the fix (exit 2)."""

    def __init__(self, file: str, key: str, message: str) -> None:
        self.file, self.key, self.message = file, key, message
        super().__init__(f"{file}: {key}: {message}")


class RunError(RlctlError):
    """Something went wrong while a run was starting or running (exit 1)."""


class ServerUnreachable(RunError):
    """A server that did not answer at all: connection refused or reset, no reply. The controller
    takes it out of the pool (rlctl/control/failover.py) instead of failing the run."""
