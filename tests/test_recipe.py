"""The recipe schema: good recipes load; each class of bad input is one line naming file and key,
exit 2, and leaves no run directory and no process behind.

The bad-input cases run `rlctl launch` in this process (conftest.rlctl_here: the CLI's own main(),
its exit code and stderr); three smoke tests run it as a real process, for what only a process
shows: the exit status the shell sees, and nothing left running."""

from __future__ import annotations

import pytest

from conftest import QUICKSTART, REPO, processes_mentioning, rlctl, rlctl_here
from rlctl.errors import RecipeError
from rlctl.recipe import load_recipe, recipe_from_yaml, recipe_to_yaml


def test_quickstart_loads_with_overrides():
    r = load_recipe(QUICKSTART, ["run.steps=7", "rollout.servers=3", "train.lr=0.01"])
    assert (r.run.steps, r.rollout.servers, r.train.lr) == (7, 3, 0.01)
    assert r.model.init is not None and r.model.path is None


def test_resolved_recipe_round_trips():
    r = load_recipe(QUICKSTART, ["run.seed=5"])
    again = recipe_from_yaml(recipe_to_yaml(r), "resolved.yaml")
    assert again == r


def _error(text: str, overrides=()) -> RecipeError:
    with pytest.raises(RecipeError) as info:
        recipe_from_yaml(text, "r.yaml", overrides)
    return info.value


@pytest.mark.parametrize("text,key,words", [
    ("run:\n  stepz: 3\n", "run.stepz", "valid keys under run"),
    ("bogus: 1\n", "bogus", "valid keys"),
    ("run:\n  steps: many\n", "run.steps", "int"),
    ("rollout:\n  sampling:\n    temperature: hot\n", "rollout.sampling.temperature", "float"),
])
def test_schema_errors_name_the_key(text, key, words):
    e = _error("model:\n  init: {}\n" + text)
    assert e.key == key
    assert words in e.message


BAD_RECIPES = {
    "unknown-key": ("run:\n  name: x\n  stepz: 3\n", [], "run.stepz"),
    "wrong-type": ("run:\n  steps: lots\n", [], "run.steps"),
    "indivisible-train-batch": ("", ["rollout.batch_size=10", "train.groups_per_batch=4"], "train.groups_per_batch"),
    "zero-servers": ("", ["rollout.servers=0"], "rollout.servers"),
    "negative-lr": ("", ["train.lr=-0.1"], "train.lr"),
    "missing-model-path": ("model:\n  path: /nonexistent/model\n", [], "model.path"),
    "malformed-yaml": ("run: [unclosed\n", [], "line"),
    "unsafe-tag": ("run: !!python/object/apply:os.system ['true']\n", [], "line"),
    "not-a-mapping": ("- a\n- b\n", [], "<top level>"),
    "unknown-override": ("", ["run.nope=1"], "run.nope"),
    "unknown-mode": ("", ["pipeline.mode=turbo"], "pipeline.mode"),
}


def _launch_bad(case: str, tmp_path, run) -> tuple[object, object, object]:
    text, overrides, key = BAD_RECIPES[case]
    base = "model:\n  init: {}\n" if "model:" not in text and not text.startswith("-") else ""
    recipe = tmp_path / f"{case}.yaml"
    recipe.write_text(base + text)
    out_dir = tmp_path / "runs-here"
    res = run("launch", str(recipe), f"run.output_dir={out_dir}", *overrides, cwd=tmp_path)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    src = "<overrides>" if any(o.startswith(key + "=") for o in overrides) else str(recipe)
    assert lines[0].startswith(f"error: {src}: "), lines[0]
    assert key in lines[0]
    assert not out_dir.exists()
    return res, recipe, out_dir


@pytest.mark.parametrize("case", sorted(BAD_RECIPES))
def test_bad_recipe_cli_exit_2_one_line_nothing_created(case, tmp_path):
    _launch_bad(case, tmp_path, rlctl_here)


@pytest.mark.process
def test_bad_recipe_as_a_process_exit_2_one_line_nothing_left(tmp_path):
    _launch_bad("unknown-key", tmp_path, rlctl)
    assert processes_mentioning(str(tmp_path)) == []


@pytest.mark.process
def test_unreadable_file(tmp_path):
    res = rlctl("launch", str(tmp_path / "missing.yaml"), cwd=tmp_path)
    assert res.returncode == 2
    assert res.stderr.startswith(f"error: {tmp_path / 'missing.yaml'}: <file>: no such file")
    assert not (tmp_path / "runs").exists()


@pytest.mark.process
def test_unsafe_tag_is_not_executed(tmp_path):
    marker = tmp_path / "pwned"
    recipe = tmp_path / "evil.yaml"
    recipe.write_text(f"run: !!python/object/apply:os.system ['touch {marker}']\n")
    res = rlctl("launch", str(recipe), cwd=tmp_path)
    assert res.returncode == 2
    assert "unsafe or unknown YAML tag" in res.stderr
    assert not marker.exists()


def test_relative_paths_resolve_against_the_recipe(tmp_path):
    (tmp_path / "data.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model:\n  init:\n    warmup_steps: 0\ndata:\n  source: jsonl\n  path: data.jsonl\n")
    r = load_recipe(recipe)
    assert r.data.path == str(tmp_path / "data.jsonl")


@pytest.mark.parametrize("overrides,key,message", [
    (["rollout.sampling.top_p=0"], "rollout.sampling.top_p", "must be in (0, 1], got 0.0"),
    (["rollout.sglang.extra_args=[--port=1]"], "rollout.sglang.extra_args[0]",
     "'--port=1' is set by rlctl; use the rollout.sglang keys or the plan"),
    (["slurm.rollout.mem=1 G"], "slurm.rollout.mem", "'1 G' has characters Slurm names do not use; letters, digits and _.,:+- only"),
    (["model.path=/x", "model.init.hidden_size=32"], "model", "set exactly one of model.path (a local HF directory) or model.init (build a tiny model)"),
    (["rollout.batch_size=10", "train.groups_per_batch=4"], "train.groups_per_batch",
     "4 does not divide rollout.batch_size (10); pick a divisor so every train batch is full"),
    (["train.sync_backend=mpi"], "train.sync_backend", "'mpi' is not one of auto, gloo, nccl, ipc"),
    (["sim.gpu=tpu"], "sim.gpu", "'tpu' is not one of h200, h100, a100, cpu"),
])
def test_value_errors_name_the_dotted_key_and_the_fix(overrides, key, message):
    with pytest.raises(RecipeError) as info:
        load_recipe(QUICKSTART, overrides)
    # each value comes from the command line; "model" (path and init both set) is the file's section
    where = str(QUICKSTART) if key == "model" else "<overrides>"
    assert (info.value.file, info.value.key, info.value.message) == (where, key, message)


CLUSTER = REPO / "recipes" / "slurm-qwen3-1.7b.yaml"


@pytest.mark.parametrize("overrides,key,message", [
    (["slurm.rollout.gpus_per_node=4"], "slurm.rollout.gpus_per_node",
     "2 servers per node x 4 GPUs each need 8 GPUs per node, 4 are asked; raise it or lower slurm.rollout.servers_per_node"),
    (["rollout.gpus=[0]"], "rollout.gpus", "GPU lists are for the local launcher; with launcher=slurm each task gets "
                                           "its own GPUs of those Slurm allocates (slurm.*.gpus_per_node)"),
    (["rollout.sglang.extra_args=[--base-gpu-id,2]"], "rollout.sglang.extra_args[0]",
     "'--base-gpu-id' is set by rlctl; use the rollout.sglang keys or the plan"),
])
def test_cluster_placement_errors(overrides, key, message):
    with pytest.raises(RecipeError) as info:
        load_recipe(CLUSTER, overrides)
    assert (info.value.file, info.value.key, info.value.message) == ("<overrides>", key, message)


def test_choices_load_as_enum_members():
    from rlctl.recipe import Admission, Launcher, PipelineMode, TaskName

    r = load_recipe(QUICKSTART, ["pipeline.mode=rolloutpipe", "pipeline.admission=frontier"])
    assert r.pipeline.mode is PipelineMode.ROLLOUTPIPE and r.pipeline.admission is Admission.FRONTIER
    assert r.launcher is Launcher.LOCAL and r.data.task is TaskName.MAX_DIGIT


def test_the_layers_that_implement_a_choice_cover_it_exactly():
    from rlctl.recipe import GpuKind, TaskName
    from rlctl.rewards.tasks import TASKS
    from rlctl.costs.model import HARDWARE

    assert set(TASKS) == set(TaskName)
    assert set(HARDWARE) == set(GpuKind)


def test_every_section_is_a_checked_section():
    """A section that is a plain dataclass would load but never be checked."""
    import typing
    from dataclasses import fields, is_dataclass

    from rlctl.recipe import Recipe, Section

    def walk(cls, key):
        assert issubclass(cls, Section), f"{key or 'Recipe'} is not a rlctl.recipe.Section"
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            t = next((a for a in typing.get_args(hints[f.name]) if a is not type(None)), hints[f.name])
            if is_dataclass(t):
                walk(t, f"{key}.{f.name}" if key else f.name)

    walk(Recipe, "")


def test_a_cluster_recipes_paths_are_looked_for_on_the_cluster_not_here():
    """launcher=slurm: the model and data live where the job runs (its first node checks them,
    rlctl/launchers/slurm/steps.py); a local run needs them here."""
    cluster = ["model.init=null", "model.path=/cluster/only/Qwen3-1.7B", "data.source=jsonl", "data.path=/cluster/d.jsonl"]
    r = load_recipe(QUICKSTART, ["launcher=slurm", *cluster])
    assert (r.model.path, r.data.path) == ("/cluster/only/Qwen3-1.7B", "/cluster/d.jsonl")
    with pytest.raises(RecipeError) as info:
        load_recipe(QUICKSTART, cluster)
    assert info.value.key == "model.path" and "no config.json" in info.value.message


def _alias_bomb(flow: bool) -> str:
    """A billion laughs: nine levels of nine aliases each, 10^9 values once expanded."""
    levels = ["&a [x, x, x, x, x, x, x, x, x]"] + [
        f"&{c} [{', '.join(['*' + p] * 9)}]" for p, c in zip("abcdefgh", "bcdefghi")]
    if flow:
        return "[" + ", ".join(levels) + "]"
    return "".join(f"l{i}: {level}\n" for i, level in enumerate(levels))


HOSTILE = {
    # case: (recipe text after the model section, overrides, what the one line says)
    "alias-bomb-in-recipe": (_alias_bomb(flow=False), [], "aliases expand it to more than 10,000 values"),
    "alias-bomb-in-override": ("", [f"rollout.sglang.extra_args={_alias_bomb(flow=True)}"],
                               "rollout.sglang.extra_args: the value: aliases expand it"),
    "recursive-alias": ("run: &r {name: x, again: *r}\n", [], "recursive structure"),
    "10k-deep-recipe": ("run: " + "[" * 10_000 + "]" * 10_000 + "\n", [], "nested more than 32 levels deep"),
    "10k-deep-override": ("", ["rollout.cpus=" + "[" * 10_000 + "]" * 10_000], "nested more than 32 levels deep"),
    "50mb-value": ("run:\n  name: " + "x" * (50 << 20) + "\n", [], "<file>: larger than 1 MiB"),
    "100kb-override": ("", ["run.name=" + "x" * (100 << 10)], "run.name: the value: 100 KiB, more than the 64 KiB"),
    "huge-int": ("", ["run.steps=" + "9" * 5000], "run.steps: the value: a value cannot be read"),
    "lr-inf": ("", ["train.lr=inf"], "train.lr: must be a finite number, got inf"),
    "lr-nan": ("", ["train.lr=nan"], "train.lr: must be a finite number, got nan"),
    "lr-inf-in-yaml": ("train:\n  lr: .inf\n", [], "train.lr: must be a finite number, got inf"),
    "temperature-nan": ("", ["rollout.sampling.temperature=nan"], "rollout.sampling.temperature: must be a finite"),
    "batch-1e12": ("", ["rollout.batch_size=1e12"], "rollout.batch_size:"),
    "batch-10^12": ("", ["rollout.batch_size=1000000000000"], "rollout.batch_size: must be <= 65,536"),
    "servers-100000": ("", ["rollout.servers=100000"], "rollout.servers: must be <= 1,024, got 100,000"),
    "ranks-10^6": ("", ["train.ranks=1000000"], "train.ranks: must be <= 16,384"),
    "steps-10^9": ("", ["run.steps=1000000000"], "run.steps: must be <= 10,000,000"),
    "bucket-1e9-mb": ("", ["train.sync_bucket_mb=1e9"], "train.sync_bucket_mb: must be <= 16,384"),
    "max-new-tokens-10^9": ("", ["rollout.sampling.max_new_tokens=1000000000"], "max_new_tokens: must be <= 1,048,576"),
    "name-with-newline": ('run:\n  name: "a\\nb"\n', [], r"run.name: 'a\nb' is not a usable name"),
    "name-ending-in-newline": ('run:\n  name: "abc\\n"\n', [], r"run.name: 'abc\n' is not a usable name"),
    "name-with-quote": ("", ["run.name=it's"], "run.name: 'it's' is not a usable name"),
    "name-with-space": ("", ["run.name=my run"], "is not a usable name"),
    "name-as-option": ("", ["run.name=-x"], "is not a usable name"),
    "long-name": ("", ["run.name=" + "n" * 500], "run.name: 'nnnnn"),
}


@pytest.mark.timeout(60)  # what it guards against is a parse that never ends (an alias bomb)
@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_recipes_one_short_line_exit_2_at_once(case, tmp_path):
    """Nothing a recipe or an override holds keeps the CLI busy or floods the terminal: one line
    under 300 characters, exit 2, nothing created."""
    text, overrides, words = HOSTILE[case]
    recipe = tmp_path / f"{case}.yaml"
    recipe.write_text("model:\n  init: {}\n" + text)
    out_dir = tmp_path / "runs-here"
    res = rlctl_here("launch", str(recipe), f"run.output_dir={out_dir}", *overrides, cwd=tmp_path)
    assert res.returncode == 2, res.stderr[-2000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and len(lines[0]) < 300, res.stderr[-2000:]
    assert words in lines[0], lines[0]
    assert not out_dir.exists()


def test_aliases_within_bounds_still_load(tmp_path):
    """Anchors and aliases are plain YAML: a recipe that shares a block loads as before."""
    recipe = tmp_path / "shared.yaml"
    recipe.write_text("model:\n  init: {}\nrollout:\n  gpus: &g [0, 1]\ntrain:\n  gpus: *g\n  lr: 1e-3\n")
    r = load_recipe(recipe, ["rollout.cpus=[0]", "train.lr=2e-4"])
    assert r.rollout.gpus == r.train.gpus == [0, 1] and r.rollout.cpus == [0] and r.train.lr == 2e-4


def test_a_model_path_on_the_command_line_replaces_the_recipes_init():
    r = load_recipe(QUICKSTART, ["model.path=/models/Qwen3-0.6B"], check_paths=False)
    assert (r.model.path, r.model.init) == ("/models/Qwen3-0.6B", None)
    with pytest.raises(RecipeError, match="set exactly one of model.path"):
        load_recipe(QUICKSTART, ["model.path=/models/Qwen3-0.6B", "model.init.hidden_size=32"], check_paths=False)


def test_a_bad_value_names_where_it_was_set(tmp_path):
    """A value set on the command line is blamed on "<overrides>" (the recipe file does not hold
    it); one set in the file, on the file, even when an override made it wrong."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model:\n  init: {}\ntrain:\n  lr: -0.1\n")
    for overrides, where, key in ((["train.lr=0.1", "rollout.servers=0"], "<overrides>", "rollout.servers"),
                                  ([], str(recipe), "train.lr"),
                                  (["train.lr=0.1", "rollout.batch_size=10"], str(recipe), "train.groups_per_batch"),
                                  (["train.lr=0.1", "pipeline={mode: turbo}"], "<overrides>", "pipeline.mode")):
        with pytest.raises(RecipeError) as e:
            load_recipe(recipe, overrides, check_paths=False)
        assert (e.value.file, e.value.key) == (where, key), (overrides, str(e.value))


def test_a_section_given_a_plain_value_names_its_keys():
    """`colocate=true` reads like a switch, but colocate is a section: the error names its keys."""
    with pytest.raises(RecipeError) as e:
        load_recipe(QUICKSTART, ["colocate=true"], check_paths=False)
    assert e.value.file == "<overrides>" and e.value.key == "colocate"
    assert "colocate.enabled" in e.value.message and "is a section" in e.value.message
    assert load_recipe(QUICKSTART, ["colocate={enabled: true}"], check_paths=False).colocate.enabled
