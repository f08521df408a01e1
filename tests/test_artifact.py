"""scripts/artifact.py: what a benchmark's results/NAME.json holds, and that every measuring script
writes one (the docs cite only figures with an artifact behind them)."""

from __future__ import annotations

import ast
import datetime as dt
import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"
_spec = importlib.util.spec_from_file_location("artifact", SCRIPTS / "artifact.py")
artifact = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(artifact)

GIT = {"commit": "0123456789abcdef0123456789abcdef01234567", "dirty": False}
MEASURING = ["bench_*.py", "gpu_*.py", "plan_order.py", "multigpu_checks.py", "check_resume.py"]
"""The scripts that measure something: each must write an artifact."""


def _strict(text: str) -> dict:
    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_write_artifact_records_commit_date_machine_command_and_figures(tmp_path):
    argv = [str(SCRIPTS / "bench_example.py"), "--runs", "5", "rollout.batch_size=8"]
    before = dt.datetime.now(dt.UTC).replace(microsecond=0)
    path = artifact.write_artifact("bench_example", {"wall_s": 1.25, "modes": {"sync": [1, 2]}}, argv=argv,
                                   results=tmp_path, git=GIT)
    assert path == tmp_path / "bench_example.json"
    record = _strict(path.read_text())
    assert record["name"] == "bench_example"
    assert record["commit"] == GIT["commit"] and record["dirty"] is False
    assert before <= dt.datetime.fromisoformat(record["date"]) <= dt.datetime.now(dt.UTC)
    assert record["command"] == "python scripts/bench_example.py --runs 5 rollout.batch_size=8"
    assert record["figures"] == {"wall_s": 1.25, "modes": {"sync": [1, 2]}}
    m = record["machine"]
    assert isinstance(m["cores"], int) and m["cores"] >= 1
    assert m["cpu"] and m["python"].count(".") == 2 and m["platform"]
    assert m["memory_gib"] is None or m["memory_gib"] > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench_example.json"]


def test_non_finite_floats_are_written_as_null(tmp_path):
    path = artifact.write_artifact("nan", {"ratio": float("nan"), "rows": [(1.0, float("inf"))], 3: -float("inf")},
                                   argv=["x.py"], results=tmp_path, git=GIT)
    assert _strict(path.read_text())["figures"] == {"ratio": None, "rows": [[1.0, None]], "3": None}


class Unwritable:
    def __str__(self) -> str:
        raise RuntimeError("cannot be written")


def test_a_failed_write_leaves_the_earlier_artifact_whole(tmp_path):
    first = artifact.write_artifact("bench_example", {"wall_s": 1.0}, argv=["x.py"], results=tmp_path, git=GIT)
    text = first.read_text()
    with pytest.raises(RuntimeError, match="cannot be written"):
        artifact.write_artifact("bench_example", {"wall_s": Unwritable()}, argv=["x.py"], results=tmp_path, git=GIT)
    assert first.read_text() == text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench_example.json"]
    second = artifact.write_artifact("bench_example", {"wall_s": 2.0}, argv=["x.py"], results=tmp_path, git=GIT)
    assert _strict(second.read_text())["figures"] == {"wall_s": 2.0}


def test_rlctl_results_names_the_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("RLCTL_RESULTS", str(tmp_path / "elsewhere"))
    path = artifact.write_artifact("bench_example", {"n": 1}, argv=["x.py"], git=GIT)
    assert path == tmp_path / "elsewhere" / "bench_example.json" and path.is_file()
    monkeypatch.delenv("RLCTL_RESULTS")
    assert artifact.results_folder() == REPO / "results"


def test_names_and_paths_as_artifacts_record_them():
    assert artifact.slug("Bench LongTail_GPU.yaml") == "bench-longtail-gpu-yaml"
    assert artifact.repo_path(REPO / "recipes" / "quickstart.yaml") == "recipes/quickstart.yaml"
    assert artifact.repo_path("/elsewhere/r.yaml") == "/elsewhere/r.yaml"


def _calls(tree: ast.AST) -> set[str]:
    return {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}


def _imports(tree: ast.AST) -> set[tuple[str, str]]:
    return {(n.module, a.name) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}


def test_every_measuring_script_writes_an_artifact():
    """A call of write_artifact (imported from scripts/artifact.py), or of gpu_common.run_checks,
    which writes one for the GPU check scripts."""
    scripts = sorted({p for pattern in MEASURING for p in SCRIPTS.glob(pattern)} - {SCRIPTS / "gpu_common.py"})
    assert len(scripts) >= 12, [p.name for p in scripts]  # the patterns still find the scripts
    harness = ast.parse((SCRIPTS / "gpu_common.py").read_text())
    run_checks = next(n for n in ast.walk(harness) if isinstance(n, ast.FunctionDef) and n.name == "run_checks")
    assert "write_artifact" in _calls(run_checks)
    silent = []
    for path in scripts:
        tree = ast.parse(path.read_text(), filename=str(path))
        writes = "write_artifact" in _calls(tree) and ("artifact", "write_artifact") in _imports(tree)
        checks = "run_checks" in _calls(tree) and ("gpu_common", "run_checks") in _imports(tree)
        if not (writes or checks):
            silent.append(path.name)
    assert not silent, f"scripts that measure but write no results/ artifact (scripts/artifact.py): {silent}"
