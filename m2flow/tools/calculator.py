"""The ``calculator`` tool: arithmetic, evaluated safely. The expression is parsed with ``ast``
and only a whitelist of nodes is evaluated (numbers; + - * / // % **; unary + and -;
parentheses; a few functions and constants of ``math``); never ``eval``. Names, attributes,
subscripts, comprehensions and strings are refused, and so are results too large to compute
cheaply (an integer past MAX_BITS bits, a factorial past MAX_FACTORIAL)."""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable

from m2flow.tools.base import ToolError

REFUSED = "refused"   # not arithmetic, or too large
MATH_ERROR = "math"   # arithmetic without a value: division by zero, a domain error, an overflow

MAX_CHARS = 1000
MAX_BITS = 10_000       # no integer operand or result past this many bits (about 3000 digits)
MAX_FACTORIAL = 1000

CONSTANTS = {"pi": math.pi, "e": math.e, "tau": math.tau}
FUNCTIONS: dict[str, Callable[..., float | int]] = {
    "sqrt": math.sqrt, "exp": math.exp, "log": math.log, "log2": math.log2, "log10": math.log10,
    "sin": math.sin, "cos": math.cos, "tan": math.tan, "asin": math.asin, "acos": math.acos, "atan": math.atan,
    "abs": abs, "round": round, "floor": math.floor, "ceil": math.ceil, "factorial": math.factorial,
    "gcd": math.gcd, "comb": math.comb, "perm": math.perm, "min": min, "max": max,
}
BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
          ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _bits(x: float | int) -> int:
    return abs(x).bit_length() if isinstance(x, int) else 0


def _check_size(op: type, a: float | int, b: float | int) -> None:
    """Refuses an integer operation whose result would pass MAX_BITS (before computing it)."""
    if op is ast.Pow and isinstance(a, int) and isinstance(b, int) and abs(a) > 1:
        if b * math.log2(abs(a)) > MAX_BITS:
            raise ToolError(REFUSED, f"{a} ** {b} is too large (more than {MAX_BITS} bits)")
    elif op is ast.Mult and _bits(a) + _bits(b) > MAX_BITS:
        raise ToolError(REFUSED, f"the product is too large (more than {MAX_BITS} bits)")


def _eval(node: ast.AST) -> float | int:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant):
        if type(node.value) in (int, float):
            return node.value
        raise ToolError(REFUSED, f"not a number: {node.value!r}")
    if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
        a, b = _eval(node.left), _eval(node.right)
        _check_size(type(node.op), a, b)
        return BINARY[type(node.op)](a, b)
    if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
        return UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.Name):
        if node.id in CONSTANTS:
            return CONSTANTS[node.id]
        raise ToolError(REFUSED, f"unknown name {node.id!r} (constants: {', '.join(CONSTANTS)})")
    if isinstance(node, ast.Call):
        if not isinstance(node.func, ast.Name) or node.func.id not in FUNCTIONS or node.keywords:
            raise ToolError(REFUSED, f"only these functions, with plain arguments: {', '.join(FUNCTIONS)}")
        args = [_eval(a) for a in node.args]
        if node.func.id in ("factorial", "comb", "perm") and any(abs(a) > MAX_FACTORIAL for a in args):
            raise ToolError(REFUSED, f"{node.func.id} of more than {MAX_FACTORIAL} is too large")
        return FUNCTIONS[node.func.id](*args)
    raise ToolError(REFUSED, f"not arithmetic: {type(node).__name__} is not allowed")


def _format(value: float | int) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 2 ** 53:
        return str(int(value))
    return format(value, ".15g") if isinstance(value, float) else str(value)


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: The expression, e.g. "2 * (3 + 4) ** 2 / 7" or "sqrt(2) * pi". It may use numbers,
            + - * / // % ** and parentheses, the constants pi, e and tau, and the functions sqrt, exp,
            log, log2, log10, sin, cos, tan, asin, acos, atan, abs, round, floor, ceil, factorial, gcd,
            comb, perm, min and max.
    """
    if len(expression) > MAX_CHARS:
        raise ToolError(REFUSED, f"the expression is longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError) as e:
        raise ToolError(REFUSED, f"not an expression: {getattr(e, 'msg', e)}") from None
    except (RecursionError, MemoryError):
        raise ToolError(REFUSED, "the expression is nested too deeply") from None
    try:
        value = _eval(tree)
        if isinstance(value, complex):
            raise ToolError(MATH_ERROR, "the result is not a real number")
        if isinstance(value, float) and not math.isfinite(value):
            raise ToolError(MATH_ERROR, "the result is too large")
        return _format(value)
    except ZeroDivisionError:
        raise ToolError(MATH_ERROR, "division by zero") from None
    except OverflowError:
        raise ToolError(MATH_ERROR, "the result is too large") from None
    except (ValueError, TypeError) as e:
        raise ToolError(MATH_ERROR, str(e)) from None
    except RecursionError:
        raise ToolError(REFUSED, "the expression is nested too deeply") from None
