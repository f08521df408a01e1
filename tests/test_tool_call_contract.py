"""rlctl's tool-call parser (rlctl/agents/calls.py) held to SGLang's own function-call detectors,
read from each supported release's wheel: the `hermes` detector's tags and block pattern, the
`qwen25` (Qwen2.5 / Qwen3) detector's tags, and how parse_base_json takes a call's name and
arguments. On every text SGLang finds calls in, rlctl finds the same calls."""

from __future__ import annotations

import ast
import json
import re

import pytest

from rlctl.agents.calls import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, parse_hermes
from sglang_source import SUPPORTED

HERMES = "sglang/srt/function_call/hermes_detector.py"
QWEN25 = "sglang/srt/function_call/qwen25_detector.py"
BASE = "sglang/srt/function_call/base_format_detector.py"

TEXTS = [
    '<tool_call>\n{"name": "calc", "arguments": {"expr": "23*47"}}\n</tool_call>',
    'I will compute it. <tool_call>{"name":"calc","arguments":{"expr":"1+1"}}</tool_call>',
    '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "parameters": {"x": [1, 2]}}</tool_call>',
    '<tool_call>\n[{"name": "a", "arguments": {"k": "v"}}, {"name": "b", "arguments": {}}]\n</tool_call>',
    '<tool_call>{"name": "both", "parameters": {"p": 1}, "arguments": {"a": 2}}</tool_call>',
]


def init_strings(tree: ast.Module, cls: str) -> dict[str, object]:
    """self.<attr> = <literal> in cls.__init__, and re.compile(<literal>, ...) patterns."""
    found: dict[str, object] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for fn in node.body:
                if isinstance(fn, ast.FunctionDef) and fn.name == "__init__":
                    for a in ast.walk(fn):
                        if isinstance(a, ast.Assign) and isinstance(a.targets[0], ast.Attribute):
                            value = a.value
                            if isinstance(value, ast.Call) and ast.unparse(value.func) == "re.compile":
                                value = value.args[0]
                            try:
                                found[a.targets[0].attr] = ast.literal_eval(value)
                            except ValueError:
                                pass
    return found


@pytest.mark.parametrize("version", SUPPORTED)
def test_the_tags_are_sglangs_hermes_and_qwen25_tags(sglang, version):
    src = sglang(version)
    hermes = init_strings(src.module(HERMES), "HermesDetector")
    qwen = init_strings(src.module(QWEN25), "Qwen25Detector")
    assert (hermes["bot_token"], hermes["eot_token"]) == (TOOL_CALL_OPEN, TOOL_CALL_CLOSE)
    # Qwen's detector wants the newlines its chat template writes; rlctl reads the tags with or without them
    assert (str(qwen["bot_token"]).strip(), str(qwen["eot_token"]).strip()) == (TOOL_CALL_OPEN, TOOL_CALL_CLOSE)


@pytest.mark.parametrize("version", SUPPORTED)
def test_every_call_sglang_finds_rlctl_finds_with_the_same_arguments(sglang, version):
    src = sglang(version)
    pattern = re.compile(str(init_strings(src.module(HERMES), "HermesDetector")["tool_call_regex"]), re.DOTALL)
    (base,) = [f for f in ast.walk(src.module(BASE)) if isinstance(f, ast.FunctionDef) and f.name == "parse_base_json"]
    args_expr = next(ast.unparse(k.value) for k in ast.walk(base) if isinstance(k, ast.keyword) and k.arg == "parameters")
    assert "act.get('parameters') or act.get('arguments', {})" in args_expr, args_expr
    for text in TEXTS:
        theirs = []
        for match in pattern.findall(text):
            block = next(g for g in match if g) if isinstance(match, tuple) else match
            action = json.loads(block.strip())
            for act in action if isinstance(action, list) else [action]:
                theirs.append((act.get("name"), act.get("parameters") or act.get("arguments", {})))
        assert [(c.name, c.arguments) for c in parse_hermes(text)] == theirs, text
