"""sympy -> source text, for Triton kernels and for Python wrappers.

Index expressions in kernels are non-negative, so floor division and modulo print as the
language's integer `//` and `%` (C truncation in Triton agrees with floor there).
"""

from __future__ import annotations

import ast

import sympy
from torch.utils._sympy import printers as torch_printers
from torch.utils._sympy.functions import (
    CeilDiv,
    CeilToInt,
    CleanDiv,
    FloatTrueDiv,
    FloorDiv,
    FloorToInt,
    IntTrueDiv,
    Max,
    Min,
    Mod,
    ModularIndexing,
    PythonMod,
    ToFloat,
    TruncToInt,
)


class ExprPrinter:
    """Prints integer index expressions; subclasses choose min/max and boolean spelling."""

    min_fn = "min"
    max_fn = "max"
    and_op = " and "
    or_op = " or "
    not_op = "not "

    def __init__(self, names: dict[sympy.Symbol, str] | None = None):
        self.names = names or {}

    def __call__(self, expr) -> str:
        return self.doprint(sympy.sympify(expr))

    def paren(self, expr: sympy.Basic) -> str:
        text = self.doprint(expr)
        if isinstance(expr, (sympy.Symbol, sympy.Integer)) and not (
            isinstance(expr, sympy.Integer) and expr < 0
        ):
            return text
        return f"({text})"

    def doprint(self, expr: sympy.Basic) -> str:
        if isinstance(expr, sympy.Symbol):
            return self.names.get(expr, expr.name)
        if isinstance(expr, sympy.Integer):
            return str(int(expr))
        if expr is sympy.true:
            return "True"
        if expr is sympy.false:
            return "False"
        if isinstance(expr, sympy.Rational) and not isinstance(expr, sympy.Integer):
            raise ValueError(f"non-integer index expression {expr}")
        if isinstance(expr, sympy.Add):
            return self.print_add(expr)
        if isinstance(expr, sympy.Mul):
            return self.print_mul(expr)
        if isinstance(expr, sympy.Pow):
            base, exp = expr.args
            if exp.is_Integer and exp > 0:
                return " * ".join([self.paren(base)] * int(exp))
            raise ValueError(f"cannot print power {expr} in an index")
        if isinstance(expr, (FloorDiv, IntTrueDiv, CleanDiv)):
            return f"{self.paren(expr.args[0])} // {self.paren(expr.args[1])}"
        if isinstance(expr, CeilDiv):
            a, b = map(self.paren, expr.args)
            return f"({a} + {b} - 1) // {b}"
        if isinstance(expr, (CeilToInt, FloorToInt)) and isinstance(expr.args[0], IntTrueDiv):
            # ceil/floor of an int over an int (math.ceil(n / 3) on a size): exact integer math;
            # a divisor that is not a positive literal is left to the subclass (or refused)
            a, b = expr.args[0].args
            if b.is_Integer and b > 0:
                a, b = self.paren(a), self.paren(b)
                return f"({a} + {b} - 1) // {b}" if isinstance(expr, CeilToInt) else f"{a} // {b}"
        if isinstance(expr, ModularIndexing):
            base, div, mod = expr.args
            inner = self.paren(base) if div == 1 else f"({self.paren(base)} // {self.paren(div)})"
            return f"{inner} % {self.paren(mod)}"
        if isinstance(expr, (sympy.Mod, Mod, PythonMod)):
            return f"{self.paren(expr.args[0])} % {self.paren(expr.args[1])}"
        if isinstance(expr, (Min, sympy.Min)):
            return self.fold(self.min_fn, expr.args)
        if isinstance(expr, (Max, sympy.Max)):
            return self.fold(self.max_fn, expr.args)
        if isinstance(expr, sympy.floor) and isinstance(expr.args[0], sympy.Mul):
            num, den = sympy.fraction(expr.args[0])
            return f"{self.paren(num)} // {self.paren(den)}"
        if isinstance(expr, (sympy.floor, sympy.ceiling)) and isinstance(expr.args[0], sympy.Add):
            # floor(15/16 + n/16), sympy's form of a ceiling division: over one integer denominator
            num, den = sympy.fraction(sympy.together(expr.args[0]))
            if den.is_Integer and den > 0 and num.is_integer:
                num, den = self.paren(num), self.paren(den)
                return f"{num} // {den}" if isinstance(expr, sympy.floor) else f"({num} + {den} - 1) // {den}"
        if isinstance(expr, sympy.core.relational.Relational):
            return f"{self.paren(expr.lhs)} {expr.rel_op} {self.paren(expr.rhs)}"
        if isinstance(expr, sympy.And):
            return self.and_op.join(f"({self.doprint(a)})" for a in expr.args)
        if isinstance(expr, sympy.Or):
            return self.or_op.join(f"({self.doprint(a)})" for a in expr.args)
        if isinstance(expr, sympy.Not):
            return f"{self.not_op}({self.doprint(expr.args[0])})"
        raise ValueError(f"cannot print {type(expr).__name__} {expr}")

    def fold(self, fn: str, args) -> str:
        text = self.doprint(args[0])
        for a in args[1:]:
            text = f"{fn}({text}, {self.doprint(a)})"
        return text

    def print_add(self, expr: sympy.Add) -> str:
        terms = sorted(expr.args, key=lambda t: (t.is_number, sympy.default_sort_key(t)))
        text = self.doprint(terms[0])
        for t in terms[1:]:
            coeff, rest = t.as_coeff_Mul()
            if coeff < 0:
                text += f" - {self.doprint(-t)}"
            else:
                text += f" + {self.doprint(t)}"
        return text

    def print_mul(self, expr: sympy.Mul) -> str:
        coeff, rest = expr.as_coeff_Mul()
        if coeff == -1:
            return f"-{self.paren(rest)}"
        factors = [self.paren(a) for a in expr.args]
        return " * ".join(factors)


class PythonPrinter(ExprPrinter):
    """For generated Python wrappers and guards, where sizes may also meet floats: a SymFloat
    argument of an extern (e.g. the scale an upsampling decomposition computes). Whatever the
    index printer does not know (the rest of torch's size functions: CeilToInt of a float,
    RoundToInt, RoundDecimal, FloatPow, OpaqueUnaryFn_sqrt, Where, bitwise functions, ...) is
    printed by torch's own PythonPrinter, as Inductor prints its wrappers (`math.*` calls: the
    wrapper and the guards import math)."""

    def doprint(self, expr: sympy.Basic) -> str:
        if isinstance(expr, sympy.Float):
            return repr(float(expr))
        if isinstance(expr, ToFloat):
            return f"float({self.doprint(expr.args[0])})"
        if isinstance(expr, TruncToInt):
            return f"int({self.doprint(expr.args[0])})"
        if isinstance(expr, (FloatTrueDiv, IntTrueDiv)):
            return f"{self.paren(expr.args[0])} / {self.paren(expr.args[1])}"
        if isinstance(expr, (CeilToInt, FloorToInt)) and isinstance(expr.args[0], IntTrueDiv):
            a, b = map(self.paren, expr.args[0].args)  # Python's // floors for any signs: exact
            return f"-(-{a} // {b})" if isinstance(expr, CeilToInt) else f"{a} // {b}"
        try:
            return super().doprint(expr)
        except ValueError:
            return self.torch_print(expr)

    def torch_print(self, expr: sympy.Basic) -> str:
        renamed = {
            s: sympy.Symbol(self.names[s], **s.assumptions0) for s in expr.free_symbols if s in self.names
        }
        try:
            text = _TORCH_PYTHON.doprint(expr.xreplace(renamed))
        except Exception as e:  # noqa: BLE001 - any failure of torch's printer is "cannot print"
            raise ValueError(f"cannot print {type(expr).__name__} {expr}: {e}") from e
        symbols = {s.name for s in expr.xreplace(renamed).free_symbols}
        unknown = (
            {n.id for n in ast.walk(ast.parse(text, mode="eval")) if isinstance(n, ast.Name)}
            - symbols
            - _PYTHON_NAMES
        )
        if unknown:  # torch printed a function as its sympy name (Where(...)): not Python
            raise ValueError(f"cannot print {type(expr).__name__} {expr}: {sorted(unknown)} undefined")
        return f"({text})"


class TritonPrinter(ExprPrinter):
    """For index math inside @triton.jit kernels."""

    min_fn = "tl.minimum"
    max_fn = "tl.maximum"
    and_op = " & "
    or_op = " | "
    not_op = "~"


_TORCH_PYTHON = torch_printers.PythonPrinter()
# what torch's printer may call: the wrapper's and the guards' globals have math and torch
_PYTHON_NAMES = {"math", "torch", "abs", "round", "int", "float", "min", "max", "True", "False"}


def pyexpr(expr, names: dict[sympy.Symbol, str] | None = None) -> str:
    return PythonPrinter(names)(expr)
