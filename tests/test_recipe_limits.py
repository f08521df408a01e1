"""What a recipe may not hold, each refused with one line naming the key: a control character in
any string, an sbatch flag the batch script sets itself (in every form sbatch reads), a secret in
slurm.env, a key given twice, a number outside the range a run can use. And every recipe shipped
in recipes/ still loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from conftest import QUICKSTART, REPO, rlctl_here
from rlctl.errors import RecipeError
from rlctl.recipe.checks import clip_message
from rlctl.recipe import load_recipe, recipe_from_yaml
from rlctl.recipe.load import load_pool_file
from rlctl.recipe.sbatch_flags import sbatch_words
from rlctl.recipe.secret_names import secret_name


def refusal(*overrides: str, recipe: Path = QUICKSTART) -> RecipeError:
    with pytest.raises(RecipeError) as info:
        load_recipe(recipe, list(overrides), check_paths=False)
    return info.value


@pytest.mark.parametrize(
    "key,value",
    [
        ("run.output_dir", "runs\nrm -rf ~"),
        ("run.output_dir", "runs\r#SBATCH --uid=0"),
        ("run.output_dir", "runs\x00x"),
        ("run.output_dir", "runs\x1b[2J"),
        ("run.output_dir", "runs\u2028x"),
        ("slurm.python", "python3\rx"),
        ("slurm.partition", "gpu\n"),
        ("slurm.setup[0]", "module load cuda\r"),
        ("slurm.sbatch_args[0]", "--exclusive\x0c"),
        ("slurm.env.NCCL_IB_HCA", "mlx5\x1b"),
        ("tracking.wandb.tags[0]", "a\nb"),
        ("reward.function", "my_reward:score\n"),
    ],
)
def test_a_control_character_in_any_string_is_refused_naming_the_key(key, value):
    """A newline in run.output_dir or a slurm key would write a shell line of its own into job.sbatch,
    above its #SBATCH lines; no recipe string has a use for one."""
    name, _, index = key.partition("[")
    written = f"[{json.dumps(value)}]" if index else json.dumps(value)  # JSON strings are YAML ones
    extra = ["reward.verifier=function"] if key.startswith("reward.") else []
    e = refusal("launcher=slurm", *extra, f"{name}={written}")
    assert (e.key, e.message) == (
        key,
        f"holds a control character ({_escaped(value)}); write it on one line, without one",
    )
    assert all(c.isprintable() for c in str(e))


def _escaped(value: str) -> str:
    """The control character of `value` as the message writes it (\\n, \\x00, \\u2028)."""
    return next(repr(c)[1:-1] for c in value if not c.isprintable())


def test_a_tab_is_whitespace_not_a_control_character():
    r = load_recipe(
        QUICKSTART, ["launcher=slurm", "slurm.setup=['module load cuda\t# the CUDA of the nodes']"], check_paths=False
    )
    assert r.slurm.setup == ["module load cuda\t# the CUDA of the nodes"]


def test_a_newline_in_the_output_dir_never_reaches_the_batch_script(tmp_path):
    res = rlctl_here(
        "launch", str(QUICKSTART), "launcher=slurm", "--dry-run", r'run.output_dir="runs\nid"', cwd=tmp_path
    )
    assert res.returncode == 2 and res.stdout == "", res.stdout
    assert res.stderr.strip().splitlines() == [
        "error: <overrides>: run.output_dir: holds a control character (\\n); write it on one line, without one"
    ]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "args,flag",
    [
        (["-o/tmp/x"], "-o (--output)"),
        (["--output /tmp/x"], "--output"),
        (["--output", "/tmp/x"], "--output"),
        (["-N5"], "-N (--nodes)"),
        (["-N", "5"], "-N (--nodes)"),
        (["--nodes=5"], "--nodes"),
        (["--out=/tmp/x"], "--output"),  # getopt_long takes a unique beginning for the whole name
        (["--exclusive -J other"], "-J (--job-name)"),
        (["-vo/tmp/x"], "-o (--output)"),  # -v, then -o with its value attached
        (["--exclusive", "-t 5"], "-t (--time)"),
        (["--comment 'a b' --partition=debug"], "--partition"),
        (["--mem=0"], "--mem"),
        (["--no-requeue"], "--no-requeue"),
        (["--ntasks-per-node=3"], "--ntasks-per-node"),
    ],
)
def test_an_sbatch_flag_rlctl_sets_is_refused_in_every_form(args, flag):
    e = refusal("launcher=slurm", f"slurm.sbatch_args={json.dumps(args)}")
    i = next(i for i, a in enumerate(args) if a.startswith("-") and not a == "--exclusive")
    assert e.key == f"slurm.sbatch_args[{i}]"
    assert e.message.startswith(f"'{args[i]}' sets {flag}, which is set by rlctl from "), e.message


@pytest.mark.parametrize(
    "args",
    [
        ["--exclusive", "--constraint=h200"],
        ["--gpus=8"],  # not a beginning of --gpus-per-node: sbatch takes an exact name as itself
        ["-Co5"],  # -C takes the rest of the word: the constraint "o5", not -o
        ["--comment=-o /x"],
        ["--mem-per-cpu=4G", "--time-min=10"],
        ["--exclusive # -o /x"],  # after an unquoted #, sbatch reads nothing
    ],
)
def test_sbatch_flags_of_their_own_still_pass(args):
    r = load_recipe(QUICKSTART, ["launcher=slurm", f"slurm.sbatch_args={json.dumps(args)}"], check_paths=False)
    assert r.slurm.sbatch_args == args


def test_the_pools_own_flags_are_refused_and_its_others_pass():
    pool = REPO / "recipes" / "pool" / "slurm.yaml"
    with pytest.raises(RecipeError) as info:
        load_pool_file(pool, ['pool.slurm.sbatch_args=["-N4"]'])
    assert info.value.key == "pool.slurm.sbatch_args[0]" and "sets -N (--nodes)" in info.value.message
    assert load_pool_file(pool, ['pool.slurm.sbatch_args=["--mem=64G"]']).pool.slurm.sbatch_args == ["--mem=64G"]


def test_sbatch_words_are_split_as_sbatch_splits_them():
    assert sbatch_words(r'--comment="a b" -o\ x --x=\"y # z') == ["--comment=a b", "-o x", '--x="y']
    assert sbatch_words("'-o' /tmp") == ["-o", "/tmp"]


@pytest.mark.parametrize(
    "name",
    [
        "GH_PAT",
        "GITHUB_PAT",
        "HF_TOKEN",
        "HUGGING_FACE_HUB_TOKEN",
        "WANDB_API_KEY",
        "OPENAI_API_KEY",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_ACCESS_KEY_ID",
        "AWS_SESSION_TOKEN",
        "DB_PASSWORD",
        "MYSQL_PWD",
        "SMTP_PASS",
        "LDAP_PASSWD",
        "GOOGLE_APPLICATION_CREDENTIALS",
        "githubToken",
        "AUTHTOKEN",
        "API_KEYS",
        "PRIVATE_KEY",
        "SSH_PASSPHRASE",
        "CLIENTSECRET",
        "TOKEN2",
    ],
)
def test_secret_names_are_refused_in_slurm_env(name):
    assert secret_name(name)
    e = refusal("launcher=slurm", f"slurm.env.{name}=x")
    assert e.key == f"slurm.env.{name}" and "looks like a secret" in e.message


@pytest.mark.parametrize(
    "name",
    [
        "PATH",
        "PYTHONPATH",
        "LD_LIBRARY_PATH",
        "KEYBOARD",
        "MONKEY",
        "TOKENIZERS_PARALLELISM",
        "PASSTHROUGH",
        "PWD",
        "OLDPWD",
        "HF_HOME",
        "NCCL_IB_HCA",
        "NCCL_SOCKET_IFNAME",
        "OMP_NUM_THREADS",
        "KEYRING_BACKEND",
        "SSL_KEYFILE",
        "PATCH_LEVEL",
        "COMPAT_MODE",
        "HF_HUB_ENABLE_HF_TRANSFER",
        "BYPASS_CACHE",
        "SPATIAL_DIMS",
    ],
)
def test_ordinary_names_that_hold_a_secret_words_letters_pass(name):
    assert not secret_name(name)
    assert load_recipe(QUICKSTART, ["launcher=slurm", f"slurm.env.{name}=x"], check_paths=False).slurm.env == {
        name: "x"
    }


@pytest.mark.parametrize(
    "text,key,line",
    [
        (
            "run:\n  steps: 3\nmodel:\n  init: {}\nrun:\n  name: x\n",
            "line 5, column 1",
            "'run' is given twice (first on line 1)",
        ),
        (
            "model:\n  init: {}\nrun:\n  steps: 3\n  name: a\n  steps: 30\n",
            "line 6, column 3",
            "'run.steps' is given twice (first on line 4)",
        ),
        (
            "model:\n  init: {}\nrollout: {sampling: {temperature: 1, temperature: 2}}\n",
            "line 3, column 38",
            "'rollout.sampling.temperature' is given twice (first on line 3)",
        ),
    ],
)
def test_a_key_given_twice_is_refused_with_its_line(text, key, line, tmp_path):
    recipe = tmp_path / "twice.yaml"
    recipe.write_text(text)
    res = rlctl_here("launch", str(recipe), "--dry-run", cwd=tmp_path)
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().splitlines() == [f"error: {recipe}: {key}: {line}; keep one"]


def test_a_merge_still_overrides_the_keys_it_brings():
    r = recipe_from_yaml(
        "model:\n  init: &i {hidden_size: 64}\nrun:\n  <<: {steps: 3, name: a}\n  steps: 5\n", "r.yaml"
    )
    assert (r.run.steps, r.run.name) == (5, "a")


@pytest.mark.parametrize(
    "override,message",
    [
        ("train.lr=1e308", "train.lr: must be in (0, 1], got 1e+308"),
        ("train.weight_decay=3", "train.weight_decay: must be in [0, 1], got 3"),
        ("train.grad_clip=1e300", "train.grad_clip: must be in (0, 1,000,000], got 1e+300"),
        ("algo.kl_coef=1e308", "algo.kl_coef: must be in [0, 10], got 1e+308"),
        ("algo.critic_lr=5", "algo.critic_lr: must be in (0, 1], got 5"),
        ("algo.value_clip=-1", "algo.value_clip: must be in [0, 10], got -1"),
        ("algo.overlong_penalty=1e9", "algo.overlong_penalty: must be in [0, 10]"),
        ("algo.dual_clip=1000", "algo.dual_clip: must be <= 100, got 1,000"),
        ("rollout.sampling.temperature=1e308", "rollout.sampling.temperature: must be in [0, 10], got 1e+308"),
        ("rollout.sampling.temperature=-1", "rollout.sampling.temperature: must be in [0, 10], got -1"),
        (
            "rollout.sampling.stop_token_ids=[1,-5]",
            "rollout.sampling.stop_token_ids[1]: must be in [0, 16,777,215], got -5",
        ),
        ("rollout.sampling.long_tail.sigma=-1", "rollout.sampling.long_tail.sigma: must be in [0, 10], got -1"),
        (
            "rollout.sampling.long_tail.min_tokens=-3",
            "rollout.sampling.long_tail.min_tokens: must be in [1, 1,048,576]",
        ),
        ("rollout.vllm.max_model_len=1000000000", "rollout.vllm.max_model_len: must be in [0, 4,194,304]"),
        ("sim.decode_step_overhead_s=-1", "sim.decode_step_overhead_s: must be in [0, 3,600], got -1"),
        ("sim.layers=-4", "sim.layers: must be >= 0, got -4"),
        ("sim.mfu_train=1e308", "sim.mfu_train: must be in (0, 10], got 1e+308"),
        ("sim.layer_launch_s=-0.1", "sim.layer_launch_s: must be in [0, 10], got -0.1"),
        ("pool.share=1e308", "pool.share: must be in (0, 1,000], got 1e+308"),
        ("pool.rollout_memory_gb=1e12", "pool.rollout_memory_gb: must be in [0, 10,000]"),
        ("model.init.warmup_lr=0", "model.init.warmup_lr: must be in (0, 1], got 0"),
        ("run.save_every=-1", "run.save_every: must be in [0, 10,000,000], got -1"),
    ],
)
def test_an_absurd_number_is_refused_naming_the_key_and_its_range(override, message):
    e = refusal(override)
    assert f"{e.key}: {e.message}".startswith(message), f"{e.key}: {e.message}"


def test_greedy_sampling_and_usual_values_still_load():
    r = load_recipe(
        QUICKSTART,
        [
            "rollout.sampling.temperature=0",
            "train.lr=1e-6",
            "algo.kl_coef=0.04",
            "rollout.sampling.stop_token_ids=[151645]",
            "pool.share=2",
            "sim.mfu_train=1.2",
        ],
        check_paths=False,
    )
    assert (r.rollout.sampling.temperature, r.algo.kl_coef, r.pool.share) == (0.0, 0.04, 2.0)


def _shipped() -> list[Path]:
    return sorted((REPO / "recipes").rglob("*.yaml"))


@pytest.mark.parametrize("path", _shipped(), ids=lambda p: str(p.relative_to(REPO / "recipes")))
def test_every_shipped_recipe_and_pool_file_still_loads(path):
    """The bounds are a range no real run leaves: every recipe of recipes/ (and every job a pool
    file lists, with its overrides) loads as it is."""
    data = yaml.safe_load(path.read_text())
    if "jobs" in data or isinstance(data.get("pool"), dict) and "devices" in data["pool"]:
        spec = load_pool_file(path)
        for job in spec.jobs:
            load_recipe(job.recipe, job.overrides, check_paths=False)
    else:
        load_recipe(path, check_paths=False)


def test_a_long_value_in_an_error_is_cut_and_a_long_path_keeps_its_file_name():
    path = "/tmp/" + "deep/" * 60 + "reward_ab12.py"
    said = clip_message(f"module 'reward_ab12' ({path}) has no 'scroe'; name a function defined in it, "
                        f"not '{'x' * 500}'")
    kept = said.split(" ")[2]  # the path's run of characters without a space, cut in its middle
    assert len(kept) == 80 and kept.startswith("(/tmp/deep/") and kept.endswith("/reward_ab12.py)") and "..." in kept
    assert "name a function defined in it" in said
    assert f"'{'x' * 77}...'" in said and len(said) <= 400
    assert clip_message("short /a/b.py stays whole") == "short /a/b.py stays whole"
    longer = clip_message(f"module 'x' ({'/d' * 400}/reward_ab12.py) has no 'scroe'").split(" ")[2]
    assert len(longer) == 80 and longer.endswith("/reward_ab12.py)")  # past 400 characters too
    assert clip_message("(/" + "p\x00" * 60 + "/f.py)").endswith("\\x00/f.py)")  # escaped, not cut before
