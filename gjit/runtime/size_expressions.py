"""Size expressions of a stored program, checked before sympy reads them.

torch's deserializer builds size expressions with `sympy.sympify`, which evaluates its text. A
stored program (a disk cache entry, a package) is refused unless every such text parses as a tree
of calls to sympy's and torch's size classes over literals: a symbol only by its name, a float
only by its digits, no sympify (`S`), no attribute, no other name.
"""

from __future__ import annotations

import ast
import functools
import re
from typing import Any

import sympy
import torch.utils._sympy.functions as torch_sympy


class ExpressionError(Exception):
    """A stored size expression that is not a plain sympy expression."""


@functools.cache
def allowed_names() -> frozenset[str]:
    """Functions a serialized size expression may call: sympy's and torch's size classes (what
    `sympy.srepr` writes for the expressions a shape environment makes), no sympify (`S`)."""
    names = set()
    for module in (sympy, torch_sympy):
        for name, obj in vars(module).items():
            if isinstance(obj, type) and issubclass(obj, sympy.Basic):
                names.add(name)
    return frozenset(names)


_LITERALS = frozenset({"oo", "zoo", "nan", "true", "false"})
_SYMBOL = re.compile(r"[a-z][a-z0-9_]*")
_FLOAT = re.compile(r"-?[0-9.]+(e[-+]?[0-9]+)?")


def check_expressions(tree: Any) -> None:
    """Refuse a stored graph whose size expressions are anything but such calls."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "expr_str":
                    _check_expression(value)
                else:
                    stack.append(value)
        elif isinstance(node, list):
            stack.extend(node)


def _check_expression(text: Any) -> None:
    if not isinstance(text, str):
        raise ExpressionError(f"a size expression is not text: {text!r}")
    try:
        parsed = ast.parse(text, mode="eval").body
    except SyntaxError as e:
        raise ExpressionError(f"a size expression does not parse: {text[:120]!r}") from e
    if not _is_expression(parsed):
        raise ExpressionError(f"a size expression is not a sympy expression: {text[:120]!r}")


def _is_expression(node: ast.AST) -> bool:
    """A call of an allowed class over expressions and numbers; a name only as the string argument
    of Symbol (matching a size symbol's name) and a float only as Float's string."""
    if isinstance(node, ast.Constant):
        return type(node.value) in (int, float)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return _is_expression(node.operand)
    if isinstance(node, ast.Name):
        return node.id in _LITERALS
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
        return False
    if not all(
        isinstance(k.value, ast.Constant) and type(k.value.value) in (bool, int) for k in node.keywords
    ):
        return False
    name, args = node.func.id, node.args
    if name in ("Symbol", "Float"):
        pattern = _SYMBOL if name == "Symbol" else _FLOAT
        return (
            len(args) == 1
            and isinstance(args[0], ast.Constant)
            and isinstance(args[0].value, str)
            and pattern.fullmatch(args[0].value) is not None
        ) or (name == "Float" and len(args) == 1 and _is_expression(args[0]))
    return name in allowed_names() and all(_is_expression(a) for a in args)
