"""Hand-written Triton helpers that generated kernels call: NaN-propagating max/min, product,
first-index argmax/argmin, online softmax and Welford's variance per lane (reductions), digamma,
trigamma and the Hurwitz zeta function (kernels/special_math.py), torch.special's orthogonal
polynomials (kernels/polynomials.py), modified Bessel functions (kernels/bessel.py).

Each is Triton source text that codegen copies into a kernel's file when the kernel uses it
(a generated kernel file stands alone: Triton's JIT and interpreter read it by itself).
"""

from gjit.kernels.bessel import BESSEL, TRITON_SPHERICAL_J0, triton_bessel
from gjit.kernels.polynomials import POLYNOMIALS, triton_polynomial
from gjit.kernels.special_math import triton_digamma, triton_trigamma, triton_zeta


class _Helpers(dict):
    """The helpers by name; the Bessel functions' source is made on first use (their series'
    coefficients are computed then: kernels/bessel.py)."""

    def __missing__(self, name: str) -> str:
        if name not in (*BESSEL, "spherical_j0"):
            raise KeyError(name)
        self[name] = triton_bessel(name) if name in BESSEL else TRITON_SPHERICAL_J0
        return self[name]


HELPERS = {
    "max_nan": "@triton.jit\ndef _max_nan(a, b):\n    return tl.maximum(a, b, tl.PropagateNan.ALL)\n",
    "min_nan": "@triton.jit\ndef _min_nan(a, b):\n    return tl.minimum(a, b, tl.PropagateNan.ALL)\n",
    "mul": "@triton.jit\ndef _mul(a, b):\n    return a * b\n",
    "add": "@triton.jit\ndef _add(a, b):\n    return a + b\n",
    # cummax/cummin's values: NaN wins once seen (ints too: a != a is False)
    "scan_max": "@triton.jit\ndef _scan_max(a, b):\n"
    "    return tl.where(a != a, a, tl.where(b != b, b, tl.maximum(a, b)))\n",
    "scan_min": "@triton.jit\ndef _scan_min(a, b):\n"
    "    return tl.where(a != a, a, tl.where(b != b, b, tl.minimum(a, b)))\n",
    # cummax/cummin's indices: NaN beats a number, then the extreme, then the later index (so
    # the result is the latest NaN, else the latest extreme: eager's); commutative, for tl.reduce
    "scan_argmax": "@triton.jit\ndef _scan_argmax(v1, i1, v2, i2):\n"
    "    nan1 = v1 != v1\n    nan2 = v2 != v2\n"
    "    take = (nan2 & (nan1 == 0)) | ((nan1 == nan2) & ((v2 > v1) | (((v2 == v1) | nan1) & (i2 > i1))))\n"
    "    return tl.where(take, v2, v1), tl.where(take, i2, i1)\n",
    "scan_argmin": "@triton.jit\ndef _scan_argmin(v1, i1, v2, i2):\n"
    "    nan1 = v1 != v1\n    nan2 = v2 != v2\n"
    "    take = (nan2 & (nan1 == 0)) | ((nan1 == nan2) & ((v2 < v1) | (((v2 == v1) | nan1) & (i2 > i1))))\n"
    "    return tl.where(take, v2, v1), tl.where(take, i2, i1)\n",
    # log(exp(a) + exp(b)) (logcumsumexp's combine): equal infinities stay, NaN propagates
    "logaddexp": "@triton.jit\ndef _logaddexp(a, b):\n"
    "    hi = tl.maximum(a, b)\n    lo = tl.minimum(a, b)\n"
    "    same = (hi == lo) & (tl.abs(hi) == float('inf'))\n"
    "    out = tl.where(same, hi, hi + libdevice.log1p(tl.exp(lo - hi)))\n"
    "    return tl.where((a != a) | (b != b), a + b, out)\n",
    # first index of the max / min; NaN counts as the max (and the min), as in eager
    "argmax": "@triton.jit\ndef _argmax(v1, i1, v2, i2):\n"
    "    nan1 = v1 != v1\n    nan2 = v2 != v2\n"
    "    better = (v1 > v2) | (nan1 & (nan2 == 0))\n    same = (v1 == v2) | (nan1 & nan2)\n"
    "    take = better | (same & (i1 < i2))\n    return tl.where(take, v1, v2), tl.where(take, i1, i2)\n",
    # online softmax (codegen/online.py): per lane, the sum of exp(x - peak) for its running max
    # `peak`, rescaled when the max grows; a lane that has seen only -inf (or nothing) holds 0.
    # One exp an element: of the smaller of peak and x less the new max, which is the rescale
    # when x grew the max (x's own term then is exp(x - x): 1, or NaN for x = inf) and x's term
    # when it did not; the same values as computing both exps
    "online_sum_exp": "@triton.jit\ndef _online_sum_exp(total, peak, x):\n"
    "    new_peak = tl.maximum(peak, x, tl.PropagateNan.ALL)\n"
    "    grew = x > peak\n"
    "    e = tl.exp(tl.minimum(peak, x) - new_peak)\n"
    "    scale = tl.where(grew, e, 1.0)\n"
    "    term = tl.where(grew, 1.0 + (x - new_peak), tl.where(new_peak == float('-inf'), 0.0, e))\n"
    "    return total * scale + term\n",
    # the row's sum, every lane rescaled to the row's max; a row of only -inf sums to NaN, as
    # exp(x - max) does in eager
    "online_sum_exp_final": "@triton.jit\ndef _online_sum_exp_final(total, peak, row_peak):\n"
    "    scaled = tl.where(peak == row_peak, total, total * tl.exp(peak - row_peak))\n"
    "    row = tl.sum(scaled, 1)[:, None]\n"
    "    return tl.where(row_peak == float('-inf'), float('nan'), row)\n",
    # Welford's running mean and M2 per lane of (x - the lane's first element) / 2: the mean
    # stays small where the row's is large (a float32 mean of 1e4 is only good to 1e-3), and
    # halving keeps the difference of two finite values finite (eager's squares may reach inf).
    # In chunk c of a row every active lane holds its (c + 1)-th element (a lane past the row's
    # end stays past it): no count a lane, one reciprocal a chunk, not a division an element.
    # `half_first` is the lane's first element halved; a lane inactive in chunk 0 never is active
    "welford_add": "@triton.jit\ndef _welford_add(half_first, mean, m2, x, active, chunk):\n"
    "    half_x = x * 0.5\n"
    "    half_first = tl.where(chunk == 0, half_x, half_first)\n"
    "    d = half_x - half_first\n"
    "    delta = tl.where(active, d - mean, 0.0)\n"
    "    mean = mean + delta * (1.0 / tl.cast(chunk + 1, mean.dtype))\n"
    "    m2 = m2 + delta * tl.where(active, d - mean, 0.0)\n"
    "    return half_first, mean, m2\n",
    # the row's sum of (x - row_mean)**2 from its lanes' (first / 2, mean, M2); a lane's count is
    # how many of its positions j, j + RBLOCK, ... are in a row of `length` (0: it holds nothing)
    "welford_final": "@triton.jit\n"
    "def _welford_final(half_first, mean, m2, row_mean, length, RBLOCK: tl.constexpr):\n"
    "    count = ((length + RBLOCK - 1 - tl.arange(0, RBLOCK)[None, :]) // RBLOCK).to(mean.dtype)\n"
    "    dev = (half_first - row_mean * 0.5) + mean\n"
    "    return 4.0 * tl.sum(tl.where(count > 0, m2 + count * dev * dev, 0.0), 1)[:, None]\n",
    "argmin": "@triton.jit\ndef _argmin(v1, i1, v2, i2):\n"
    "    nan1 = v1 != v1\n    nan2 = v2 != v2\n"
    "    better = (v1 < v2) | (nan1 & (nan2 == 0))\n    same = (v1 == v2) | (nan1 & nan2)\n"
    "    take = better | (same & (i1 < i2))\n    return tl.where(take, v1, v2), tl.where(take, i1, i2)\n",
    "digamma": triton_digamma(),
    "trigamma": triton_trigamma(),
    "zeta": triton_zeta(),
    **{name: triton_polynomial(name) for name in POLYNOMIALS},
}
HELPERS = _Helpers(HELPERS)
