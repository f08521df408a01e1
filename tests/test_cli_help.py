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


def test_status_json_has_the_keys_the_readme_lists(tmp_path):
    """The README names every key of `status --json` and `status RUN --json`: both are read from it."""
    import json
    import re

    from conftest import REPO
    from test_status import fake_run

    readme = (REPO / "README.md").read_text()
    said = re.search(r"`rlctl status --json` gives a list of runs with the keys (.*?); `rlctl status RUN --json`\s+"
                     r"adds (.*?); `rlctl status SWEEP", readme, re.S)
    assert said, "the README no longer says what status --json holds"
    listed = {k.strip() for k in re.split(r",|\band\b", said[1].replace("\n", " ")) if k.strip()}
    added = {k.strip() for k in re.split(r",|\band\b", said[2].replace("\n", " ")) if k.strip()}
    fake_run(tmp_path / "runs", "quickstart-20260101-000000-aaaa", "completed", 3, [])
    rows = json.loads(rlctl("status", "--json", "--runs-dir", str(tmp_path / "runs"), cwd=tmp_path).stdout)
    assert set(rows[0]) == listed
    detail = json.loads(rlctl("status", "quickstart-20260101-000000-aaaa", "--json", "--runs-dir",
                              str(tmp_path / "runs"), cwd=tmp_path).stdout)
    assert set(detail) == listed | added


def test_pool_status_json_of_no_pool_and_of_a_pool_that_is_down(tmp_path):
    import json

    assert json.loads(rlctl("pool", "status", "--json", cwd=tmp_path).stdout) == []
    (tmp_path / "pools" / "p1").mkdir(parents=True)
    (tmp_path / "pools" / "p1" / "pool.json").write_text('{"state": "down"}')
    listed = json.loads(rlctl("pool", "status", "--json", cwd=tmp_path).stdout)
    assert listed == [{"name": "p1", "state": "down", "path": "pools/p1"}]
    one = json.loads(rlctl("pool", "status", "p1", "--json", cwd=tmp_path).stdout)
    assert one == {"name": "p1", "state": "down", "path": "pools/p1", "events": 0}
