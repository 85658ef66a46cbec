"""The calculator tool's arithmetic: an evaluator over Python's `ast`, with no `eval` or `exec`.

The expression comes from a policy being trained, so it is hostile input: it may be huge, deeply
nested, or try names, attributes, calls, lambdas, comprehensions and string tricks. The evaluator
parses it with `ast.parse(mode="eval")` and walks the tree itself, allowing only numbers, the
operators `+ - * / // % **`, unary `+ -`, parentheses, the constants `pi` and `e`, and the
functions in `FUNCTIONS`. Everything else is refused by node type before any arithmetic runs.

Time and memory are bounded by construction rather than by a timer: the text is at most
`MAX_CHARS` long, the tree at most `MAX_NODES` nodes and `MAX_DEPTH` deep, every intermediate
value at most `MAX_MAGNITUDE` in size, and `**` is refused when its exponent or its result would be
too big *before* it is computed (so `9**9**9` and `10**100000` are refused, not computed). Every
operation is then on numbers of at most a few hundred digits.

`calculate` never raises: it returns the result's text or an "error: ..." string.
"""

from __future__ import annotations

import ast
import math
import operator
import warnings
from collections.abc import Callable

MAX_CHARS = 500
MAX_NODES = 200
MAX_DEPTH = 32
MAX_DIGITS = 100  # integers and results stay below 10**MAX_DIGITS in magnitude
MAX_MAGNITUDE = 10**MAX_DIGITS
MAX_EXPONENT = 1000
MAX_ARGS = 16
MAX_ROUND_DIGITS = 100

Number = int | float


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate; the message says why."""


def _round(x: Number, ndigits: Number | None = None) -> Number:
    if ndigits is None:
        return round(x)
    if not isinstance(ndigits, int) or abs(ndigits) > MAX_ROUND_DIGITS:
        raise CalculatorError(f"round's digits must be an integer in ±{MAX_ROUND_DIGITS}")
    return round(x, ndigits)


def _sqrt(x: Number) -> float:
    if x < 0:
        raise CalculatorError("sqrt of a negative number")
    return math.sqrt(x)


# name -> (function, fewest args, most args)
FUNCTIONS: dict[str, tuple[Callable[..., Number], int, int]] = {
    "abs": (abs, 1, 1),
    "round": (_round, 1, 2),
    "min": (min, 1, MAX_ARGS),
    "max": (max, 1, MAX_ARGS),
    "sqrt": (_sqrt, 1, 1),
    "floor": (math.floor, 1, 1),
    "ceil": (math.ceil, 1, 1),
}
CONSTANTS: dict[str, float] = {"pi": math.pi, "e": math.e}

_BINARY: dict[type[ast.operator], Callable[[Number, Number], Number]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_UNARY: dict[type[ast.unaryop], Callable[[Number], Number]] = {
    ast.UAdd: operator.pos,
    ast.USub: operator.neg,
}
_SYMBOLS = {
    ast.Add: "+",
    ast.Sub: "-",
    ast.Mult: "*",
    ast.Div: "/",
    ast.FloorDiv: "//",
    ast.Mod: "%",
    ast.Pow: "**",
}


def evaluate(expression: str) -> Number:
    """The value of an arithmetic expression, within the module's bounds.

    Args:
      expression: e.g. "3 * (4 + 5) / 2", "2**10", "sqrt(2)", "max(3, 7) % 4".

    Returns:
      An int, or a finite float, of magnitude at most `MAX_MAGNITUDE`.

    Raises:
      CalculatorError: the expression is not a string, too long, not valid syntax, uses
        anything not allowed, exceeds a bound, or its arithmetic fails (division by zero, ...).
    """
    if not isinstance(expression, str):
        raise CalculatorError(f"the expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_CHARS:
        raise CalculatorError(f"the expression is longer than {MAX_CHARS} characters")
    if not expression.strip():
        raise CalculatorError("the expression is empty")
    try:
        with warnings.catch_warnings():
            # "1if", "0x" and the like warn before they fail; the error below says enough.
            warnings.simplefilter("ignore")
            tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise CalculatorError(f"invalid syntax: {e.msg}") from None
    except (ValueError, RecursionError, MemoryError, OverflowError) as e:
        raise CalculatorError(f"cannot parse the expression ({type(e).__name__})") from None
    _check_shape(tree)
    return _eval(tree.body)


def calculate(expression: object) -> str:
    """`evaluate` as tool output: the result's text, or "error: <why>". Never raises."""
    try:
        return format_number(evaluate(expression))  # type: ignore[arg-type]
    except CalculatorError as e:
        return f"error: {e}"
    except (ArithmeticError, ValueError, TypeError, RecursionError, MemoryError) as e:
        # Bounds make these unreachable as far as we know; a tool answers, it never crashes.
        return f"error: {type(e).__name__}"


def format_number(value: Number) -> str:
    """Integers in full; floats with 12 significant digits, integral ones without ".0"."""
    if isinstance(value, int):
        return str(value)
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.12g}"


def _check_shape(tree: ast.AST) -> None:
    """Node count and depth, walked without recursion so a deep tree cannot overflow the stack."""
    count = 0
    stack = [(tree, 0)]
    while stack:
        node, depth = stack.pop()
        count += 1
        if count > MAX_NODES:
            raise CalculatorError(f"the expression has more than {MAX_NODES} parts")
        if depth > MAX_DEPTH:
            raise CalculatorError(f"the expression is nested deeper than {MAX_DEPTH}")
        stack.extend((child, depth + 1) for child in ast.iter_child_nodes(node))


def _eval(node: ast.AST) -> Number:
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise CalculatorError(f"only numbers are allowed, got {type(value).__name__}")
        return _checked(value)
    if isinstance(node, ast.Name):
        if node.id not in CONSTANTS:
            raise CalculatorError(f"unknown name {node.id[:40]!r}; known: {', '.join(CONSTANTS)}")
        return CONSTANTS[node.id]
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _SYMBOLS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            return _checked(_power(left, right))
        if isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod) and right == 0:
            raise CalculatorError("division by zero")
        try:
            return _checked(_BINARY[type(node.op)](left, right))
        except OverflowError:
            raise CalculatorError("the result is too large") from None
    if isinstance(node, ast.Call):
        return _call(node)
    raise CalculatorError(f"{_describe(node)} is not allowed")


def _call(node: ast.Call) -> Number:
    name = node.func.id if isinstance(node.func, ast.Name) else None
    if name not in FUNCTIONS:
        raise CalculatorError(
            f"only these functions can be called: {', '.join(FUNCTIONS)}"
            + (f" (not {name[:40]!r})" if name else "")
        )
    if node.keywords or any(isinstance(a, ast.Starred) for a in node.args):
        raise CalculatorError(f"{name} takes plain positional arguments")
    fn, fewest, most = FUNCTIONS[name]
    if not fewest <= len(node.args) <= most:
        raise CalculatorError(f"{name} takes {fewest} to {most} arguments, got {len(node.args)}")
    args = [_eval(a) for a in node.args]
    try:
        return _checked(fn(*args))
    except (OverflowError, ValueError) as e:
        if isinstance(e, CalculatorError):
            raise
        raise CalculatorError(f"{name} failed: {type(e).__name__}") from None


def _power(base: Number, exponent: Number) -> Number:
    """`base ** exponent`, refused before computing when the exponent or result is too big."""
    if abs(exponent) > MAX_EXPONENT:
        raise CalculatorError(f"exponents are limited to ±{MAX_EXPONENT}")
    if base == 0 and exponent < 0:
        raise CalculatorError("division by zero")
    if abs(base) > 1 and exponent > 0:
        if exponent * math.log10(abs(base)) > MAX_DIGITS:
            raise CalculatorError(f"the result would exceed 10**{MAX_DIGITS}")
    if isinstance(base, int) and isinstance(exponent, int) and exponent >= 0:
        return base**exponent
    try:
        return math.pow(base, exponent)  # a float; refuses complex results with ValueError
    except ValueError:
        raise CalculatorError("a negative number to a fractional power") from None
    except OverflowError:
        raise CalculatorError("the result is too large") from None


def _checked(value: Number) -> Number:
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("the result is not a finite number")
    if abs(value) > MAX_MAGNITUDE:
        raise CalculatorError(f"numbers are limited to 10**{MAX_DIGITS} in magnitude")
    return value


def _describe(node: ast.AST) -> str:
    if isinstance(node, ast.BinOp | ast.UnaryOp | ast.BoolOp):
        return f"the operator {type(node.op).__name__}"
    return type(node).__name__
