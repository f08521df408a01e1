"""The pool's engine forker (rlctl/launchers/pool/warm.py): a real forker process, a real child."""

from __future__ import annotations

import stat

import pytest

from rlctl.errors import RunError
from rlctl.launchers.pool.warm import Forker

pytestmark = pytest.mark.process


def test_a_forked_engine_logs_to_its_file_and_its_exit_code_comes_back(tmp_path):
    forker = Forker(tmp_path / "forker.log")
    try:
        child = forker.spawn(["no-such-role", "--run-dir", str(tmp_path)], tmp_path / "child.log", {"PATH": "/usr/bin"})
        assert child.pid != forker.proc.pid
        assert child.wait(timeout=30) == 2  # rlctl.worker's argparse refused the role
        log = (tmp_path / "child.log").read_text()
        assert "invalid choice: 'no-such-role'" in log and "python -m rlctl.worker" in log
        assert stat.S_IMODE((tmp_path / "child.log").stat().st_mode) == 0o600
        again = forker.spawn(["no-such-role", "--run-dir", str(tmp_path)], tmp_path / "child.log", {})
        assert again.wait(timeout=30) == 2 and again.pid != child.pid
        assert (tmp_path / "child.log").read_text().count("invalid choice") == 2  # appended, not replaced
    finally:
        forker.close()
    assert forker.proc.returncode == 0  # it ended at the end of its input


def test_a_dead_forker_refuses_at_once_and_says_where_to_look(tmp_path):
    forker = Forker(tmp_path / "forker.log")
    forker.proc.kill()
    forker.proc.wait()
    with pytest.raises(RunError, match="forker is not running .*see the pool's log"):
        forker.spawn(["trainer", "--run-dir", str(tmp_path)], tmp_path / "child.log", {})
    assert not (tmp_path / "child.log").exists()
