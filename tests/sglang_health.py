"""SGLang's health check, read from its source (a tests/sglang_source.py Source): which routes
share the generating handler, the switch that lets /health answer without generating, how long
a generation that gets no reply is waited for, and which paths need no key.

    health_paths(src)            # {'/health', '/health_generate'}
    generation_switch(src)       # 'not envs.SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION.get() and ...'
    health_timeout(src)          # ('SGLANG_HEALTH_CHECK_TIMEOUT', 20)
    env_field(src, NAME)         # ('EnvBool', True)
    false_spellings(src)         # ['false', '0', 'no', 'n']
"""

from __future__ import annotations

import ast

from sglang_source import HTTP_SERVER, Source

ENVIRON = "sglang/srt/environ.py"
AUTH = "sglang/srt/utils/auth.py"


def health_paths(src: Source) -> set[str]:
    """Every path whose handler is /health's."""
    handler = src.handler("/health", "GET")
    return {path for path, _, f in src.route_table if f is handler}


def generation_switch(src: Source) -> str | None:
    """The test of the `if` in /health's handler that answers 200 before any generation is made,
    unparsed; None where there is none."""
    for node in ast.walk(src.handler("/health", "GET")):
        if isinstance(node, ast.If) and "ENABLE_HEALTH_ENDPOINT_GENERATION" in ast.unparse(node.test):
            returns = [n for n in node.body if isinstance(n, ast.Return)]
            if returns and "status_code=200" in ast.unparse(returns[0]):
                return ast.unparse(node.test)
    return None


def health_timeout(src: Source) -> tuple[str, int]:
    """HEALTH_CHECK_TIMEOUT = int(os.getenv(NAME, DEFAULT)) in http_server.py: (NAME, DEFAULT)."""
    for node in src.module(HTTP_SERVER).body:
        if (isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["HEALTH_CHECK_TIMEOUT"]
                and isinstance(node.value, ast.Call) and ast.unparse(node.value.func) == "int"):
            getenv = node.value.args[0]
            assert isinstance(getenv, ast.Call) and ast.unparse(getenv.func) == "os.getenv", ast.unparse(node)
            return ast.literal_eval(getenv.args[0]), ast.literal_eval(getenv.args[1])
    raise LookupError(f"SGLang {src.version}: no HEALTH_CHECK_TIMEOUT = int(os.getenv(...)) in {HTTP_SERVER}")


def env_field(src: Source, name: str) -> tuple[str, object]:
    """`NAME = EnvX(default)` in environ.py's Envs: (EnvX, default)."""
    for node in ast.walk(src.module(ENVIRON)):
        if (isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == [name]
                and isinstance(node.value, ast.Call)):
            return ast.unparse(node.value.func), ast.literal_eval(node.value.args[0])
    raise LookupError(f"SGLang {src.version}: {name} is not in {ENVIRON}")


def false_spellings(src: Source) -> list[str]:
    """What EnvBool.parse reads as False: the list of its second `if value in [...]: return False`."""
    parse = next(n for n in ast.walk(src.module(ENVIRON)) if isinstance(n, ast.ClassDef) and n.name == "EnvBool")
    for node in ast.walk(parse):
        if (isinstance(node, ast.If) and isinstance(node.body[0], ast.Return)
                and ast.unparse(node.body[0].value) == "False" and isinstance(node.test, ast.Compare)):
            return ast.literal_eval(node.test.comparators[0])
    raise LookupError(f"SGLang {src.version}: EnvBool.parse has no `if value in [...]: return False`")


def keyless_prefixes(src: Source) -> list[str]:
    """The path prefixes auth.py lets through with no key: each `path.startswith("/x")` of the
    `if` that returns an allowing decision first."""
    for node in ast.walk(src.module(AUTH)):
        if isinstance(node, ast.If) and "path.startswith" in ast.unparse(node.test):
            return [ast.literal_eval(c.args[0]) for c in ast.walk(node.test)
                    if isinstance(c, ast.Call) and ast.unparse(c.func) == "path.startswith"]
    raise LookupError(f"SGLang {src.version}: no path.startswith(...) check in {AUTH}")
