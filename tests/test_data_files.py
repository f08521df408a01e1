"""A researcher's own data: JSONL, verl's Parquet and save_to_disk datasets read as they are,
every malformed row refused in one line before a launch starts anything, and the prompt length
filter."""

from __future__ import annotations

import json

import pytest

from conftest import QUICKSTART, rlctl_here
from rlctl.data import DataError, prompt_stream, read_prompts
from rlctl.recipe import DataConfig

QUESTIONS = [("What is 2+3?", "5"), ("What is 7*6?", "42"), ("What is 10-4?", "6")]


def verl_rows() -> list[dict]:
    """Rows in the layout verl's examples/data_preprocess/gsm8k.py writes."""
    return [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": q}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": a}, "extra_info": {"split": "train", "index": i}}
            for i, (q, a) in enumerate(QUESTIONS)]


def write_parquet(path, rows: list[dict]) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def file_config(path: str, **keys) -> DataConfig:
    return DataConfig(source="file", path=path, **keys)


def test_verl_parquet_is_read_as_verl_writes_it(tmp_path):
    prompts = read_prompts(file_config(write_parquet(tmp_path / "train.parquet", verl_rows())))
    assert [(p.prompt, p.answer, p.source) for p in prompts] == [
        ([{"role": "user", "content": q}], a, "openai/gsm8k") for q, a in QUESTIONS]
    assert prompts[1].fields["extra_info"] == {"split": "train", "index": 1}


def test_a_save_to_disk_dataset_and_jsonl_give_the_same_prompts(tmp_path):
    import datasets

    rows = [{"question": q, "final": int(a)} for q, a in QUESTIONS]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    keys = dict(prompt_key="question", answer_key="final")
    from_disk = read_prompts(file_config(str(tmp_path / "ds"), **keys))
    from_jsonl = read_prompts(file_config(str(tmp_path / "d.jsonl"), **keys))
    assert [(p.prompt, p.answer) for p in from_disk] == [(p.prompt, p.answer) for p in from_jsonl] == [
        (q, a) for q, a in QUESTIONS]


def test_a_dataset_dict_directory_names_its_splits(tmp_path):
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_list([{"prompt": "a", "answer": "b"}])}).save_to_disk(
        str(tmp_path / "dd"))
    with pytest.raises(DataError, match=r"a DatasetDict with splits \['train'\]; give one split's directory"):
        read_prompts(file_config(str(tmp_path / "dd")))


def test_messages_rows_and_dotted_answer_keys(tmp_path):
    rows = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
             "meta": {"gold": 4}}]
    (tmp_path / "m.jsonl").write_text(json.dumps(rows[0]) + "\n")
    (p,) = read_prompts(file_config(str(tmp_path / "m.jsonl"), answer_key="meta.gold"))
    assert p.prompt == rows[0]["messages"] and p.answer == "4"
    assert p.text == "system: Be brief.\nuser: 2+2?"


MALFORMED = {
    "not-json": ('{"prompt": "a", "answer": ', r"d.jsonl:2: not JSON"),
    "not-an-object": ('["a", "b"]', r"d.jsonl:2: a JSON list, not an object"),
    "no-prompt": ('{"question": "a", "answer": "b"}', r"d.jsonl:2: no field 'prompt' \(data.prompt_key\)"),
    "prompt-wrong-type": ('{"prompt": 3, "answer": "b"}', r"d.jsonl:2: the prompt 'prompt' is a int; give a string"),
    "empty-prompt": ('{"prompt": "  ", "answer": "b"}', r"d.jsonl:2: the prompt 'prompt' is empty"),
    "bad-message": ('{"prompt": [{"role": "user"}], "answer": "b"}', r"d.jsonl:2: message 0 is not a \{role, content\}"),
    "bad-role": ('{"prompt": [{"role": "bot", "content": "x"}], "answer": "b"}', r"d.jsonl:2: message 0 has role 'bot'"),
    "ends-with-assistant": ('{"prompt": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], '
                            '"answer": "b"}', r"d.jsonl:2: the messages end with the assistant's turn"),
    "no-answer": ('{"prompt": "a"}', r"d.jsonl:2: no field 'answer' \(data.answer_key\)"),
    "answer-wrong-type": ('{"prompt": "a", "answer": {"x": 1}}', r"d.jsonl:2: the answer 'answer' is a dict"),
    "empty-answer": ('{"prompt": "a", "answer": ""}', r"d.jsonl:2: the answer 'answer' is empty"),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_every_malformed_row_kind_is_one_line_naming_the_row(tmp_path, case):
    line, said = MALFORMED[case]
    (tmp_path / "d.jsonl").write_text('{"prompt": "ok", "answer": "1"}\n' + line + "\n")
    with pytest.raises(DataError, match=said) as e:
        read_prompts(file_config(str(tmp_path / "d.jsonl")))
    assert "\n" not in str(e.value)


def test_launch_refuses_a_malformed_row_with_exit_2_and_creates_nothing(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"prompt": "ok", "answer": "1"}\n{"prompt": "a", "answer": ""}\n')
    res = rlctl_here("launch", str(QUICKSTART), "model.init.warmup_steps=0", "data.source=file",
                     f"data.path={tmp_path / 'd.jsonl'}", f"run.output_dir={tmp_path / 'runs'}", cwd=tmp_path)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'd.jsonl'}:2: the answer 'answer' is empty; a verifier needs an answer to check against"]
    assert not (tmp_path / "runs").exists()


def test_launch_refuses_rows_without_a_field_the_reward_function_takes(tmp_path):
    (tmp_path / "difficulty_reward.py").write_text("def score(response, answer, difficulty):\n    return 1.0\n")
    (tmp_path / "d.jsonl").write_text('{"prompt": "a", "answer": "1", "difficulty": 2}\n{"prompt": "b", "answer": "2"}\n')
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(QUICKSTART.read_text())
    res = rlctl_here("launch", str(recipe), "model.init.warmup_steps=0", "data.source=file", "data.path=d.jsonl",
                     "reward.verifier=function", "reward.function=difficulty_reward:score", f"run.output_dir={tmp_path / 'runs'}",
                     cwd=tmp_path)
    assert res.returncode == 2
    assert "row 2 has no field 'difficulty', which reward.function difficulty_reward:score takes" in res.stderr
    assert not (tmp_path / "runs").exists()


def test_max_prompt_tokens_leaves_out_long_rows_and_says_how_many(tmp_path):
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"prompt": "x" * n, "answer": "1"}) + "\n" for n in (2, 9, 4, 12)))
    cfg = file_config(str(tmp_path / "d.jsonl"), max_prompt_tokens=5)
    stream = prompt_stream(cfg, 0, prompt_tokens=lambda p: len(p.prompt))
    assert (len(stream.rows), stream.left_out) == (2, 2)
    assert sorted(len(next(stream).prompt) for _ in range(2)) == [2, 4]
    with pytest.raises(DataError, match="every one of its 4 prompts is longer than data.max_prompt_tokens=1"):
        prompt_stream(file_config(str(tmp_path / "d.jsonl"), max_prompt_tokens=1), 0, prompt_tokens=lambda p: len(p.prompt))
