"""Run ids never collide: a run's directory is created exclusively, and a launch whose id is taken
draws another (rlctl/run/ids.py), so runs made at once (a sweep's, in the same second) each get
their own directory and no launch stops on another's."""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor

import rlctl.run.ids
from rlctl.run.dir import RunDir, create_run_dir
from rlctl.run.find import find_run, list_runs
from rlctl.run.ids import RUN_ID, new_run_id


def test_an_id_whose_directory_exists_is_drawn_again(tmp_path, monkeypatch):
    drawn = iter(["q-20261201-120000-aaaaaaaa", "q-20261201-120000-aaaaaaaa", "q-20261201-120000-bbbbbbbb"])
    monkeypatch.setattr(rlctl.run.ids, "new_run_id", lambda name: next(drawn))
    first = create_run_dir(tmp_path, "q", "run: {}\n", {})
    second = create_run_dir(tmp_path, "q", "run: {}\n", {})
    assert (first.id, second.id) == ("q-20261201-120000-aaaaaaaa", "q-20261201-120000-bbbbbbbb")
    assert json.loads(first.run_json.read_text())["id"] == first.id  # the first run's files are its own still


def test_hundreds_of_runs_made_at_once_each_get_their_own_directory(tmp_path, monkeypatch):
    """Suffixes drawn from 256 values, so that runs made in one second collide often: every
    collision is drawn again, none is an error, and no run's files are another's."""
    monkeypatch.setattr(rlctl.run.ids.secrets, "token_hex", lambda n: f"{random.randrange(256):0{2 * n}x}")
    with ThreadPoolExecutor(8) as pool:
        runs = list(
            pool.map(lambda i: create_run_dir(tmp_path, "sweep", f"run: {{seed: {i}}}\n", {"seed": i}), range(200))
        )
    assert len({rd.id for rd in runs}) == 200 and len(list_runs(tmp_path)) == 200
    for i, rd in enumerate(runs):
        assert (
            json.loads(rd.run_json.read_text())["seed"] == i and rd.recipe_path.read_text() == f"run: {{seed: {i}}}\n"
        )


def test_ids_of_old_and_new_runs_are_both_recognized(tmp_path):
    new = new_run_id("quickstart")
    assert RUN_ID.fullmatch(new) and len(new.rsplit("-", 1)[1]) == 8  # 32 random bits
    assert RUN_ID.fullmatch("quickstart-20260101-000000-abcd")  # made before: 16 bits
    old = tmp_path / "quickstart-20260101-000000-abcd"
    old.mkdir()  # its run.json lost: still listed, as an unreadable run
    assert [rd.id for rd in list_runs(tmp_path)] == [old.name]
    assert find_run("quickstart", tmp_path) == RunDir(old)
