"""The command line's own conventions: flags shown as flags in every --help, and shell completion."""

from __future__ import annotations

import pytest

from conftest import rlctl

COMMANDS = ["launch", "status", "cancel", "logs", "simulate", "trace", "compare", "resume", "export",
            "pool up", "pool down", "pool status"]


@pytest.mark.parametrize("command", ["", *COMMANDS])
def test_help_shows_flags_as_flags(tmp_path, command):
    res = rlctl(*command.split(), "--help", cwd=tmp_path, env={"COLUMNS": "120"})
    assert res.returncode == 0, res.stderr
    assert "--help" in res.stdout and "<bool>" not in res.stdout  # a flag takes no value
    if command == "launch":
        assert "--detach" in res.stdout and "<path>" in res.stdout  # options that take one still say what


def test_shell_completion_completes_commands_and_flags(tmp_path):
    script = rlctl("--show-completion", "bash", cwd=tmp_path)
    assert script.returncode == 0 and "_rlctl_completion" in script.stdout and "complete " in script.stdout
    words = rlctl(cwd=tmp_path, env={"_RLCTL_COMPLETE": "complete_bash", "COMP_WORDS": "rlctl la", "COMP_CWORD": "1"})
    assert words.stdout.split() == ["launch"]
    flags = rlctl(cwd=tmp_path, env={"_RLCTL_COMPLETE": "complete_bash", "COMP_WORDS": "rlctl launch --d",
                                     "COMP_CWORD": "2"})
    assert set(flags.stdout.split()) == {"--detach", "--dry-run"}
