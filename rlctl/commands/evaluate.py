"""`rlctl eval RUN|MODEL_DIR [--set FILE ...] [KEY=VALUE ...]`: evaluate a policy on held-out sets
without training it.

RUN: the run's newest checkpoint or final policy (`rlctl export` would write the same), with the
run's own recipe: its servers, chat template and verifier. MODEL_DIR: a Hugging Face model
directory, with the recipe `--recipe` names. Either way the evaluation is a run of no steps
(run.steps=0): the same rollout servers and scoring a training run uses evaluate every set once,
at the model's weights, and the run directory holds the results (eval.jsonl), which `rlctl
status` and `rlctl compare` read like any run's (docs/evaluation.md). Without --set, the
recipe's own eval sets are evaluated.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from rlctl.errors import UsageError


def evaluate(
    target: str = typer.Argument(..., help="A run (id, name or directory) or a Hugging Face model directory."),
    overrides: list[str] | None = typer.Argument(None, help="KEY=VALUE overrides of the recipe, e.g. "
                                                 "reward.verifier=math."),
    sets: list[Path] | None = typer.Option(None, "--set", help="A held-out set: JSONL, Parquet or a save_to_disk "
                                           "directory (repeat for several; default: the recipe's eval sets)."),
    samples: int = typer.Option(4, "--samples", "-k", help="Responses per prompt (the k of pass@k)."),
    limit: int = typer.Option(0, "--limit", help="Evaluate the first N prompts of each set (0: all)."),
    recipe: Path | None = typer.Option(None, "--recipe", help="The recipe whose servers, chat template and verifier "
                                       "evaluate (default for a run: its own)."),
    runs_dir: Path = typer.Option(Path("runs"), "--runs-dir", help="Where the run directories are; the evaluation's "
                                  "run is written there too."),
    detach: bool = typer.Option(False, "--detach", "-d", help="Return at once; the evaluation goes on in the "
                                "background."),
) -> None:
    """Evaluate a run's policy or a model directory on held-out sets, without training."""
    from rlctl.commands.launch import launch

    recipe_file, model, name = _target(target, recipe, runs_dir)
    forced = ["run.steps=0", f"model.path={json.dumps(str(model))}", f"run.name={name}", "eval.before=true",
              "eval.every=0", "eval.at_end=false", "run.save_final=false", "run.save_every=0",
              f"run.output_dir={json.dumps(str(runs_dir))}"]
    if sets:
        missing = [s for s in sets if not s.exists()]
        if missing:
            raise UsageError(f"--set {missing[0]}: no such file or directory")
        items = ", ".join(f"{{path: {json.dumps(str(s.resolve()))}, samples: {samples}, limit: {limit}}}" for s in sets)
        forced.append(f"eval.sets=[{items}]")
    launch(recipe_file, [*(overrides or []), *forced], detach=detach, dry_run=False, resume=False)


def _target(target: str, recipe: Path | None, runs_dir: Path) -> tuple[Path, Path, str]:
    """(the recipe file, the model directory, the evaluation run's name) for RUN or MODEL_DIR."""
    from rlctl.run.checkpoint import find_checkpoint
    from rlctl.run.find import find_run
    from rlctl.run.manifest import check_manifest

    as_dir = Path(target)
    if (as_dir / "config.json").is_file():  # a model directory
        if recipe is None:
            raise UsageError(f"{target} is a model directory: give --recipe RECIPE, the recipe whose servers, chat "
                             "template and verifier evaluate it (the one you train with)")
        return recipe, as_dir.resolve(), f"eval-{_name(as_dir.resolve().name)}"
    rd = find_run(target, runs_dir)
    ckpt = find_checkpoint(rd.path)
    check_manifest(ckpt.path)  # what is evaluated is what was saved
    return recipe or rd.recipe_path, ckpt.hf.resolve(), f"eval-{_name(rd.read().get('name') or rd.id)}"


def _name(text: str) -> str:
    """A run name (rlctl/recipe/inputs.py RUN_NAME) made of `text`."""
    kept = "".join(c if c.isalnum() or c in "_.+-" else "-" for c in text).lstrip("-.")
    return kept[:90] or "model"
