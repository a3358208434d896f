"""Digamma, trigamma and the Hurwitz zeta function (polygamma of order n >= 2 is a multiple of
zeta) in float64, as Triton helpers and CUDA C device functions: libdevice has none of them.

Both follow the textbook method eager uses (Cephes'), with eager's special values:
- digamma(x): reflection psi(x) = psi(1 - x) - pi / tan(pi x) below 0, the recurrence
  psi(x) = psi(x + 1) - 1/x up to x >= 10, then the asymptotic series
  log x - 1/(2x) - sum_k B_2k / (2k x^2k). +-0 gives -+inf, negative integers NaN.
- trigamma(x): reflection psi1(x) = pi^2 / sin^2(pi x) - psi1(1 - x) below 1/2 (so, as in
  eager, a negative integer gives pi^2 / sin^2 of it: huge, not inf), the recurrence
  psi1(x) = psi1(x + 1) + 1/x^2 up to 10, then (1 + 1/(2x) + sum_k B_2k / x^2k) / x.
- zeta(x, q) = sum_k (q + k)^-x: the terms until q + k > 9 (at least nine), then the
  Euler-Maclaurin tail b w / (x - 1) - b / 2 + sum_j b (x)_(2j-1) / ((2j)! / B_2j) / w^(2j-1)
  with b the last term and w = q + k; it stops early once a term no longer changes the sum.
  x == 1 gives inf, x < 1 NaN; q a non-positive integer inf, q < 0 with x not an integer NaN.
  Below q = -2^20 (where eager loops a million times, and forever once q + 1 == q) the result
  is NaN: a kernel must not hang.

The series' coefficients come from sympy's Bernoulli numbers, printed to 17 significant digits.
"""

from __future__ import annotations

import sympy

EPS = "1.1102230246251565e-16"  # 2^-53: a term below EPS * sum no longer changes it
PI = "3.141592653589793"


def _number(value: sympy.Rational) -> str:
    return repr(float(value))


def _digamma_series() -> list[str]:
    """B_2k / (2k) for k = 1..7, the coefficients of z = 1/x^2 in the asymptotic series."""
    return [_number(sympy.bernoulli(2 * k) / (2 * k)) for k in range(1, 8)]


def _trigamma_series() -> list[str]:
    """B_2k for k = 1..7, the coefficients of z = 1/x^2 in trigamma's asymptotic series."""
    return [_number(sympy.bernoulli(2 * k)) for k in range(1, 8)]


def _zeta_divisors() -> list[str]:
    """(2j)! / B_2j for j = 1..12, the Euler-Maclaurin terms' divisors."""
    return [_number(sympy.factorial(2 * j) / sympy.bernoulli(2 * j)) for j in range(1, 13)]


def _horner(z: str, coefficients: list[str]) -> str:
    text = coefficients[-1]
    for c in reversed(coefficients[:-1]):
        text = f"{c} + {z} * ({text})"
    return text


def triton_digamma() -> str:
    series = _horner("z", _digamma_series())
    return f"""@triton.jit
def _digamma(x):
    # float64; reflection below 0, recurrence up to 10, asymptotic series (kernels/special_math.py)
    whole = libdevice.trunc(x)
    reflect = x < 0.0
    y = tl.where(reflect, 1.0 - x, x)
    total = tl.where(reflect, -{PI} / libdevice.tan({PI} * (x - whole)), 0.0)
    for _ in tl.static_range(10):
        small = y < 10.0
        total = tl.where(small, total - 1.0 / y, total)
        y = tl.where(small, y + 1.0, y)
    z = 1.0 / (y * y)
    total = total + tl.log(y) - 0.5 / y - z * ({series})
    total = tl.where(x == 0.0, tl.where(libdevice.signbit(x) != 0, float("inf"), float("-inf")), total)
    return tl.where(reflect & (x == whole), float("nan"), total)
"""


def triton_trigamma() -> str:
    series = _horner("z", _trigamma_series())
    return f"""@triton.jit
def _trigamma(x):
    # float64; reflection below 1/2, recurrence up to 10, asymptotic series (kernels/special_math.py)
    reflect = x < 0.5
    sin_pi_x = tl.sin({PI} * x)
    total = tl.where(reflect, -({PI} * {PI}) / (sin_pi_x * sin_pi_x), 0.0)
    y = tl.where(reflect, 1.0 - x, x)
    for _ in tl.static_range(10):
        small = y < 10.0
        total = tl.where(small, total + 1.0 / (y * y), total)
        y = tl.where(small, y + 1.0, y)
    z = 1.0 / (y * y)
    total = total + (1.0 + 0.5 / y + z * ({series})) / y
    return tl.where(reflect, -total, total)
"""


def triton_zeta() -> str:
    lines = [
        "@triton.jit",
        "def _zeta(x, q):",
        "    # float64 Hurwitz zeta: terms up to q + k > 9, then Euler-Maclaurin (kernels/special_math.py)",
        "    s = libdevice.pow(q, -x)",
        "    a = q + tl.full(s.shape, 0.0, tl.float64)",
        "    b = tl.full(s.shape, 0.0, tl.float64)",
        "    whole_q = (q <= 0.0) & (q == tl.floor(q))",
        "    undefined = (q < -1048576.0) | ((q < 0.0) & (x != tl.floor(x)))",
        "    done = (x <= 1.0) | whole_q | undefined",
        "    steps = 0",
        "    while tl.max(tl.where((done == 0) & ((a <= 9.0) | (steps < 9)), 1, 0)) > 0:",
        "        live = (done == 0) & ((a <= 9.0) | (steps < 9))",
        "        a = tl.where(live, a + 1.0, a)",
        "        b = tl.where(live, libdevice.pow(a, -x), b)",
        "        s = tl.where(live, s + b, s)",
        f"        done = done | (live & (-{EPS} * s < b) & (b < {EPS} * s))",
        "        steps += 1",
        "    w = a",
        "    s = tl.where(done, s, s + b * w / (x - 1.0) - 0.5 * b)",
        "    fac = 1.0 + tl.full(s.shape, 0.0, tl.float64)",
        "    k = 0.0",
    ]
    for divisor in _zeta_divisors():
        lines += [
            "    fac = fac * (x + k)",
            "    b = b / w",
            f"    t = fac * b / {divisor}",
            "    s = tl.where(done, s, s + t)",
            f"    done = done | (tl.abs(t / s) < {EPS})",
            "    fac = fac * (x + k + 1.0)",
            "    b = b / w",
            "    k = k + 2.0",
        ]
    lines += [
        "    s = tl.where(undefined, float('nan'), s)",
        "    s = tl.where(whole_q, float('inf'), s)",
        "    s = tl.where(x < 1.0, float('nan'), s)",
        "    return tl.where(x == 1.0, float('inf'), s)",
    ]
    return "\n".join(lines) + "\n"


def cuda_special() -> str:
    """gjit_digamma, gjit_trigamma and gjit_zeta for the CUDA C prelude (double)."""
    series = _horner("z", _digamma_series())
    trigamma = _horner("z", _trigamma_series())
    # the Euler-Maclaurin terms unrolled (an array of divisors would live in local memory)
    tail = ""
    for j, divisor in enumerate(_zeta_divisors()):
        tail += f"    fac *= x + {2 * j}.0;\n    b /= w;\n    t = fac * b / {divisor};\n    s += t;\n"
        tail += f"    if (fabs(t / s) < {EPS}) return s;\n    fac *= x + {2 * j + 1}.0;\n    b /= w;\n"
    return f"""// digamma and Hurwitz zeta in double (kernels/special_math.py)
__device__ __forceinline__ double gjit_digamma(double x) {{
    if (x == 0.0) return signbit(x) ? GJIT_INF : -GJIT_INF;
    const double whole = trunc(x);
    if (x < 0.0 && x == whole) return GJIT_NAN;
    double total = 0.0, y = x;
    if (x < 0.0) {{
        total = -{PI} / tan({PI} * (x - whole));
        y = 1.0 - x;
    }}
    while (y < 10.0) {{
        total -= 1.0 / y;
        y += 1.0;
    }}
    const double z = 1.0 / (y * y);
    return total + log(y) - 0.5 / y - z * ({series});
}}
__device__ __forceinline__ double gjit_trigamma(double x) {{
    const bool reflect = x < 0.5;
    double total = 0.0, y = x;
    if (reflect) {{
        const double sin_pi_x = sin({PI} * x);
        total = -({PI} * {PI}) / (sin_pi_x * sin_pi_x);
        y = 1.0 - x;
    }}
    while (y < 10.0) {{
        total += 1.0 / (y * y);
        y += 1.0;
    }}
    const double z = 1.0 / (y * y);
    total += (1.0 + 0.5 / y + z * ({trigamma})) / y;
    return reflect ? -total : total;
}}
__device__ __forceinline__ double gjit_zeta(double x, double q) {{
    if (x == 1.0) return GJIT_INF;
    if (x < 1.0) return GJIT_NAN;
    if (q <= 0.0 && q == floor(q)) return GJIT_INF;
    if ((q < 0.0 && x != floor(x)) || q < -1048576.0) return GJIT_NAN;
    double s = pow(q, -x), a = q, b = 0.0;
    for (int steps = 0; steps < 9 || a <= 9.0; ++steps) {{
        a += 1.0;
        b = pow(a, -x);
        s += b;
        if (-{EPS} * s < b && b < {EPS} * s) return s;
    }}
    const double w = a;
    s += b * w / (x - 1.0) - 0.5 * b;
    double fac = 1.0, t;
{tail}    return s;
}}
"""
