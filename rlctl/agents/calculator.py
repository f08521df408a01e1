"""The built-in calculator tool: arithmetic on numbers, read with `ast` and never evaluated as Python.

`calc(expr)` takes + - * / // % ** and parentheses over integers and decimals. Anything else (a
name, a call, an attribute, a string) is refused, and so is work without bound: an expression over
MAX_EXPR characters, a power whose result would pass MAX_MAGNITUDE, any intermediate result past it.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any

from rlctl.agents.environments import Environment, ToolError

MAX_EXPR = 200
MAX_MAGNITUDE = 10**18

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}

CALC_TOOL = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "Evaluate an arithmetic expression (+ - * / // % ** and parentheses).",
        "parameters": {"type": "object", "properties": {"expr": {"type": "string", "description": "e.g. 23*47"}},
                       "required": ["expr"]},
    },
}


def calculate(expr: str) -> str:
    """The value of `expr` as text (an integer without a decimal point); ToolError saying why not."""
    if not isinstance(expr, str):
        raise ToolError(f"expr must be a string, got {type(expr).__name__}")
    if len(expr) > MAX_EXPR:
        raise ToolError(f"the expression is over {MAX_EXPR} characters")
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError:
        raise ToolError(f"not an arithmetic expression: {expr!r}") from None
    value = _eval(tree.body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value) if isinstance(value, int) else repr(round(value, 12))


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and left not in (0, 1, -1):
            # |left| ** right passes the bound when right * log10|left| does: checked before computing it
            if right > 0 and right * math.log10(abs(left)) > math.log10(MAX_MAGNITUDE):
                raise ToolError(f"the result is beyond {MAX_MAGNITUDE:.0e}")
        try:
            return _bounded(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        except (OverflowError, ValueError) as e:
            raise ToolError(str(e)) from None
    raise ToolError(f"only numbers and + - * / // % ** ( ) are allowed, not {type(node).__name__}")


def _bounded(value: Any) -> int | float:
    if isinstance(value, complex) or (isinstance(value, float) and not math.isfinite(value)):
        raise ToolError("the result is not a finite real number")
    if abs(value) > MAX_MAGNITUDE:
        raise ToolError(f"the result is beyond {MAX_MAGNITUDE:.0e}")
    return value


class CalculatorEnv(Environment):
    """calc(expr): arithmetic."""

    def __init__(self) -> None:
        self.tools = [CALC_TOOL]

    def tool_calc(self, expr: str) -> str:
        return calculate(expr)
