"""Modified Bessel functions libdevice lacks, scaled and not (i0e, i1e, K0, K1, K0e, K1e), and the
spherical Bessel function j0, in float64 as Triton helpers and CUDA C device functions.

Each is a Chebyshev series of a smooth function on an interval, evaluated by Clenshaw's
recurrence, with the singular or growing part written out:
- I0e, I1e on |x| <= 8: e^-x I(x) on [0, 8]; beyond: sqrt(x) e^-x I(x) as a series in 8/x;
- K0, K1 on (0, 2]: K0 + log(x/2) I0 and x (K1 - log(x/2) I1) (both entire in x) on [0, 2];
  beyond: sqrt(x) e^x K(x) as a series in 2/x; the unscaled and scaled forms differ by e^x;
- j0 = sin(x) / x (1 at 0, 0 at +-inf).
Special values as eager: K of 0 is inf and of a negative number NaN, i0e/i1e/K of inf 0.

The coefficients are computed here, not copied: Chebyshev interpolation of each function at
48 nodes with mpmath at 40 digits, terms below 2^-60 of the largest dropped (about 15-30 terms a
series), printed to 17 significant digits (they agree with Cephes' tables). mpmath takes a few
seconds for them all: they are computed when a kernel first uses one of these functions and kept in
the cache folder.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os

from gjit.config import config

NODES = 48

# series name -> (interval of the series variable s, the function of s in mpmath's names)
_SERIES = {
    "i0_small": (0.0, 8.0, "exp(-s) * besseli(0, s)"),
    "i0_large": (0.0, 1.0, "sqrt(8 / s) * exp(-8 / s) * besseli(0, 8 / s)"),
    "i1_small": (0.0, 8.0, "exp(-s) * besseli(1, s) / s"),  # I1(x) / x: no cancellation near 0
    "i1_large": (0.0, 1.0, "sqrt(8 / s) * exp(-8 / s) * besseli(1, 8 / s)"),
    "k0_small": (0.0, 2.0, "besselk(0, s) + log(s / 2) * besseli(0, s)"),
    "k0_large": (0.0, 1.0, "sqrt(2 / s) * exp(2 / s) * besselk(0, 2 / s)"),
    "k1_small": (0.0, 2.0, "s * (besselk(1, s) - log(s / 2) * besseli(1, s))"),
    "k1_large": (0.0, 1.0, "sqrt(2 / s) * exp(2 / s) * besselk(1, 2 / s)"),
}


@functools.cache
def coefficients(name: str) -> list[str]:
    """c_0 .. c_n of the series: f(s) = c_0 / 2 + sum_j c_j T_j(t), t = (2 s - a - b) / (b - a);
    kept in the cache folder once computed (mpmath takes a few seconds for all of them)."""
    a, b, expr = _SERIES[name]
    key = hashlib.sha256(f"{a} {b} {expr} {NODES}".encode()).hexdigest()[:16]
    path = os.path.join(config.cache_dir, "bessel", f"{name}-{key}.json")
    try:
        with open(path) as f:
            return [repr(float(c)) for c in json.load(f)]  # numbers, or computed again
    except (OSError, ValueError, TypeError):
        pass
    out = _compute(name)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(out, f)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache folder: computed again next time
    return out


def _compute(name: str) -> list[str]:
    import mpmath

    a, b, expr = _SERIES[name]
    names = {n: getattr(mpmath, n) for n in ("exp", "log", "sqrt", "besseli", "besselk")}
    with mpmath.workdps(40):
        angles = [mpmath.pi * (k + mpmath.mpf(1) / 2) / NODES for k in range(NODES)]
        nodes = [(a + b) / 2 + (b - a) / 2 * mpmath.cos(u) for u in angles]
        values = [eval(expr, {"__builtins__": {}}, {**names, "s": x}) for x in nodes]  # noqa: S307 - our table
        cs = [
            2 * mpmath.fsum(v * mpmath.cos(j * u) for v, u in zip(values, angles)) / NODES
            for j in range(NODES)
        ]
        top = max(abs(c) for c in cs)
        while len(cs) > 1 and abs(cs[-1]) < top * mpmath.mpf(2) ** -60:
            cs.pop()
        return [repr(float(c)) for c in cs]


def _clenshaw(name: str, s: str, indent: str, c: bool = False) -> list[str]:
    """Lines computing `{name}_v`, the series at `s` (its variable clamped to the interval: the
    other branch's lanes evaluate it too), in Triton or (`c`) C."""
    a, b, _ = _SERIES[name]
    cs = coefficients(name)
    t = f"{name}_t"
    scaled = f"(2.0 * ({s}) - {a + b!r}) / {b - a!r}"
    clamp = f"fmin(fmax({scaled}, -1.0), 1.0)" if c else f"tl.minimum(tl.maximum({scaled}, -1.0), 1.0)"
    let, end = ("double ", ";") if c else ("", "")
    lines = [f"{let}{t} = {clamp}", f"{let}{name}_b1 = {cs[-1]}", f"{let}{name}_b2 = 0.0 * {t}"]
    for k, coefficient in enumerate(reversed(cs[1:-1])):
        lines.append(f"{let if k == 0 else ''}{name}_b0 = 2.0 * {t} * {name}_b1 - {name}_b2 + {coefficient}")
        lines += [f"{name}_b2 = {name}_b1", f"{name}_b1 = {name}_b0"]
    lines.append(f"{let}{name}_v = {t} * {name}_b1 - {name}_b2 + 0.5 * {cs[0]}")
    return [f"{indent}{ln}{end}" for ln in lines]


# op -> (series used, the result from them: Python/Triton syntax over x, a = |x| and the
# series values; `exp`, `log`, `sqrt`, `where(c, a, b)`)
BESSEL = {
    "bessel_i0e": (
        ("i0_small", "i0_large"),
        "where(a <= 8.0, i0_small_v, i0_large_v / sqrt(a))",
    ),
    "bessel_i1e": (
        ("i1_small", "i1_large"),
        "where(x < 0.0, -1.0, 1.0) * where(a <= 8.0, a * i1_small_v, i1_large_v / sqrt(a))",
    ),
    "bessel_k0": (
        ("i0_small", "k0_small", "k0_large"),
        "where(x <= 2.0, k0_small_v - log(0.5 * x) * i0_small_v * exp(x), k0_large_v * exp(-x) / sqrt(x))",
    ),
    "bessel_k0e": (
        ("i0_small", "k0_small", "k0_large"),
        "where(x <= 2.0, exp(x) * k0_small_v - log(0.5 * x) * i0_small_v * exp(2.0 * x), "
        "k0_large_v / sqrt(x))",
    ),
    "bessel_k1": (
        ("i1_small", "k1_small", "k1_large"),
        "where(x <= 2.0, k1_small_v / x + log(0.5 * x) * x * i1_small_v * exp(x), "
        "k1_large_v * exp(-x) / sqrt(x))",
    ),
    "bessel_k1e": (
        ("i1_small", "k1_small", "k1_large"),
        "where(x <= 2.0, exp(x) * k1_small_v / x + log(0.5 * x) * x * i1_small_v * exp(2.0 * x), "
        "k1_large_v / sqrt(x))",
    ),
}
# where each series is evaluated: its variable from x (|x| for I, x for K, 8/|x| and 2/x beyond)
_ARGUMENT = {
    "i0_small": "a",
    "i1_small": "a",
    "i0_large": "8.0 / a",
    "i1_large": "8.0 / a",
    "k0_small": "x",
    "k1_small": "x",
    "k0_large": "2.0 / x",
    "k1_large": "2.0 / x",
}
_K = ("bessel_k0", "bessel_k0e", "bessel_k1", "bessel_k1e")


def triton_bessel(name: str) -> str:
    """The Triton helper `_<name>(x)`, x a float64 block."""
    series, result = BESSEL[name]
    lines = [
        "@triton.jit",
        f"def _{name}(x):",
        "    # float64 Chebyshev series (kernels/bessel.py)",
        "    a = tl.abs(x)",
    ]
    for s in series:
        lines += _clenshaw(s, _ARGUMENT[s], "    ")
    text = result.replace("where(", "tl.where(").replace("exp(", "tl.exp(").replace("log(", "tl.log(")
    lines.append(f"    out = {text.replace('sqrt(', 'tl.sqrt(')}")
    if name in _K:  # eager: K of 0 is inf, of a negative number NaN, of inf 0
        lines += [
            "    out = tl.where(x == 0.0, float('inf'), out)",
            "    out = tl.where(x < 0.0, float('nan'), out)",
            "    out = tl.where(x == float('inf'), 0.0, out)",
        ]
    else:  # e^-|x| I(x) at +-inf: 0, signed as x for the odd i1e
        zero = "tl.where(x < 0.0, -0.0, 0.0)" if name == "bessel_i1e" else "0.0"
        lines.append(f"    out = tl.where(a == float('inf'), {zero}, out)")
    lines.append("    return out")
    return "\n".join(lines) + "\n"


TRITON_SPHERICAL_J0 = """@triton.jit
def _spherical_j0(x):
    # float64 sin(x) / x: 1 at 0, 0 at +-inf (kernels/bessel.py)
    out = tl.where(x == 0.0, 1.0, tl.sin(x) / x)
    return tl.where(tl.abs(x) == float('inf'), 0.0, out)
"""


CUDA_NAMES = ("gjit_bessel_", "gjit_spherical_j0")  # a kernel that calls one gets cuda_bessel()


@functools.cache
def cuda_bessel() -> str:
    """gjit_<name>(double) device functions, put before the kernels that call them (not in the
    prelude every kernel has: the coefficients are computed on first use)."""
    out = ["// modified Bessel functions and j0 in double (kernels/bessel.py)", "#ifndef GJIT_BESSEL"]
    out.append("#define GJIT_BESSEL")
    for name, (series, result) in BESSEL.items():
        body = ["    const double a = fabs(x);"]
        for s in series:
            body += _clenshaw(s, _ARGUMENT[s], "    ", c=True)
        body.append(f"    double out = {_c_where(result)};")
        if name in _K:
            body += [
                "    if (x == 0.0) return GJIT_INF;",
                "    if (x < 0.0) return GJIT_NAN;",
                "    if (x == GJIT_INF) return 0.0;",
            ]
        else:
            body.append(
                f"    if (a == GJIT_INF) return {'x < 0.0 ? -0.0 : 0.0' if name == 'bessel_i1e' else '0.0'};"
            )
        body.append("    return out;")
        out += [f"__device__ __forceinline__ double gjit_{name}(double x) {{", *body, "}"]
    out += [
        "__device__ __forceinline__ double gjit_spherical_j0(double x) {",
        "    if (fabs(x) == GJIT_INF) return 0.0;",
        "    return x == 0.0 ? 1.0 : sin(x) / x;",
        "}",
        "#endif",
    ]
    return "\n".join(out) + "\n"


def _c_where(text: str) -> str:
    """where(c, a, b) -> (c ? a : b), innermost first (the expressions nest at most twice)."""
    import re

    pattern = re.compile(r"where\(([^(),]*(?:\([^()]*\)[^(),]*)*),([^(),]*(?:\([^()]*\)[^(),]*)*),"
                         r"([^(),]*(?:\([^()]*\)[^(),]*)*)\)")  # fmt: skip
    while "where(" in text:
        new = pattern.sub(
            lambda m: f"(({m.group(1).strip()}) ? ({m.group(2).strip()}) : ({m.group(3).strip()}))", text
        )
        if new == text:
            raise ValueError(f"cannot print {text!r} as C")
        text = new
    return text
