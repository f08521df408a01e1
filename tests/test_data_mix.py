"""Several data files mixed by weight (data.sources): the share of each, a cursor a checkpoint
keeps, each source's own verifier and metrics, and the recipe's rules for a mix."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from conftest import FAST, QUICKSTART
from rlctl.data import DataError, prompt_stream
from rlctl.data.check import check_data
from rlctl.errors import RecipeError
from rlctl.recipe import DataConfig, MixedSource, load_recipe


def write_rows(path, prefix: str, n: int) -> str:
    path.write_text("".join(json.dumps({"prompt": f"{prefix} {i}", "answer": str(i)}) + "\n" for i in range(n)))
    return str(path)


def mix(tmp_path, **second) -> DataConfig:
    return DataConfig(source="file", sources=[MixedSource(path=write_rows(tmp_path / "a.jsonl", "a", 5), weight=3),
                                              MixedSource(path=write_rows(tmp_path / "b.jsonl", "b", 7), **second)])


def test_sources_are_drawn_by_weight_each_reshuffled_by_its_own_epochs(tmp_path):
    stream = prompt_stream(mix(tmp_path, name="bee"), seed=0)
    drawn = [next(stream) for _ in range(4000)]
    shares = Counter(p.source for p in drawn)
    assert set(shares) == {"a", "bee"} and 2.7 < shares["a"] / shares["bee"] < 3.3
    assert [p.index for p in drawn[:5]] == [0, 1, 2, 3, 4]
    firsts = [p.prompt for p in drawn if p.source == "a"][:10]  # two epochs of a's 5 rows, each a permutation
    assert sorted(firsts[:5]) == sorted(firsts[5:]) == [f"a {i}" for i in range(5)] and firsts[:5] != firsts[5:]
    assert stream.by_source() == {"a": 5, "bee": 7}


def test_a_restored_mix_draws_what_the_uninterrupted_one_would_have(tmp_path):
    cfg = mix(tmp_path)
    stream = prompt_stream(cfg, seed=3)
    for _ in range(13):
        next(stream)
    saved = json.loads(json.dumps(stream.state()))  # as a checkpoint keeps it
    ahead = [(p.source, p.prompt, p.index) for p in (next(stream) for _ in range(40))]
    again = prompt_stream(cfg, seed=3)
    again.restore(saved)
    assert [(p.source, p.prompt, p.index) for p in (next(again) for _ in range(40))] == ahead


def test_a_mix_is_checked_like_a_file_and_its_own_reward_functions_fields_too(tmp_path):
    (tmp_path / "needs_level.py").write_text("def score(response, answer, level):\n    return 1.0\n")
    overrides = ["model.init.warmup_steps=0", "data.source=file",
                 f"data.sources=[{{path: {write_rows(tmp_path / 'a.jsonl', 'a', 3)}}}, "
                 f"{{path: {write_rows(tmp_path / 'b.jsonl', 'b', 2)}, "
                 f"reward: {{verifier: function, function: 'needs_level:score', module_dir: {tmp_path}}}}}]"]
    with pytest.raises(DataError, match=r"b.jsonl: row 1 has no field 'level', which data.sources\[1\].reward.function "
                                        "needs_level:score takes"):
        check_data(load_recipe(QUICKSTART, overrides))
    cases = {"data.sources=[{path: x.jsonl}]": "data.sources: a mix of files is data.source=file without data.path",
             f"data.sources=[{{path: {tmp_path / 'a.jsonl'}, weight: -1}}]": "data.sources[0].weight: must be in (0",
             f"data.sources=[{{path: {tmp_path / 'a.jsonl'}}}, {{path: {tmp_path / 'a.jsonl'}}}]":
                 "data.sources[1].name: two sources are named 'a'"}
    for override, message in cases.items():
        with pytest.raises(RecipeError, match=message.replace("(", r"\(").replace("[", r"\[")):
            load_recipe(QUICKSTART, ["model.init.warmup_steps=0",
                                     *(["data.source=file"] if "x.jsonl" not in override else []), override])


@pytest.mark.e2e
def test_two_sources_mixed_3_to_1_each_scored_by_its_own_verifier(tmp_path):
    """A real run on two files mixed 3:1, the second scored by a reward function of its own that
    gives every response 1: the groups come as the seeded 3:1 mix draws them, each source has its reward metric (1.0 exactly
    for the second, read from a save_to_disk dataset), and samples.jsonl and the eval set's
    per-source numbers name them."""
    from conftest import rlctl
    from rlctl.rewards.tasks import TASKS
    from rlctl.run.dir import RunDir
    import random

    import datasets

    rng = random.Random(1)
    rows = {name: [dict(zip(("prompt", "answer"), TASKS["max-digit"].sample(rng)), data_source=name) for _ in range(12)]
            for name in ("easy", "hard")}
    (tmp_path / "easy.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows["easy"]))
    datasets.Dataset.from_list(rows["hard"]).save_to_disk(str(tmp_path / "hard"))  # trains from save_to_disk too
    heldout = [dict(zip(("prompt", "answer"), TASKS["max-digit"].sample(rng)), data_source="easy" if i % 2 else "hard")
               for i in range(8)]
    (tmp_path / "heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in heldout))
    (tmp_path / "always.py").write_text("def score(response, answer):\n    return 1.0\n")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(QUICKSTART.read_text())
    res = rlctl("launch", str(recipe), *FAST, "run.steps=3", "rollout.batch_size=16", "model.init.warmup_steps=0",
                "data.source=file", "data.sources=[{path: easy.jsonl, weight: 3}, {path: hard, weight: 1, "
                "reward: {verifier: function, function: 'always:score'}}]",
                "eval.sets=[{path: heldout.jsonl, samples: 2}]", f"run.output_dir={tmp_path / 'runs'}", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    (path,) = (tmp_path / "runs").iterdir()
    rd = RunDir(path)
    for m in rd.metrics():
        assert m["reward_mean/hard"] == 1.0 and m["reward_mean/easy"] < 1.0
    # group g is the stream's draw g: the sources are those the seeded 3:1 mix gives, in that order
    completed = {e["group"]: e["source"] for e in rd.events() if e["event"] == "group_completed"}
    stream = prompt_stream(load_recipe(rd.recipe_path).data, seed=0)
    drawn = [next(stream).source for _ in range(max(completed) + 1)]
    assert completed == {g: drawn[g] for g in completed} and set(completed.values()) == {"easy", "hard"}
    (loaded,) = [e for e in rd.events() if e["event"] == "data_loaded"]
    assert loaded["by_source"] == {"easy": 12, "hard": 12}
    assert {json.loads(line)["source"] for line in rd.samples_path.read_text().splitlines()} <= {"easy", "hard"}
    assert [set(e["by_source"]) for e in rd.evals()] == [{"easy", "hard"}, {"easy", "hard"}]
