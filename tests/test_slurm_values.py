"""Values on their way into a run's batch script (rlctl/launchers/slurm/values.py): a value sbatch
would split is quoted in its directive, and a control character is refused by the renderer
itself, whatever the recipe's checks let through."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import QUICKSTART
from rlctl.errors import UsageError
from rlctl.launchers.slurm import render_batch_script
from rlctl.recipe import load_recipe
from rlctl.recipe.sbatch_flags import sbatch_words

RUN_DIR = Path("/shared/runs/RUN-ID")
PYTHON = "/shared/venvs/rl/bin/python"


def output_directive(run_dir: Path) -> str:
    r = load_recipe(QUICKSTART, ["launcher=slurm"], check_paths=False)
    (line,) = [
        x for x in render_batch_script(r, run_dir, "RUN-ID", PYTHON).splitlines() if x.startswith("#SBATCH --output")
    ]
    return line


def test_a_run_directory_sbatch_would_split_is_quoted_in_its_directive():
    """sbatch splits a directive at whitespace and takes quotes, backslashes and # as its own; the
    run directory's path reaches --output whole, its % doubled (Slurm's escape for a plain %)."""
    line = output_directive(Path('/shared/my runs/"q" #1 50%/RUN-ID'))
    assert sbatch_words(line.removeprefix("#SBATCH")) == [
        '--output=/shared/my runs/"q" #1 50%%/RUN-ID/logs/slurm-%j.out'
    ]
    assert output_directive(RUN_DIR) == "#SBATCH --output=/shared/runs/RUN-ID/logs/slurm-%j.out"  # plain: as it is


@pytest.mark.parametrize("where", ["run_dir", "slurm.partition", "slurm.setup", "slurm.sbatch_args", "python"])
def test_the_batch_script_refuses_a_control_character_whatever_the_recipe_let_through(where):
    """The recipe's checks refuse control characters first; the renderer refuses them again, for
    a recipe built in code and for the run directory's path and the interpreter, which no recipe
    check sees."""
    r = load_recipe(QUICKSTART, ["launcher=slurm"], check_paths=False)
    run_dir, python = RUN_DIR, PYTHON
    if where == "run_dir":
        run_dir = Path("/shared/runs\nrm -rf ~/RUN-ID")
    elif where == "python":
        python = "/usr/bin/python3\r"
    elif where == "slurm.partition":
        r.slurm.partition = "gpu\n#SBATCH --uid=0"
    elif where == "slurm.setup":
        r.slurm.setup = ["module load cuda\x1b[2J"]
    else:
        r.slurm.sbatch_args = ["--exclusive\n-o /tmp/x"]
    with pytest.raises(UsageError) as info:
        render_batch_script(r, run_dir, "RUN-ID", python)
    assert "holds a control character" in str(info.value) and str(info.value).isprintable()
