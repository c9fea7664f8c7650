"""The `calculator` tool: arithmetic on numbers, parsed with `ast` and walked over a whitelist
of nodes. Nothing is evaluated by Python (no `eval`), names and calls do not exist, and powers
and results are bounded so no expression can take the orchestrator's CPU or memory.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any

from orchestrator.tools.base import ToolError, ToolResult

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {
    ast.UAdd: operator.pos,
    ast.USub: operator.neg,
}
MAX_EXPRESSION_CHARS = 500
MAX_EXPONENT = 1000  # 10**1000 is fine; 9**9**9 is not
MAX_MAGNITUDE = 10**100  # the results a policy can use; beyond: an error, not a huge int


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression; ToolError saying what is not allowed."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ToolError(f"not an arithmetic expression: {e.msg}") from None
    return _check(_eval(tree.body))


def _check(value: int | float) -> int | float:
    if isinstance(value, complex):  # (-8) ** 0.5
        raise ToolError("the result is not a real number")
    if isinstance(value, float) and not math.isfinite(value):
        raise ToolError("the result is not a finite number")
    if abs(value) > MAX_MAGNITUDE:
        raise ToolError("the result is too large")
    return value


def _eval(node: ast.expr) -> int | float:
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, int | float):
            raise ToolError(f"only numbers are allowed, not {node.value!r}")
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ToolError(f"exponent larger than {MAX_EXPONENT}")
        try:
            return _check(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        except OverflowError:
            raise ToolError("the result is too large") from None
    raise ToolError(f"not allowed in an arithmetic expression: {type(node).__name__}")


def format_number(value: int | float) -> str:
    """Integers as integers (2.0 -> 2): the answer a policy copies should be the plain one."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return repr(value)


class Calculator:
    name = "calculator"
    description = "Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses."
    parameters: dict[str, Any] = {
        "type": "object",
        "properties": {
            "expression": {"type": "string", "description": "For example (1969 - 1955) * 2"}
        },
        "required": ["expression"],
        "additionalProperties": False,
    }

    async def call(self, arguments: dict[str, Any]) -> ToolResult:
        return ToolResult(format_number(evaluate(str(arguments["expression"]))))
