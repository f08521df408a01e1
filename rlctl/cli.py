"""The `rlctl` command line: registers one module per command and maps errors to exit codes.

Exit codes: 0 ok; 1 runtime error (a run failed, a server is dead); 2 usage or recipe error.
Nothing heavy is imported here: `rlctl --help` and `rlctl status` must start fast
(scripts/bench_cli.py measures them; tests/test_cli_help.py keeps the heavy modules out). Each
command module imports what it needs inside the command. Typer itself brings two costs no
command needs, which the hooks below take off: its help renderer imports Markdown and traceback
rendering (markdown-it, pygments) up front, and Typer 0.2x converts every value through a pydantic
TypeAdapter, so that pydantic is imported by every command that takes an argument.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import typer

from rlctl.commands import (cancel, compare, evaluate, export, launch, logs, plan, pool, resume, samples, simulate,
                            status, sweep, trace)
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


_DEFERRED = {"rich.markdown": {"Markdown"}, "rich.traceback": {"Traceback"}}
"""What typer.rich_utils imports at its top and uses only for markup_mode="markdown" (which rlctl
does not use) and for pretty tracebacks (which rlctl turns off): about a third of `rlctl --help`."""


def _stand_in(module: str, names: set[str]) -> Any:
    """A module whose `names` are classes that import the real module when first called or asked
    for an attribute; any other attribute asked of it imports the real module (the stand-in leaves
    sys.modules) at once."""
    import types

    stand_in = types.ModuleType(module)

    def real() -> Any:
        if sys.modules.get(module) is stand_in:
            del sys.modules[module]
        return importlib.import_module(module)

    def deferred(name: str) -> type:
        class Deferred(type):  # the real class's attributes (Traceback.from_exception), looked up when used
            def __getattr__(cls, attr: str) -> Any:
                return getattr(getattr(real(), name), attr)
        return Deferred(name, (), {"__new__": lambda cls, *a, **kw: getattr(real(), name)(*a, **kw)})

    def attribute(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return deferred(name) if name in names else getattr(real(), name)
    stand_in.__getattr__ = attribute  # type: ignore[method-assign]
    return stand_in


class _LightHelp(importlib.abc.MetaPathFinder):
    """Imports typer.rich_utils (Typer's help renderer, loaded when help is shown) with stand-ins
    for the modules in _DEFERRED, which leave sys.modules again right after: any later import of
    them is the real one."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != "typer.rich_utils":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module") or any(m in sys.modules for m in _DEFERRED):
            return spec
        run = loader.exec_module

        def exec_module(module: Any) -> None:
            stand_ins = {m: _stand_in(m, names) for m, names in _DEFERRED.items()}
            sys.modules.update(stand_ins)
            try:
                run(module)
            finally:
                for m, stand_in in stand_ins.items():
                    if sys.modules.get(m) is stand_in:
                        del sys.modules[m]
        loader.exec_module = exec_module
        return spec


def _plain_values_without_pydantic() -> None:
    """Typer 0.2x converts every command-line value with a pydantic TypeAdapter, even a flag's
    unset None; importing pydantic is about 50 ms of every command. A `str` value (or a list of
    them) is taken as it is, a `Path` goes through Typer's own path checks (which need no pydantic
    once given a Path), a bool as it is; anything else (and a bool given as text) keeps Typer's
    conversion. Releases without these internals (Typer on click, no pydantic) are left as they are."""
    try:
        from typer._coercion import RuntimeParam, build_runtime_param
        from typer._param_types import coerce_cli_path
        from typer.core import _TyperParameter
    except ImportError:
        return
    original = getattr(_TyperParameter, "get_runtime_param", None)
    if original is None:
        return

    class PlainRuntimeParam(RuntimeParam):
        def _coerce_value(self, value: Any, param: Any, ctx: Any) -> Any:
            if self.annotation is str:
                return value if isinstance(value, str) else str(value)
            if self.annotation == list[str]:
                return [v if isinstance(v, str) else str(v) for v in value]
            if self.annotation is Path:
                return coerce_cli_path(value if isinstance(value, Path) else Path(value), self.parameter_info,
                                       path_type=Path, param=param, ctx=ctx)
            if isinstance(value, bool):
                return value
            return build_runtime_param(param.type_descriptor)._coerce_value(value, param=param, ctx=ctx)

    def plain(descriptor: Any) -> bool:
        info = descriptor.parameter_info
        if getattr(info, "parser", None) is not None or getattr(descriptor, "file_annotation", None) is not None:
            return False
        if descriptor.annotation is Path:
            return getattr(info, "path_type", None) is None
        return descriptor.annotation in (str, bool) or descriptor.annotation == list[str]

    def get_runtime_param(self: Any) -> Any:
        if self._runtime_param is None:
            descriptor = getattr(self, "type_descriptor", None)
            if descriptor is not None and plain(descriptor):
                self._runtime_param = PlainRuntimeParam(parameter_info=descriptor.parameter_info,
                                                        annotation=descriptor.annotation)
        return original(self)
    _TyperParameter.get_runtime_param = get_runtime_param


_flags_as_flags()
_plain_values_without_pydantic()
if "typer.rich_utils" not in sys.modules:
    sys.meta_path.insert(0, _LightHelp())
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
app.command("samples", no_args_is_help=True)(samples.samples)
app.command("simulate", no_args_is_help=True)(simulate.simulate)
app.command("plan", no_args_is_help=True)(plan.plan)
app.command("trace", no_args_is_help=True)(trace.trace)
app.command("compare", no_args_is_help=True)(compare.compare)
app.command("resume", no_args_is_help=True)(resume.resume)
app.command("export", no_args_is_help=True)(export.export)
app.command("eval", no_args_is_help=True)(evaluate.evaluate)
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
