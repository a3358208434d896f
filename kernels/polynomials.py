"""The orthogonal polynomials of torch.special (Chebyshev T/U/V/W and their shifted forms, Hermite
H and He, Laguerre L, Legendre P) as Triton helpers and CUDA C device functions, computed as ATen
computes them (aten/src/ATen/native/Math.h): n < 0 gives 0, the edges x = +-1 their closed values,
large n inside (-1, 1) the trigonometric form, else the three-term recurrence from p = 1 and q = the
degree-1 value, n - 1 steps. Hermite's degree is capped as in ATen (past it: NaN): `limit`, the
cap of the input's dtype. gjit computes a float32 input in float64 and rounds each step's value to
float32 (`NARROW`): the value overflows where eager's does (inf, then NaN), with one rounding per
step instead of several, so the result is at least as close to the exact one as eager's.

Each polynomial is one `Poly` spec; its expressions are written once in a small common syntax
(`sel(c, a, b)`, `cos`, `sin`, `acos`, typed constants `zero`, `one`, `two`, `half`, the degree as
`nf`, its parity `even`, the step `jf` as a float) and printed for both languages. A Triton block
runs the recurrence for the block's largest degree, each lane stopping at its own.
"""

from __future__ import annotations

import dataclasses
import re


@dataclasses.dataclass(frozen=True)
class Poly:
    name: str  # the IR op
    start: str  # the degree-1 value q (p starts at 1)
    step: str  # the next value from q, p and the step jf (1, 2, ...)
    y: str = "x"  # the argument the recurrence runs on (x + x - 1 for a shifted Chebyshev)
    trig_above: int | None = None  # n above this and |y| < 1: the closed form `trig` of a = acos(y)
    trig: str = ""
    edges: tuple[tuple[str, str], ...] = ()  # (condition, value), checked in order before all else
    limit: bool = False  # Hermite: degrees past the cap (an argument) are NaN


_CHEBYSHEV_EDGES = {  # (value at y = 1, value at y = -1)
    "t": ("one", "sel(even, one, -one)"),
    "u": ("nf + one", "sel(even, nf + one, -(nf + one))"),
    "v": ("one", "sel(even, nf + nf + one, -(nf + nf + one))"),
    "w": ("nf + nf + one", "sel(even, one, -one)"),
}
_CHEBYSHEV_START = {"t": "y", "u": "y + y", "v": "y + y - one", "w": "y + y + one"}
_CHEBYSHEV_TRIG = {
    "t": "cos(nf * a)",
    "u": "sel(sin(a) != zero, sin((nf + one) * a) / sin(a), (nf + one) * cos((nf + one) * a) / y)",
    "v": "sel(sin(a / two) != one, cos((nf + half) * a) / cos(a / two), "
    "sel(even, nf + nf + one, -(nf + nf + one)))",
    "w": "sel(cos(a / two) != one, sin((nf + half) * a) / sin(a / two), "
    "sel(y > zero, nf + nf + one, sel(even, one, -one)))",
}
_SHIFTED_TRIG_ABOVE = {"t": 6, "u": 6, "v": 6, "w": 4}


def _chebyshev(kind: str, shifted: bool) -> Poly:
    pos, neg = _CHEBYSHEV_EDGES[kind]
    trig = _CHEBYSHEV_TRIG[kind]
    if shifted and kind == "w":  # ATen's shifted W falls back to the parity alone, not x's sign
        trig = "sel(cos(a / two) != one, sin((nf + half) * a) / sin(a / two), sel(even, one, -one))"
    # ATen tests |x| == 1 (then the sign), or, shifted, x == 1 and x == 0: the same points of y
    where = ("x == one", "x == zero") if shifted else ("y == one", "y == -one")
    return Poly(
        name=f"{'shifted_' if shifted else ''}chebyshev_{kind}",
        start=_CHEBYSHEV_START[kind],
        step="(y + y) * q - p",
        y="x + x - one" if shifted else "x",
        trig_above=_SHIFTED_TRIG_ABOVE[kind] if shifted else (6 if kind == "t" else 8),
        trig=trig,
        edges=((where[0], pos), (where[1], neg)),
    )


POLYNOMIALS = {
    p.name: p
    for p in [
        *(_chebyshev(kind, shifted) for shifted in (False, True) for kind in "tuvw"),
        Poly("hermite_h", start="x + x", step="(x + x) * q - (jf + jf) * p", limit=True),
        Poly("hermite_he", start="x", step="x * q - jf * p", limit=True),
        Poly(
            "laguerre_l",
            start="one - x",
            step="(((jf + jf) + (one - x)) * q - jf * p) / (jf + one)",
            edges=(("x == zero", "one"),),
        ),  # fmt: skip
        Poly(
            "legendre_p",
            start="x",
            step="((jf + jf + one) * x * q - jf * p) / (jf + one)",
            edges=(("y == one", "one"), ("y == -one", "sel(even, one, -one)")),
        ),  # fmt: skip
    ]
}


def _triton_expr(text: str) -> str:
    text = re.sub(r"\bsel\(", "tl.where(", text)
    text = re.sub(r"\bacos\(", "libdevice.acos(", text)
    return re.sub(r"\b(cos|sin)\(", r"tl.\1(", text)


def triton_polynomial(name: str) -> str:
    """The Triton helper `_<name>(x, n, limit, NARROW)`: x a float block, n an int block of its
    shape (lanes outside the kernel's mask hold 0), limit the dtype's Hermite cap (else unused);
    NARROW: each step's value is rounded to float32 (a float32 input computed in float64)."""
    p = POLYNOMIALS[name]
    t = _triton_expr
    lines = [
        "@triton.jit",
        f"def _{name}(x, n, limit, NARROW: tl.constexpr):",
        f"    # torch.special's {name} as ATen computes it (kernels/polynomials.py)",
        "    zero = tl.zeros(x.shape, x.dtype)",
        "    one = zero + 1.0",
        "    two = zero + 2.0",
        "    half = zero + 0.5",
        f"    y = {t(p.y)}",
        "    nf = n.to(x.dtype)",
        "    even = (n % 2) == 0",
        "    skip = n < 2",
    ]
    for cond, _ in p.edges:
        lines.append(f"    skip = skip | ({t(cond)})")
    if p.trig_above is not None:
        lines += [f"    trig = (n > {p.trig_above}) & (tl.abs(y) < one)", "    skip = skip | trig"]
    if p.limit:
        lines.append("    skip = skip | (n > limit)")
    lines += [
        "    steps = tl.where(skip, 0, n - 1)",
        "    p = one",
        f"    q = {t(p.start)}",
        "    j = 1",
        "    live = (j <= steps) & (q == q)",
        "    while tl.max(tl.where(live, 1, 0)) > 0:  # as ATen, a lane stops at its degree or at NaN",
        "        jf = zero + j",
        f"        r = {t(p.step)}",
        "        if NARROW:",
        "            r = r.to(tl.float32).to(tl.float64)",
        "        p = tl.where(live, q, p)",
        "        q = tl.where(live, r, q)",
        "        j += 1",
        "        live = live & (j <= steps) & (q == q)",
        "    out = tl.where(n == 0, one, q)",
    ]
    if p.trig_above is not None:  # in float32 when NARROW, as eager computes it
        lines += [
            "    if NARROW:",
            f"        closed = _{name}_trig(y.to(tl.float32), n).to(tl.float64)",
            "    else:",
            f"        closed = _{name}_trig(y, n)",
            "    out = tl.where(trig, closed, out)",
        ]
    if p.limit:
        lines.append("    out = tl.where(n > limit, float('nan'), out)")
    for cond, value in reversed(p.edges):  # the first edge ATen checks wins
        lines.append(f"    out = tl.where({t(cond)}, {t(value)}, out)")
    lines.append("    return tl.where(n < 0, zero, out)")
    text = "\n".join(lines) + "\n"
    if p.trig_above is None:
        return text
    trig = [
        "@triton.jit",
        f"def _{name}_trig(y, n):",
        "    zero = tl.zeros(y.shape, y.dtype)",
        "    one = zero + 1.0",
        "    two = zero + 2.0",
        "    half = zero + 0.5",
        "    nf = n.to(y.dtype)",
        "    even = (n % 2) == 0",
        "    a = libdevice.acos(y)",
        f"    return {t(p.trig)}",
    ]
    return "\n".join(trig) + "\n\n" + text


def _c_expr(text: str) -> str:
    text = re.sub(r"\bsel\(", "gjit_sel(", text)
    return re.sub(r"\b(cos|sin|acos)\(", r"gjit_poly_\1(", text)


def _cuda_polynomial(p: Poly) -> str:
    c = _c_expr
    lines = [
        "template <typename T>",
        f"__device__ __forceinline__ T gjit_{p.name}(T x, long long n, long long limit, bool narrow) {{",
        "    const T zero = T(0), one = T(1), two = T(2), half = T(0.5);",
        f"    const T y = {c(p.y)};",
        "    const T nf = T(n);",
        "    const bool even = n % 2 == 0;",
        "    (void)two; (void)half; (void)nf; (void)even; (void)y; (void)limit;",
        "    if (n < 0) return zero;",
    ]
    for cond, value in p.edges:
        lines.append(f"    if ({c(cond)}) return {c(value)};")
    if p.trig_above is not None:  # in float32 when narrow, as eager computes it
        lines += [
            f"    if (n > {p.trig_above} && gjit_poly_fabs(y) < one)",
            f"        return narrow ? T(gjit_{p.name}_trig(float(y), n)) : gjit_{p.name}_trig(y, n);",
        ]
    lines.append("    if (n == 0) return one;")
    if p.limit:
        lines.append("    if (n > limit) return zero / zero;")
    lines += [
        f"    T p = one, q = {c(p.start)};",
        "    for (long long j = 1; j < n && q == q; j++) {  // as ATen: stops at NaN",
        "        const T jf = T(j);",
        f"        T r = {c(p.step)};",
        "        if (narrow) r = T(float(r));",
        "        p = q;",
        "        q = r;",
        "    }",
        "    return q;",
        "}",
    ]
    text = "\n".join(lines)
    if p.trig_above is None:
        return text
    trig = [
        "template <typename T>",
        f"__device__ __forceinline__ T gjit_{p.name}_trig(T y, long long n) {{",
        "    const T zero = T(0), one = T(1), two = T(2), half = T(0.5);",
        "    const T nf = T(n);",
        "    const bool even = n % 2 == 0;",
        "    (void)zero; (void)one; (void)two; (void)half; (void)even;",
        "    const T a = gjit_poly_acos(y);",
        f"    return {c(p.trig)};",
        "}",
    ]
    return "\n".join(trig) + "\n" + text


def cuda_polynomials() -> str:
    """The device functions gjit_<name>(x, n, limit, narrow) for the CUDA C prelude."""
    math = []
    for fn in ("cos", "sin", "acos", "fabs"):
        math += [
            f"__device__ __forceinline__ float gjit_poly_{fn}(float a) {{ return {fn}f(a); }}",
            f"__device__ __forceinline__ double gjit_poly_{fn}(double a) {{ return {fn}(a); }}",
        ]
    sel = [
        "template <typename T>",
        "__device__ __forceinline__ T gjit_sel(bool c, T a, T b) { return c ? a : b; }",
    ]
    body = [_cuda_polynomial(p) for p in POLYNOMIALS.values()]
    head = ["// torch.special's orthogonal polynomials (kernels/polynomials.py)", *math, *sel]
    return "\n".join(head) + "\n\n" + "\n\n".join(body) + "\n"
