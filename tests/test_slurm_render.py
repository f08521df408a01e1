"""launcher=slurm without a cluster: the rendered batch script (golden files, shellcheck), the
in-job plan, recipe validation, --dry-run, and the errors when Slurm is missing."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import FAST, QUICKSTART, REPO, rlctl, rlctl_here
from rlctl.launchers.slurm import render_batch_script
from rlctl.process.topology import slurm_topology
from rlctl.recipe import load_recipe

GOLDEN = REPO / "tests" / "golden" / "slurm"
RUN_DIR = Path("/shared/runs/RUN-ID")
PYTHON = "/shared/venvs/rl/bin/python"
CASES = {
    # name: (recipe, overrides)
    "quickstart-1x1": (QUICKSTART, ["launcher=slurm", "rollout.servers=1"]),
    "cluster-2x4": (GOLDEN / "cluster-2x4.yaml", []),
    "options": (GOLDEN / "options.yaml", []),
    "example-qwen3-1.7b": (REPO / "recipes" / "slurm-qwen3-1.7b.yaml", []),  # the README's cluster example
    "example-qwen3-1.7b-vllm": (REPO / "recipes" / "slurm-qwen3-1.7b-vllm.yaml", []),  # the same with vLLM
    # colocated: 2 nodes of 4 GPUs, each GPU a Megatron rank and a TP rank of one of 4 SGLang servers of TP 2
    "colocated-2x4": (REPO / "recipes" / "slurm-qwen3-1.7b.yaml", [
        "colocate.enabled=true", "pipeline.mode=sync", "rollout.servers=4", "slurm.trainer.nodes=2", "train.ranks=8",
        "slurm.trainer.gpus_per_node=4", "slurm.rollout.servers_per_node=2", "rollout.sglang.tp_size=2",
        "slurm.rollout.gpus_per_node=0", "slurm.rollout.nodes=0"]),
}


def render(name: str, *extra: str) -> str:
    recipe_file, overrides = CASES[name]
    r = load_recipe(recipe_file, [*overrides, *extra], check_paths=False)
    return render_batch_script(r, RUN_DIR, "RUN-ID", r.slurm.python or PYTHON)


@pytest.mark.parametrize("name", sorted(CASES))
def test_batch_script_matches_golden_file(name):
    """To accept a deliberate change: RLCTL_UPDATE_GOLDEN=1 pytest tests/test_slurm_render.py, then
    read the diff."""
    text = render(name)
    golden = GOLDEN / f"{name}.sbatch"
    if os.environ.get("RLCTL_UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text()


def test_batch_script_structure():
    text = render("cluster-2x4")
    head, _, rest = text.partition("#SBATCH hetjob\n")
    assert "#SBATCH --nodes=2" in head and "#SBATCH --ntasks-per-node=8" in head and "--gpus-per-node=8" in head
    assert "#SBATCH --nodes=4" in rest and "#SBATCH --ntasks-per-node=2" in rest
    for part in (head, rest):
        assert "#SBATCH --job-name=RUN-ID" in part
        assert "#SBATCH --partition=gpu" in part and "#SBATCH --account=rl-team" in part and "#SBATCH --qos=high" in part
    assert "#SBATCH --output=/shared/runs/RUN-ID/logs/slurm-%j.out" in head
    assert 'RLCTL_LOGS="$RUN_DIR/logs/attempt-$ATTEMPT"' in text
    assert text.index("ATTEMPT=$(rlctl_step attempt") < text.index("rlctl_step plan")
    # Before the time limit: a checkpoint, then the job requeues itself (slurm.requeue, the default)
    assert "#SBATCH --signal=B:USR1@300" in head and "#SBATCH --requeue" in head and "#SBATCH --open-mode=append" in head
    assert "trap on_usr1 USR1" in text and '[ "$code" = 75 ] && requeue_run' in text
    assert "(trap '' USR1; exec \"$PY\" -m rlctl.worker controller" in text  # USR1 cannot kill it while it starts
    assert 'SLURM_JOB_NODELIST_HET_GROUP_0' in text and 'SLURM_JOB_NODELIST_HET_GROUP_1' in text
    # servers before trainers, and every process is `python -m rlctl.worker ROLE`
    # each server its own step on its node (restarted alone after a failure), with its own GPUs
    servers = text.index('srun --het-group=1 --nodes=1 --ntasks=1 --nodelist="${ROLLOUT_NODE[$1 / 2]}"')
    assert "--gres=gpu:1 --exact" in text and 'for ((i = 0; i < 8; i++)); do RESTARTS[i]=0; start_server "$i"; done' in text
    assert 'STEP_MEM=(--mem=$((JOB_MEM / 2))M)' in text  # steps share what the job holds of a node's memory
    assert 'scontrol show job -d "${SLURM_JOB_ID_HET_GROUP_1:-$SLURM_JOB_ID}"' in text
    trainers = text.index("srun --het-group=0 --nodes=2 --ntasks=16 --ntasks-per-node=8")
    assert servers < text.index("until rlctl_step health") < trainers
    assert text.count("-m rlctl.worker") == 4  # rlctl_step, rollout, trainer, controller
    assert text.count("--kill-on-bad-exit=1") == 1  # the trainer ranks: one dead rank ends them all
    # CPUs per task on sbatch and srun (srun 22.05 and 23.02 do not inherit them), the nodes' memory,
    # and every task gets the script's environment whatever the submitting shell's SLURM_EXPORT_ENV
    assert head.count("#SBATCH --cpus-per-task=4") == rest.count("#SBATCH --cpus-per-task=4") == 1
    assert "#SBATCH --mem=0" in head and "#SBATCH --mem=0" in rest
    assert text.count("--cpus-per-task=4 \\\n  --export=ALL --kill-on-bad-exit=1") == 1
    assert text.count("--cpus-per-task=4 \\\n    --gres=gpu:1 --exact ${STEP_MEM[@]+\"${STEP_MEM[@]}\"} --export=ALL") == 1
    assert "bash -c 'rlctl_own_gpus 1 \"$@\"' rlctl_own_gpus" in text  # one GPU per built-in server


def own_gpus(text: str, n: int, visible: str | None) -> subprocess.CompletedProcess:
    """Run the script's rlctl_own_gpus in bash as a server step with the CUDA_VISIBLE_DEVICES Slurm
    gave it (None: Slurm set none)."""
    fn = text[text.index("rlctl_own_gpus() {"):text.index("\n}\n", text.index("rlctl_own_gpus() {")) + 3]
    env = {"PATH": os.environ["PATH"], "SLURM_JOB_ID": "7", "SLURM_STEP_ID": "3"}
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    return subprocess.run(["bash", "-c", f"{fn}\nrlctl_own_gpus {n} bash -c 'echo \"$CUDA_VISIBLE_DEVICES\"'"],
                          capture_output=True, text=True, env=env)


@pytest.mark.process
@pytest.mark.parametrize("visible, expected", [
    ("0,1,2,3", "0,1,2,3"),
    ("4,5,6,7", "4,5,6,7"),  # Slurm's numbering as it is (a shared node, no cgroup)
    ("12,13,14,15", "12,13,14,15"),
    (None, "0,1,2,3"),  # no CUDA_VISIBLE_DEVICES from Slurm: 0..n-1
])
def test_each_sglang_server_runs_on_the_gpus_slurm_gave_its_step(visible, expected):
    text = render("example-qwen3-1.7b")  # 2 servers of tp 4 per 8-GPU node
    assert "bash -c 'rlctl_own_gpus 4 \"$@\"' rlctl_own_gpus" in text and "--base-gpu-id" not in text
    assert "--gres=gpu:4 --exact" in text
    res = own_gpus(text, 4, visible)
    assert res.returncode == 0, res.stderr
    said, cvd = res.stdout.splitlines()
    assert cvd == expected and f"runs this server on GPUs {expected} " in said and "step 7.3" in said


@pytest.mark.process
def test_too_few_gpus_for_a_server_is_one_line_in_its_log():
    res = own_gpus(render("example-qwen3-1.7b"), 4, "0,1")
    assert res.returncode == 1 and res.stdout == ""
    assert res.stderr.strip().splitlines() == [
        "error: " + os.uname().nodename + " gave this server 2 GPU(s) (0 1), it needs 4: "
        "raise slurm.rollout.gpus_per_node or lower servers_per_node"]


@pytest.mark.process
@pytest.mark.parametrize("visible", ["0,1,2,3", "4,5,6,7", None])
def test_colocated_each_rank_and_its_servers_tp_rank_take_the_same_gpu(visible):
    """colocated-2x4: servers of TP 2, 2 per node, 4 ranks per node. The script's own lines run
    in bash: each server's first GPU and each rank's come from their positions among the job's
    GPUs of the node, which every overlapping step sees alike."""
    text = render("colocated-2x4")
    fn = text[text.index("rlctl_colocated_gpus() {"):text.index("\n}\n", text.index("rlctl_colocated_gpus() {")) + 3]
    server = re.search(r"bash -c 'rlctl_colocated_gpus \"\$@\"' rlctl_colocated_gpus (.+) \\\n", text).group(1)
    trainer = re.search(r"(bash -c 'rlctl_colocated_gpus \"\$SLURM_LOCALID\".*') rlctl_colocated_gpus \\\n", text).group(1)
    env = {"PATH": os.environ["PATH"], "SLURM_JOB_ID": "7", "SLURM_STEP_ID": "3", **({"CUDA_VISIBLE_DEVICES": visible}
                                                                                      if visible else {})}
    echo = "bash -c 'echo \"$CUDA_VISIBLE_DEVICES\"'"

    def gpus(line: str, *args: str, **extra: str) -> list[str]:
        res = subprocess.run(["bash", "-c", f"{fn}\nexport -f rlctl_colocated_gpus\n{line}", "script", *args],
                             capture_output=True, text=True,
                             env={**env, **extra})
        assert res.returncode == 0, res.stderr
        return res.stdout.splitlines()[-1].split(",")

    node = (visible or "0,1,2,3").split(",")
    for index in range(4):  # server i: node i // 2, TP ranks on the GPUs of trainer ranks 2i and 2i+1
        mine = gpus(f"set -- {index}; rlctl_colocated_gpus {server} {echo}")
        ranks = [gpus(f"{trainer} rlctl_colocated_gpus {echo}", SLURM_LOCALID=str(r % 4))[0]
                 for r in (2 * index, 2 * index + 1)]
        assert mine == ranks == node[index % 2 * 2:index % 2 * 2 + 2], (index, mine, ranks)
    res = subprocess.run(["bash", "-c", f"{fn}\nrlctl_colocated_gpus 2 2 true"], capture_output=True, text=True,
                         env={**env, "CUDA_VISIBLE_DEVICES": "0,1,2"})
    assert res.returncode == 1 and "needs GPUs 2..3: set slurm.trainer.gpus_per_node" in res.stderr


def nodes_python(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    """Run the script from its start to the choice of the nodes' Python, then print that Python.
    PATH holds no python3 (nor mkdir: called by its path here), so only what slurm.setup adds is found."""
    r = load_recipe(QUICKSTART, ["launcher=slurm", *overrides], check_paths=False)
    text = render_batch_script(r, tmp_path / "run", "RUN-ID", "/submitting/python3")
    head = text[:text.index("\nrlctl_step() {")].replace("mkdir -p", "/bin/mkdir -p")
    return subprocess.run([shutil.which("bash"), "-c", head + '\necho "PY=$PY"'], capture_output=True, text=True, cwd=tmp_path,
                          env={"PATH": str(tmp_path / "no-python"), "HOME": str(tmp_path)})


@pytest.mark.process
def test_the_nodes_python_is_the_one_setup_puts_on_path(tmp_path):
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python3").symlink_to(os.sys.executable)
    env = f"slurm.env={{PYTHONPATH: {REPO}}}"  # rlctl importable by that python wherever it is installed
    res = nodes_python(tmp_path, f"slurm.setup=['export PATH={venv}:$PATH']", env)
    assert res.returncode == 0 and res.stdout.splitlines()[-1] == f"PY={venv}/python3", res.stderr
    # slurm.python wins; no setup lines: the python of `rlctl launch`
    res = nodes_python(tmp_path, f"slurm.setup=['export PATH={venv}:$PATH']", "slurm.python=/usr/bin/env")
    assert res.returncode == 1 and res.stderr.startswith("error: the nodes' python, /usr/bin/env (slurm.python), "
                                                          "cannot import rlctl"), res.stderr
    res = nodes_python(tmp_path)
    assert res.returncode == 1 and "/submitting/python3 (the python of rlctl launch)" in res.stderr
    res = nodes_python(tmp_path, "slurm.setup=['true']")  # no python3 with rlctl on PATH
    assert res.returncode == 1 and "(python3 on PATH after slurm.setup), cannot import rlctl" in res.stderr


@pytest.mark.process
def test_slurm_env_is_exported_quoted_and_never_on_a_command_line(tmp_path):
    text = render("options")
    topo = "/shared/topo files/h200 'v2'.xml"
    exports = ["export NCCL_SOCKET_IFNAME='ib0,ib1'", "export NCCL_IB_HCA='=mlx5_0:1,mlx5_1:1'",
               """export NCCL_TOPO_FILE='/shared/topo files/h200 '"'"'v2'"'"'.xml'"""]
    assert "\n".join(["# slurm.env", *exports]) + "\n" in text
    assert text.index("source /shared/venvs/rl/bin/activate") < text.index("# slurm.env")  # after setup: they win
    assert [line for line in text.splitlines() if "mlx5_0" in line or "h200 " in line or "ib1" in line] == exports
    env_lines = text[text.index("# slurm.env\n"):text.index("\n\n", text.index("# slurm.env\n"))]
    res = subprocess.run(["bash", "-c", env_lines + '\nprintf "%s|" "$NCCL_TOPO_FILE" "$NCCL_IB_HCA"'],
                         capture_output=True, text=True)
    assert res.stdout == f"{topo}|=mlx5_0:1,mlx5_1:1|", res.stderr


def test_cluster_recipe_dry_run_needs_no_model_here(tmp_path):
    """recipes/slurm-qwen3-1.7b.yaml names /shared paths that only the cluster holds; the job
    looks for them on its first node (test_a_model_missing_on_the_node_is_the_runs_exit_reason)."""
    env = {"PATH": os.path.dirname(os.sys.executable)}
    res = rlctl_here("launch", str(REPO / "recipes" / "slurm-qwen3-1.7b.yaml"), "--dry-run", f"run.output_dir={tmp_path}",
                cwd=tmp_path, env=env)
    assert res.returncode == 0, res.stderr
    assert "#SBATCH --gpus-per-node=8" in res.stdout and "rlctl_own_gpus 4" in res.stdout
    res = rlctl_here("launch", str(QUICKSTART), "model.init=null", "model.path=/shared/models/Qwen3-1.7B",
                f"run.output_dir={tmp_path}", cwd=tmp_path)  # launcher=local: the model must be here
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1 and ": model.path: " in res.stderr


@pytest.mark.process
def test_a_model_missing_on_the_node_is_the_runs_exit_reason(tmp_path):
    from rlctl.commands.launch import write_batch_script

    recipe = REPO / "recipes" / "slurm-qwen3-1.7b.yaml"
    run_dir = write_batch_script(load_recipe(recipe, [f"run.output_dir={tmp_path}"]), recipe, []).path  # as if submitted
    plan = subprocess.run([os.sys.executable, "-m", "rlctl.worker", "plan", "--run-dir", str(run_dir), "--trainer-nodes",
                           "t1 t2", "--rollout-nodes", "r1 r2 r3 r4", "--port-base", "30000"],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert plan.returncode == 1
    info = json.loads((run_dir / "run.json").read_text())
    assert info["state"] == "failed" and info["plan"] is None
    assert info["exit_reason"].startswith("model.path: '/shared/models/Qwen3-1.7B' is not a Hugging Face model "
                                          "directory"), info["exit_reason"]
    assert f"(looked for on {os.uname().nodename}, the job's first node)" in info["exit_reason"]


@pytest.mark.process
@pytest.mark.parametrize("name", sorted(CASES))
def test_batch_script_passes_shellcheck(name, tmp_path):
    if shutil.which("shellcheck") is None:
        if os.environ.get("CI"):
            pytest.fail("shellcheck is not installed (scripts/run-tests.sh installs it)")
        pytest.skip("shellcheck is not installed")
    script = tmp_path / f"{name}.sbatch"
    script.write_text(render(name))
    res = subprocess.run(["shellcheck", "--severity=style", str(script)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout


@pytest.mark.process
def test_test_cluster_script_passes_shellcheck():
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed")
    res = subprocess.run(["shellcheck", str(REPO / "scripts" / "slurm-test-cluster.sh"),
                          str(REPO / "scripts" / "run-tests.sh")], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout


def test_plan_places_servers_and_ranks_on_their_nodes():
    r = load_recipe(GOLDEN / "cluster-2x4.yaml", check_paths=False)
    plan = slurm_topology(r, ["t1", "t2"], ["r1", "r2", "r3", "r4"], 30000)
    assert [(s.host, s.port) for s in plan.rollout] == [
        ("r1", 30000), ("r1", 30001), ("r2", 30000), ("r2", 30001),
        ("r3", 30000), ("r3", 30001), ("r4", 30000), ("r4", 30001)]
    assert all(s.listen == s.host for s in plan.rollout)  # the node's own address, not all of them
    assert [t.host for t in plan.trainers] == ["t1"] * 8 + ["t2"] * 8
    assert plan.trainer_url == "http://t1:30002" and plan.trainers[0].listen == "t1"
    assert (plan.trainer_dist_port, plan.weight_sync_port) == (30003, 30004)
    assert plan.controller.host == "t1"
    with pytest.raises(ValueError, match="need 4 nodes"):
        slurm_topology(r, ["t1", "t2"], ["r1", "r2", "r3"], 30000)


@pytest.mark.parametrize("override, key", [
    ("slurm.time=soon", "slurm.time"),
    ("slurm.rollout.nodes=3", "slurm.rollout.nodes"),
    ("slurm.rollout.servers_per_node=3", "slurm.rollout.servers_per_node"),
    ("slurm.trainer.nodes=2", "slurm.trainer.nodes"),  # 1 rank does not spread over 2 nodes
    ("slurm.partition='gpu; rm -rf /'", "slurm.partition"),
    ("slurm.sbatch_args=[exclusive]", "slurm.sbatch_args[0]"),
    ("slurm.sbatch_args=[--job-name=x]", "slurm.sbatch_args[0]"),
    ("slurm.port_base=80", "slurm.port_base"),
    ("slurm.gpus=8", "slurm.gpus"),
    ("slurm.trainer.gpus_per_node=two", "slurm.trainer.gpus_per_node"),
    ("slurm.env={1NCCL: x}", "slurm.env.1NCCL"),
    ("slurm.env={NCCL-IB: x}", "slurm.env.NCCL-IB"),
    ("slurm.env.CUDA_VISIBLE_DEVICES=0", "slurm.env.CUDA_VISIBLE_DEVICES"),
    ("slurm.env.SLURM_CPUS_PER_TASK=4", "slurm.env.SLURM_CPUS_PER_TASK"),
    ("slurm.env.HF_TOKEN=hf_abc", "slurm.env.HF_TOKEN"),  # a secret: the shell's environment, not the recipe
    ("slurm.env.WANDB_API_KEY=abc", "slurm.env.WANDB_API_KEY"),
    ("slurm.env.GH_PAT=ghp_abc", "slurm.env.GH_PAT"),
    ("slurm.sbatch_args=[-o/tmp/x]", "slurm.sbatch_args[0]"),  # -o with its value attached
    ("slurm.sbatch_args=['--output /tmp/x']", "slurm.sbatch_args[0]"),
    ("slurm.sbatch_args=[--exclusive, -N5]", "slurm.sbatch_args[1]"),
])
def test_bad_slurm_settings_name_the_key(tmp_path, override, key):
    res = rlctl_here("launch", str(QUICKSTART), "launcher=slurm", override, f"run.output_dir={tmp_path}", cwd=tmp_path)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and f": {key}: " in lines[0], res.stderr
    assert not list(tmp_path.iterdir())  # no run directory


def test_dry_run_prints_the_script_and_submits_nothing(tmp_path):
    # No Slurm commands on PATH at all: a dry run must not need them (nor write anything: test_dry_run.py).
    env = {"PATH": os.path.dirname(os.sys.executable)}
    res = rlctl_here("launch", str(QUICKSTART), "launcher=slurm", "--dry-run", f"run.output_dir={tmp_path}", *FAST,
                cwd=tmp_path, env=env)
    assert res.returncode == 0, res.stderr
    assert list(tmp_path.iterdir()) == []
    run_id = res.stdout.split("#SBATCH --job-name=", 1)[1].split("\n", 1)[0]
    assert run_id.startswith("quickstart-") and f"--output={tmp_path.resolve() / run_id}/logs/" in res.stdout


@pytest.mark.process
def test_missing_slurm_is_a_one_line_runtime_error(tmp_path):
    env = {"PATH": os.path.dirname(os.sys.executable)}  # python, but no sbatch
    res = rlctl("launch", str(QUICKSTART), "launcher=slurm", f"run.output_dir={tmp_path}", *FAST, cwd=tmp_path, env=env)
    assert res.returncode == 1
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "sbatch not found" in lines[0], res.stderr
    (run_dir,) = tmp_path.iterdir()
    info = json.loads((run_dir / "run.json").read_text())
    assert info["state"] == "failed" and "not submitted" in info["exit_reason"]
