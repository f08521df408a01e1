"""The `rlctl` command line: registers one module per command and maps errors to exit codes.

Exit codes: 0 ok; 1 runtime error (a run failed, a server is dead); 2 usage or recipe error.
Nothing heavy is imported here: `rlctl --help` and `rlctl status` must start fast.
"""

from __future__ import annotations

import os
import sys

import typer

from rlctl.commands import cancel, compare, export, launch, logs, plan, pool, resume, simulate, status, sweep, trace
from rlctl.errors import RlctlError


def _flags_as_flags() -> None:
    """Typer's help shows every option's type, so flags read `--detach <bool>`, as if they took a
    value. A flag's type column is left empty instead. Typer releases without the hook (it came
    in a later release than the oldest one rlctl takes) keep their own help as it is."""
    from typer.core import TyperOption

    shown = getattr(TyperOption, "display_type_rich", None)
    if shown is None:
        return

    def display_type_rich(self, ctx):
        return None if self.is_flag else shown(self, ctx)
    TyperOption.display_type_rich = display_type_rich


_flags_as_flags()
app = typer.Typer(
    name="rlctl",
    help="Run RL post-training (GRPO) experiments: rollout servers, trainers and the pipeline between them.",
    no_args_is_help=True,
    add_completion=True,  # --install-completion / --show-completion for bash, zsh, fish, PowerShell
    pretty_exceptions_enable=False,
)


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", help="Show tracebacks for errors.")) -> None:
    if debug:
        os.environ["RLCTL_DEBUG"] = "1"


app.command("launch", no_args_is_help=True)(launch.launch)
app.command("status")(status.status)
app.command("cancel", no_args_is_help=True)(cancel.cancel)
app.command("logs", no_args_is_help=True)(logs.logs)
app.command("simulate", no_args_is_help=True)(simulate.simulate)
app.command("plan", no_args_is_help=True)(plan.plan)
app.command("trace", no_args_is_help=True)(trace.trace)
app.command("compare", no_args_is_help=True)(compare.compare)
app.command("resume", no_args_is_help=True)(resume.resume)
app.command("export", no_args_is_help=True)(export.export)
app.command("sweep", no_args_is_help=True)(sweep.sweep)
app.add_typer(pool.app, name="pool")


def main() -> None:
    try:
        app(prog_name="rlctl")
    except RlctlError as e:
        if os.environ.get("RLCTL_DEBUG"):
            raise
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
