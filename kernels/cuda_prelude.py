"""The text every generated CUDA C kernel starts with: types, NaN-propagating min/max, and the
block-level reductions (warp shuffles, then one partial per warp in shared memory).

Written against a small set of CUDA names so that the same kernel source also compiles as
host C++ (gjit/runtime/host_emulation.py defines GJIT_HOST and those names, and runs each block's
threads as fibers that meet at barriers): shared memory is declared only through GJIT_SHARED, threads meet
only at __syncthreads(), and lanes exchange values only through __shfl_down_sync with a full
mask, every lane of every warp taking part (blocks are a multiple of 32 threads).
"""

from gjit.kernels.polynomials import cuda_polynomials
from gjit.kernels.special_math import cuda_special

CUDA_PRELUDE = (
    r"""// ---- gjit CUDA C prelude ----
#ifndef GJIT_PRELUDE
#define GJIT_PRELUDE
#ifndef GJIT_HOST
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#define GJIT_SHARED(T, name, n) __shared__ T name[n]
#define GJIT_INFF __int_as_float(0x7f800000)
#define GJIT_NANF __int_as_float(0x7fc00000)
#define GJIT_INF __longlong_as_double(0x7ff0000000000000LL)
#define GJIT_NAN __longlong_as_double(0x7ff8000000000000LL)
#define GJIT_ASSERT(c) assert(c)  // a device-side assert (NVRTC's builtin: __assertfail)
#else
#include <cmath>
#include <limits>
#define GJIT_ASSERT(c) ((c) ? (void)0 : gjit_assert_failed(#c, __LINE__))  // the launch fails
#define GJIT_INFF std::numeric_limits<float>::infinity()
#define GJIT_NANF std::numeric_limits<float>::quiet_NaN()
#define GJIT_INF std::numeric_limits<double>::infinity()
#define GJIT_NAN std::numeric_limits<double>::quiet_NaN()
struct alignas(16) float4 { float x, y, z, w; };
#endif

template <typename T>
__device__ __forceinline__ T gjit_imin(T a, T b) { return a < b ? a : b; }
template <typename T>
__device__ __forceinline__ T gjit_imax(T a, T b) { return a > b ? a : b; }

// Python's // and % on integers (round toward -inf; the remainder takes the divisor's sign)
template <typename T>
__device__ __forceinline__ T gjit_floordiv(T a, T b) {
    T q = a / b;
    return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}
template <typename T>
__device__ __forceinline__ T gjit_remainder(T a, T b) {
    T r = a % b;
    return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}
__device__ __forceinline__ float gjit_fremainder(float a, float b) {
    float r = fmodf(a, b);
    return (r != 0.0f && ((r < 0.0f) != (b < 0.0f))) ? r + b : r;
}
__device__ __forceinline__ double gjit_fremainder(double a, double b) {
    double r = fmod(a, b);
    return (r != 0.0 && ((r < 0.0) != (b < 0.0))) ? r + b : r;
}

template <typename T>
__device__ __forceinline__ T gjit_max_nan(T a, T b) {
    return (a != a) ? a : ((b != b) ? b : (a > b ? a : b));
}

template <typename T>
__device__ __forceinline__ T gjit_min_nan(T a, T b) {
    return (a != a) ? a : ((b != b) ? b : (a < b ? a : b));
}

struct GjitSum {
    template <typename T>
    __device__ __forceinline__ T operator()(T a, T b) const { return a + b; }
};
struct GjitProd {
    template <typename T>
    __device__ __forceinline__ T operator()(T a, T b) const { return a * b; }
};
struct GjitMax {
    template <typename T>
    __device__ __forceinline__ T operator()(T a, T b) const { return gjit_max_nan(a, b); }
};
struct GjitMin {
    template <typename T>
    __device__ __forceinline__ T operator()(T a, T b) const { return gjit_min_nan(a, b); }
};

// Atomic combine of v into *p (writes through indices: scatter_add, index_put(accumulate), ...):
// a compare-and-swap loop on the value's bits, for the dtypes gjit uses atomics for (float,
// double, int, long long); adds use the hardware's atomicAdd on a GPU. The host emulation runs
// blocks on several threads, so its loop uses the compiler's atomic builtins.
#ifndef GJIT_HOST
__device__ __forceinline__ unsigned int gjit_cas(unsigned int* p, unsigned int c, unsigned int v) {
    return atomicCAS(p, c, v);
}
__device__ __forceinline__ unsigned long long gjit_cas(unsigned long long* p, unsigned long long c,
                                                       unsigned long long v) {
    return atomicCAS(p, c, v);
}
#else
template <typename U>
inline U gjit_cas(U* p, U c, U v) {
    __atomic_compare_exchange_n(p, &c, v, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
    return c;  // the value seen: c itself when the swap happened
}
#endif
template <typename T, typename U, typename Op>
__device__ __forceinline__ void gjit_atomic_loop(T* p, T v, Op op) {
    union Bits { T t; U u; };
    U* q = reinterpret_cast<U*>(p);
    Bits seen, next;
    seen.u = *reinterpret_cast<volatile U*>(q);
    while (true) {
        next.t = op(seen.t, v);
        U old = gjit_cas(q, seen.u, next.u);
        if (old == seen.u) return;
        seen.u = old;
    }
}
#define GJIT_ATOMICS(T, U)                                                                        \
    __device__ __forceinline__ void gjit_atomic_max(T* p, T v) { gjit_atomic_loop<T, U>(p, v, GjitMax()); } \
    __device__ __forceinline__ void gjit_atomic_min(T* p, T v) { gjit_atomic_loop<T, U>(p, v, GjitMin()); }
GJIT_ATOMICS(float, unsigned int)
GJIT_ATOMICS(double, unsigned long long)
GJIT_ATOMICS(int, unsigned int)
GJIT_ATOMICS(long long, unsigned long long)
#undef GJIT_ATOMICS
#ifndef GJIT_HOST
__device__ __forceinline__ void gjit_atomic_add(float* p, float v) { atomicAdd(p, v); }
__device__ __forceinline__ void gjit_atomic_add(double* p, double v) { atomicAdd(p, v); }
__device__ __forceinline__ void gjit_atomic_add(int* p, int v) { atomicAdd(p, v); }
__device__ __forceinline__ void gjit_atomic_add(long long* p, long long v) {
    atomicAdd(reinterpret_cast<unsigned long long*>(p), static_cast<unsigned long long>(v));
}
#else
template <typename T>
inline void gjit_atomic_add(T* p, T v) {
    if constexpr (sizeof(T) == 4) gjit_atomic_loop<T, unsigned int>(p, v, GjitSum());
    else gjit_atomic_loop<T, unsigned long long>(p, v, GjitSum());
}
#endif

// One value per thread in, the block's reduction out (in every thread). Lane 0 of each warp
// holds its warp's result after the shuffles; warp 0 reduces those partials.
template <typename T, typename Op>
__device__ __forceinline__ T gjit_block_reduce(T v, Op op, T identity) {
    GJIT_SHARED(T, gjit_partials, 32);
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int warps = (blockDim.x + 31) >> 5;
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_down_sync(0xffffffffu, v, o));
    if (lane == 0) gjit_partials[warp] = v;
    __syncthreads();
    v = (int)threadIdx.x < warps ? gjit_partials[threadIdx.x] : identity;
    if (warp == 0) {
        for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_down_sync(0xffffffffu, v, o));
        if (lane == 0) gjit_partials[0] = v;
    }
    __syncthreads();
    v = gjit_partials[0];
    __syncthreads();  // the partials are reused by the next reduction
    return v;
}

// Sums folded into the pass before theirs (codegen/online.py).
__device__ __forceinline__ float gjit_exp(float x) { return expf(x); }
__device__ __forceinline__ double gjit_exp(double x) { return exp(x); }

// One value per thread in, the inclusive scan over the block's threads in thread order out
// (Hillis-Steele in shared memory); `total` gets the last thread's, the whole block's.
template <typename T, typename Op>
__device__ __forceinline__ T gjit_block_scan(T v, Op op, T& total) {
    GJIT_SHARED(T, gjit_scan, 1024);
    const int t = threadIdx.x;
    for (int o = 1; o < (int)blockDim.x; o <<= 1) {
        gjit_scan[t] = v;
        __syncthreads();
        if (t >= o) v = op(gjit_scan[t - o], v);
        __syncthreads();
    }
    gjit_scan[t] = v;
    __syncthreads();
    total = gjit_scan[blockDim.x - 1];
    __syncthreads();  // the buffer is reused by the next step
    return v;
}

// cummax/cummin's indices: NaN beats a number, then the extreme, then the later index (the
// latest NaN, else the latest extreme: eager's).
template <typename T>
struct GjitValueIndex {
    T v;
    long long i;
};
template <bool IsMax>
struct GjitScanArg {
    template <typename T>
    __device__ __forceinline__ GjitValueIndex<T> operator()(GjitValueIndex<T> a, GjitValueIndex<T> b) const {
        const bool nan1 = a.v != a.v, nan2 = b.v != b.v;
        const bool better = IsMax ? b.v > a.v : b.v < a.v;
        const bool later = (b.v == a.v || nan1) && b.i > a.i;
        return ((nan2 && !nan1) || (nan1 == nan2 && (better || later))) ? b : a;
    }
};

// log(exp(a) + exp(b)), logcumsumexp's combine: equal infinities stay, NaN propagates.
struct GjitLogAddExp {
    template <typename T>
    __device__ __forceinline__ T operator()(T a, T b) const {
        if (a != a || b != b) return a + b;
        const T hi = a > b ? a : b, lo = a > b ? b : a;
        if (hi == lo && (hi == (T)GJIT_INF || hi == (T)(-GJIT_INF))) return hi;
        return hi + log1p(gjit_exp(lo - hi));
    }
};

// Online softmax: per thread, the sum of exp(x - peak) for its running max `peak`, rescaled
// when the max grows; a thread that has seen only -inf (or nothing) holds 0. One exp an element,
// as in kernels/triton_helpers.py: the rescale when x grew the max, else x's own term.
template <typename T>
__device__ __forceinline__ T gjit_online_sum_exp(T total, T peak, T x) {
    const T new_peak = gjit_max_nan(peak, x);
    const bool grew = x > peak;
    const T e = gjit_exp((x < peak ? x : peak) - new_peak);
    const T scale = grew ? e : T(1);
    const T term = grew ? T(1) + (x - new_peak) : (new_peak == (T)(-GJIT_INF) ? T(0) : e);
    return total * scale + term;
}

// The row's sum, every thread's rescaled to the row's max; a row of only -inf sums to NaN, as
// exp(x - max) does in eager.
template <typename T>
__device__ __forceinline__ T gjit_online_sum_exp_final(T total, T peak, T row_peak) {
    const T scaled = peak == row_peak ? total : total * gjit_exp(peak - row_peak);
    const T row = gjit_block_reduce(scaled, GjitSum(), T(0));
    return row_peak == (T)(-GJIT_INF) ? (T)GJIT_NAN : row;
}

// Welford's running count, mean and M2 per thread of (x - the thread's first element) / 2 (the
// mean stays small where the row's is large; halving keeps the difference of two finite values
// finite), and the row's sum of (x - row_mean)**2 from them.
template <typename T>
__device__ __forceinline__ void gjit_welford_add(T& count, T& first, T& mean, T& m2, T x) {
    if (count == T(0)) first = x;
    count += T(1);
    const T d = x * T(0.5) - first * T(0.5);
    const T delta = d - mean;
    mean += delta / count;
    m2 += delta * (d - mean);
}

template <typename T>
__device__ __forceinline__ T gjit_welford_final(T count, T first, T mean, T m2, T row_mean) {
    const T dev = (first * T(0.5) - row_mean * T(0.5)) + mean;
    return T(4) * gjit_block_reduce(count > T(0) ? m2 + count * dev * dev : T(0), GjitSum(), T(0));
}

// (value, index) pairs: is (v1, i1) the better one? Threads and lanes with no element hold
// (identity, INT64_MAX), which never beats a real element. NaN counts as the max (and the min); ties
// take the first index, as in eager argmax / argmin.
template <typename T>
__device__ __forceinline__ bool gjit_arg_better(T v1, long long i1, T v2, long long i2, bool is_max) {
    const bool nan1 = v1 != v1, nan2 = v2 != v2;
    const bool better = is_max ? ((v1 > v2) || (nan1 && !nan2)) : ((v1 < v2) || (nan1 && !nan2));
    const bool same = (v1 == v2) || (nan1 && nan2);
    return better || (same && i1 < i2);
}

template <typename T>
__device__ __forceinline__ long long gjit_block_argreduce(T v, long long i, bool is_max, T identity) {
    GJIT_SHARED(T, gjit_arg_values, 32);
    GJIT_SHARED(long long, gjit_arg_indices, 32);
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int warps = (blockDim.x + 31) >> 5;
    for (int o = 16; o > 0; o >>= 1) {
        T v2 = __shfl_down_sync(0xffffffffu, v, o);
        long long i2 = __shfl_down_sync(0xffffffffu, i, o);
        if (!gjit_arg_better(v, i, v2, i2, is_max)) { v = v2; i = i2; }
    }
    if (lane == 0) { gjit_arg_values[warp] = v; gjit_arg_indices[warp] = i; }
    __syncthreads();
    if (warp == 0) {
        const bool real = lane < warps;
        v = real ? gjit_arg_values[lane] : identity;
        i = real ? gjit_arg_indices[lane] : 0x7fffffffffffffffLL;
        for (int o = 16; o > 0; o >>= 1) {
            T v2 = __shfl_down_sync(0xffffffffu, v, o);
            long long i2 = __shfl_down_sync(0xffffffffu, i, o);
            if (!gjit_arg_better(v, i, v2, i2, is_max)) { v = v2; i = i2; }
        }
        if (lane == 0) gjit_arg_indices[0] = i;
    }
    __syncthreads();
    i = gjit_arg_indices[0];
    __syncthreads();
    return i;
}
"""
    + cuda_special()
    + cuda_polynomials()
    + r"""#endif  // GJIT_PRELUDE
// ---- end of prelude ----
"""
)
