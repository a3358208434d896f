"""The C++ text of the host emulation of gjit/runtime/host_emulation.py, in two parts.

RUNTIME_SOURCE is compiled once into gjit_host_runtime-<hash>.so: the launcher, the fibers
(ucontext) that run a block's CUDA threads, barriers, shuffles, shared memory and the errors.
HOST_HEADER starts every kernel's translation unit and is kept light so that a kernel compiles
in a fraction of a second: the CUDA names as macros and inline functions that call into the
runtime, the 16-bit float types, and the CUDA math the host lacks. Both include HOST_ABI, the
declarations they share. The kernel .so exports one entry, gjit_host_launch, which hands the
runtime a function that runs the kernel for one CUDA thread.
"""

HOST_ABI = r"""// ---- gjit host emulation: what the runtime .so and every kernel .so share ----
#include <cstddef>
#define GJIT_API extern "C" __attribute__((visibility("default")))

struct gjit_dim3 { unsigned int x, y, z; };
// The CUDA thread that runs now on this host thread, as the runtime's scheduler last set it.
struct GjitThreadState {
    gjit_dim3 thread_idx, block_idx, block_dim, grid_dim;
    unsigned char* shared;  // the block's shared memory
};
// The same pointer for every call on one host thread, and a fiber never moves to another host
// thread: `const` lets a kernel keep it in a register (the fields are re-read after calls).
GJIT_API GjitThreadState* gjit_thread_state() __attribute__((const));
GJIT_API void gjit_syncthreads(int line);
// Lanes exchange `size` bytes at `value`, in place; kind is one of GjitShuffleKind.
enum GjitShuffleKind { GJIT_SHFL_DOWN, GJIT_SHFL_XOR, GJIT_SHFL_IDX };
GJIT_API void gjit_shuffle(int line, unsigned int mask, void* value, int size, int kind, int arg, int width);
// A call site's offset into the block's shared memory; `top` is the kernel's bytes in use.
GJIT_API size_t gjit_shared_alloc(size_t* top, size_t bytes, size_t align, const char* name);
// A failed GJIT_ASSERT(c) (the prelude's device assert): the launch stops with its text.
GJIT_API void gjit_assert_failed(const char* what, int line) __attribute__((noreturn));
GJIT_API int gjit_launch(void (*run_thread)(void**), int grid, int block, void** args, int host_threads,
                         char* error, int error_size);
GJIT_API double erfinv(double y);
GJIT_API float erfinvf(float y);
GJIT_API double erfcx(double x);
GJIT_API float erfcxf(float x);
GJIT_API double normcdfinv(double p);
GJIT_API float normcdfinvf(float p);
GJIT_API double cyl_bessel_i0(double x);
GJIT_API float cyl_bessel_i0f(float x);
GJIT_API double cyl_bessel_i1(double x);
GJIT_API float cyl_bessel_i1f(float x);
"""

HOST_HEADER = (
    HOST_ABI
    + r"""// ---- gjit host emulation of the CUDA names used by generated kernels ----
#define GJIT_HOST 1
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>  // for CUDA_PRELUDE
#include <math.h>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)

#define threadIdx (gjit_thread_state()->thread_idx)
#define blockIdx (gjit_thread_state()->block_idx)
#define blockDim (gjit_thread_state()->block_dim)
#define gridDim (gjit_thread_state()->grid_dim)
constexpr int warpSize = 32;

#define __syncthreads() gjit_syncthreads(__LINE__)

// Every call site gets a fixed offset into the block's shared memory the first time a thread
// reaches it, so a declaration in a loop is the same memory at every iteration, as in CUDA.
static size_t gjit_shared_top;  // this .so's kernels'; each .so has its own
#define GJIT_SHARED(T, name, n)                                                                     \
    static const size_t gjit_shared_offset_##name =                                                 \
        gjit_shared_alloc(&gjit_shared_top, sizeof(T) * (n), alignof(T), #name);                    \
    T* name = reinterpret_cast<T*>(gjit_thread_state()->shared + gjit_shared_offset_##name)

// Lane `lane` of the warp gets the value of lane src(lane) (its own value when src is out of
// range), every lane of the warp taking part.
template <typename T>
inline T gjit_shuffle_value(int line, unsigned int mask, T v, int kind, int arg, int width) {
    static_assert(__is_trivially_copyable(T) && sizeof(T) <= 16, "shuffled type");
    gjit_shuffle(line, mask, &v, (int)sizeof(T), kind, arg, width);
    return v;
}
#define __shfl_down_sync(...) gjit_shfl_down(__LINE__, __VA_ARGS__)
#define __shfl_xor_sync(...) gjit_shfl_xor(__LINE__, __VA_ARGS__)
#define __shfl_sync(...) gjit_shfl(__LINE__, __VA_ARGS__)
template <typename T>
inline T gjit_shfl_down(int line, unsigned int mask, T v, unsigned int delta, int width = 32) {
    return gjit_shuffle_value(line, mask, v, GJIT_SHFL_DOWN, (int)delta, width);
}
template <typename T>
inline T gjit_shfl_xor(int line, unsigned int mask, T v, int lane_mask, int width = 32) {
    return gjit_shuffle_value(line, mask, v, GJIT_SHFL_XOR, lane_mask, width);
}
template <typename T>
inline T gjit_shfl(int line, unsigned int mask, T v, int src_lane, int width = 32) {
    return gjit_shuffle_value(line, mask, v, GJIT_SHFL_IDX, src_lane, width);
}

// ---- 16-bit floats: storage types, converted to and from float with round-to-nearest-even ----
inline unsigned int gjit_float_bits(float f) { unsigned int u; std::memcpy(&u, &f, 4); return u; }
inline float gjit_bits_float(unsigned int u) { float f; std::memcpy(&f, &u, 4); return f; }

inline unsigned short gjit_float_to_half_bits(float f) {
    const unsigned int u = gjit_float_bits(f);
    const unsigned short sign = (u >> 16) & 0x8000u;
    const unsigned int a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return 0x7fffu;               // NaN: CUDA's canonical half NaN
    if (a >= 0x477ff000u) return sign | 0x7c00u;       // >= 65520 rounds to inf
    if (a >= 0x38800000u) {                            // normal half
        unsigned int h = (a - 0x38000000u) >> 13;      // rebias the exponent 127 -> 15
        const unsigned int rest = a & 0x1fffu;
        if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;
        return sign | (unsigned short)h;
    }
    if (a <= 0x33000000u) return sign;                 // <= 2^-25 rounds to zero (the tie to even)
    const unsigned int mant = (a & 0x7fffffu) | 0x800000u;
    const int shift = 126 - (int)(a >> 23);            // to units of 2^-24, the half subnormal step
    unsigned int h = mant >> shift;
    const unsigned int rest = mant & ((1u << shift) - 1u), half = 1u << (shift - 1);
    if (rest > half || (rest == half && (h & 1u))) ++h;
    return sign | (unsigned short)h;
}

inline float gjit_half_bits_to_float(unsigned short h) {
    const unsigned int sign = (unsigned int)(h & 0x8000u) << 16;
    const unsigned int exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    if (exp == 0x1fu) return gjit_bits_float(mant ? 0x7fffffffu : sign | 0x7f800000u);  // CUDA's NaN
    if (exp == 0) {
        const float value = (float)mant * 5.9604644775390625e-8f;  // mant * 2^-24, exact
        return sign ? -value : value;
    }
    return gjit_bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

inline unsigned short gjit_float_to_bfloat16_bits(float f) {
    const unsigned int u = gjit_float_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fffu;  // NaN: CUDA's canonical bfloat16 NaN
    return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

struct __half {
    unsigned short __x;
    __half() = default;
    __half(float f) : __x(gjit_float_to_half_bits(f)) {}
    operator float() const { return gjit_half_bits_to_float(__x); }
};
struct __nv_bfloat16 {
    unsigned short __x;
    __nv_bfloat16() = default;
    __nv_bfloat16(float f) : __x(gjit_float_to_bfloat16_bits(f)) {}
    operator float() const { return gjit_bits_float((unsigned int)__x << 16); }
};
inline float __half2float(__half h) { return (float)h; }
inline __half __float2half_rn(float f) { return __half(f); }
inline __half __float2half(float f) { return __half(f); }
inline float __bfloat162float(__nv_bfloat16 b) { return (float)b; }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16(f); }
inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16(f); }

inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline long long __double_as_longlong(double d) { long long i; std::memcpy(&i, &d, 8); return i; }
inline double __longlong_as_double(long long i) { double d; std::memcpy(&d, &i, 8); return d; }

// ---- math CUDA has and the host lacks (erfinv and erfinvf are the runtime's) ----
inline double rsqrt(double x) { return 1.0 / std::sqrt(x); }
inline float rsqrtf(float x) { return (float)rsqrt((double)x); }

// CUDA's integer (and float) min / max overloads.
#define GJIT_MINMAX(T)                                       \
    inline T min(T a, T b) { return a < b ? a : b; }         \
    inline T max(T a, T b) { return a > b ? a : b; }
GJIT_MINMAX(int)
GJIT_MINMAX(unsigned int)
GJIT_MINMAX(long)
GJIT_MINMAX(unsigned long)
GJIT_MINMAX(long long)
GJIT_MINMAX(unsigned long long)
#undef GJIT_MINMAX
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
inline double min(double a, double b) { return fmin(a, b); }
inline double max(double a, double b) { return fmax(a, b); }

// For the launcher's check of the kernel's parameters.
template <typename A, typename B>
struct GjitSame { static constexpr bool value = false; };
template <typename A>
struct GjitSame<A, A> { static constexpr bool value = true; };
// ---- end of host emulation header ----
"""
)

RUNTIME_SOURCE = (
    r"""// ---- gjit host runtime: launches, fibers, barriers, shuffles, shared memory ----
#include <ucontext.h>
#include <sys/mman.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>
"""
    + HOST_ABI
    + r"""
// ---- errors: the first one of a launch wins; the launch then stops ----
struct GjitAbort {};
struct GjitLaunch {
    void (*run_thread)(void**);
    void** args;
    int grid, threads;
    std::atomic<int> next_block{0};
    std::mutex mutex;
    std::string message;
    std::atomic<bool> failed{false};

    void record(const std::string& what) {
        std::lock_guard<std::mutex> lock(mutex);
        if (!failed.load()) {
            message = what;
            failed.store(true);
        }
    }
};

struct GjitBlock;
static thread_local GjitThreadState gjit_state;  // what the kernel sees
static thread_local GjitBlock* gjit_block;       // the block this host thread runs

GJIT_API GjitThreadState* gjit_thread_state() { return &gjit_state; }

[[noreturn]] static void gjit_fail(const std::string& message);

// ---- one block: its threads are fibers on one host thread, each run until it waits ----
struct GjitBarrier;
struct GjitFiber {
    ucontext_t context;
    void* stack = nullptr;
    GjitBarrier* waiting = nullptr;
    bool done = false;
    int shuffle_phase = 0;
};

// `expected` threads meet at one source line. A thread that returned from the kernel while
// the others wait (or will wait) here is an error, as is a thread waiting at another line.
struct GjitBarrier {
    const char* what = "";
    int expected = 0, arrived = 0, left = 0, line = 0;
    std::vector<GjitFiber*> waiters;

    void reset(int n, const char* name) { what = name; expected = n; arrived = 0; left = 0; waiters.clear(); }
    void wait(int at_line);
    void leave() {
        ++left;
        if (arrived > 0 && arrived + left == expected) diverged();
    }
    [[noreturn]] void diverged() {
        gjit_fail(std::string("divergent ") + what + ": " + std::to_string(left) + " of " +
                  std::to_string(expected) +
                  " threads returned from the kernel while the others wait at line " + std::to_string(line));
    }
};

constexpr size_t GJIT_SHARED_BYTES = 48 * 1024;  // CUDA's limit for static __shared__
constexpr size_t GJIT_STACK_BYTES = 256 * 1024;  // per thread, below one guard page
struct GjitWarp {
    GjitBarrier barrier;
    alignas(16) unsigned char slots[2][32][16];  // double-buffered: one barrier per shuffle
};
struct GjitBlock {
    GjitLaunch* launch = nullptr;
    GjitBarrier barrier;
    std::vector<GjitWarp> warps;
    std::vector<GjitFiber> fibers;
    ucontext_t scheduler;
    int current = 0;
    alignas(64) unsigned char shared[GJIT_SHARED_BYTES];
};

static void gjit_fail(const std::string& message) {
    gjit_block->launch->record("block " + std::to_string(gjit_state.block_idx.x) + ", thread " +
                               std::to_string(gjit_state.thread_idx.x) + ": " + message);
    throw GjitAbort{};
}

void GjitBarrier::wait(int at_line) {
    GjitBlock& block = *gjit_block;
    if (arrived == 0) line = at_line;
    else if (at_line != line)
        gjit_fail(std::string(what) + " at line " + std::to_string(at_line) +
                  " while other threads wait at line " + std::to_string(line));
    if (++arrived == expected) {  // the last one to arrive goes on; the others become runnable
        for (GjitFiber* f : waiters) f->waiting = nullptr;
        waiters.clear();
        arrived = 0;
        return;
    }
    if (arrived + left == expected) diverged();
    GjitFiber& me = block.fibers[block.current];
    me.waiting = this;
    waiters.push_back(&me);
    swapcontext(&me.context, &block.scheduler);
    if (block.launch->failed.load()) throw GjitAbort{};
}

GJIT_API void gjit_syncthreads(int line) { gjit_block->barrier.wait(line); }

GJIT_API void gjit_assert_failed(const char* what, int line) {
    gjit_fail("assertion failed at line " + std::to_string(line) + ": " + what);
}

GJIT_API size_t gjit_shared_alloc(size_t* top, size_t bytes, size_t align, const char* name) {
    static std::mutex mutex;
    std::lock_guard<std::mutex> lock(mutex);
    const size_t offset = (*top + align - 1) / align * align;
    if (offset + bytes > GJIT_SHARED_BYTES)
        gjit_fail("shared memory over " + std::to_string(GJIT_SHARED_BYTES) + " bytes at " + name);
    *top = offset + bytes;
    return offset;
}

static int gjit_shuffle_source(int kind, int lane, int arg, int width) {
    if (kind == GJIT_SHFL_DOWN) return (lane % width) + arg < width ? lane + arg : lane;
    if (kind == GJIT_SHFL_XOR) return ((lane ^ arg) / width) == (lane / width) ? lane ^ arg : lane;
    return lane / width * width + ((arg % width) + width) % width;
}

GJIT_API void gjit_shuffle(int line, unsigned int mask, void* value, int size, int kind, int arg, int width) {
    GjitBlock& block = *gjit_block;
    const int t = (int)gjit_state.thread_idx.x;
    GjitWarp& warp = block.warps[t >> 5];
    if (mask != 0xffffffffu) gjit_fail(std::string(warp.barrier.what) + " with a partial mask");
    int& phase = block.fibers[t].shuffle_phase;
    unsigned char (*slots)[16] = warp.slots[phase];
    phase ^= 1;
    const int lane = t & 31;
    std::memcpy(slots[lane], value, size);
    warp.barrier.wait(line);
    const int from = gjit_shuffle_source(kind, lane, arg, width);
    if (from >= 0 && from < 32) std::memcpy(value, slots[from], size);
}

// ---- math CUDA has and the host lacks ----
// Newton's method on erf (erfc near +-1, where erf(x) - y would cancel) from Winitzki's
// approximation, whose relative error is below 2e-3: four steps reach double precision.
GJIT_API double erfinv(double y) {
    if (std::isnan(y) || y < -1.0 || y > 1.0) return NAN;
    if (y == 1.0 || y == -1.0) return y * INFINITY;
    if (y == 0.0) return y;
    const double a = 0.147, pi = 3.14159265358979323846, ln = std::log1p(-y * y);
    const double t = 2.0 / (pi * a) + ln / 2.0;
    double x = std::sqrt(std::sqrt(t * t - ln / a) - t);
    if (x == 0.0) x = std::fabs(y) * std::sqrt(pi) / 2.0;
    const double s = std::fabs(y);
    for (int step = 0; step < 4; ++step) {
        const double slope = 2.0 / std::sqrt(pi) * std::exp(-x * x);
        const double err = s > 0.5 ? (1.0 - s) - std::erfc(x) : std::erf(x) - s;
        x -= err / slope;
    }
    return y < 0 ? -x : x;
}
GJIT_API float erfinvf(float y) { return (float)erfinv((double)y); }

// exp(x^2) erfc(x): as written below 26 (exp(x^2) finite, erfc(x) above the denormals), else the
// asymptotic series 1/(x sqrt(pi)) (1 - 1/(2x^2) + 3/(4x^4) - ...), six terms (error ~1e-17).
GJIT_API double erfcx(double x) {
    if (!(x >= 26.0)) return std::exp(x * x) * std::erfc(x);
    const double r = 1.0 / (x * x);
    double sum = 1.0;
    for (int k = 6; k >= 1; --k) sum = 1.0 - (k - 0.5) * r * sum;
    return sum / (x * 1.77245385090551602730);
}
GJIT_API float erfcxf(float x) { return (float)erfcx((double)x); }

// The inverse of the normal CDF: Newton's method on erfc(-x/sqrt 2)/2 (accurate in the lower
// tail) from sqrt(2) erfinv(2q - 1), or -sqrt(-2 log q) in the far tail; the upper half by symmetry.
GJIT_API double normcdfinv(double p) {
    if (std::isnan(p) || p < 0.0 || p > 1.0) return NAN;
    if (p == 0.0 || p == 1.0) return p == 0.0 ? -INFINITY : INFINITY;
    const double q = p < 0.5 ? p : 1.0 - p, sqrt2 = 1.41421356237309504880;
    double x = q > 1e-3 ? sqrt2 * erfinv(2.0 * q - 1.0) : -std::sqrt(-2.0 * std::log(q));
    for (int step = 0; step < 50; ++step) {
        const double slope = std::exp(-0.5 * x * x) * 0.39894228040143267794;
        if (slope == 0.0) break;
        const double dx = (0.5 * std::erfc(-x / sqrt2) - q) / slope;
        x -= dx;
        if (std::fabs(dx) <= 1e-16 * std::fabs(x)) break;
    }
    return p < 0.5 ? x : -x;
}
GJIT_API float normcdfinvf(float p) { return (float)normcdfinv((double)p); }

// Modified Bessel functions of the first kind by their power series in (x/2)^2, whose terms are
// all positive (no cancellation at any x; about x terms); I0 is even, I1 odd.
static double gjit_bessel_i(int order, double x) {
    const double q = 0.25 * x * x;
    double term = order == 0 ? 1.0 : 0.5 * std::fabs(x), sum = term;
    for (int k = 1; k < 5000; ++k) {
        term *= q / ((double)k * (k + order));
        sum += term;
        if (term <= sum * 1e-17) break;
    }
    return order == 1 && x < 0.0 ? -sum : sum;
}
GJIT_API double cyl_bessel_i0(double x) { return gjit_bessel_i(0, x); }
GJIT_API float cyl_bessel_i0f(float x) { return (float)cyl_bessel_i0((double)x); }
GJIT_API double cyl_bessel_i1(double x) { return gjit_bessel_i(1, x); }
GJIT_API float cyl_bessel_i1f(float x) { return (float)cyl_bessel_i1((double)x); }

// ---- a launch: host threads take blocks in turn; each runs a block's threads as fibers ----
// A fiber runs the kernel once per block and then hands back to the scheduler.
static void gjit_fiber_main() {
    for (;;) {
        GjitBlock& block = *gjit_block;
        const int t = block.current;
        try {
            block.launch->run_thread(block.launch->args);
            block.barrier.leave();
            block.warps[t >> 5].barrier.leave();
        } catch (GjitAbort&) {
        } catch (std::exception& e) {
            block.launch->record(std::string("exception: ") + e.what());
        }
        block.fibers[t].done = true;
        swapcontext(&block.fibers[t].context, &block.scheduler);
    }
}

static std::string gjit_deadlock(GjitBlock& block) {
    std::string message = "deadlock:";
    auto describe = [&](GjitBarrier& b) {
        if (b.arrived > 0)
            message += " " + std::to_string(b.arrived) + " of " + std::to_string(b.expected) +
                       " threads wait at " + b.what + " (line " + std::to_string(b.line) + ");";
    };
    describe(block.barrier);
    for (GjitWarp& w : block.warps) describe(w.barrier);
    return message;
}

static void gjit_run_block(GjitBlock& block, unsigned int b) {
    GjitLaunch& launch = *block.launch;
    gjit_state.block_idx = {b, 0, 0};
    block.barrier.reset(launch.threads, "__syncthreads");
    for (GjitWarp& w : block.warps) w.barrier.reset(32, "__shfl_*_sync");
    std::memset(block.shared, 0xff, GJIT_SHARED_BYTES);  // uninitialized shared memory reads as NaN
    for (GjitFiber& f : block.fibers) { f.done = false; f.waiting = nullptr; f.shuffle_phase = 0; }
    for (;;) {
        bool ran = false, all_done = true;
        for (int t = 0; t < launch.threads; ++t) {
            GjitFiber& f = block.fibers[t];
            if (f.done) continue;
            all_done = false;
            if (f.waiting) continue;
            block.current = t;
            gjit_state.thread_idx = {(unsigned)t, 0, 0};
            swapcontext(&block.scheduler, &f.context);
            ran = true;
            if (launch.failed.load()) return;
        }
        if (all_done) return;
        if (!ran) {
            gjit_state.thread_idx = {0, 0, 0};
            launch.record("block " + std::to_string(b) + ": " + gjit_deadlock(block));
            return;
        }
    }
}

static void gjit_host_worker(GjitLaunch& launch) {
    auto block = std::make_unique<GjitBlock>();
    gjit_block = block.get();
    block->launch = &launch;
    block->warps = std::vector<GjitWarp>(launch.threads / 32);
    block->fibers = std::vector<GjitFiber>(launch.threads);
    gjit_state.block_dim = {(unsigned)launch.threads, 1, 1};
    gjit_state.grid_dim = {(unsigned)launch.grid, 1, 1};
    gjit_state.shared = block->shared;
    const size_t page = 4096, size = GJIT_STACK_BYTES + page;
    bool ready = true;
    for (GjitFiber& f : block->fibers) {
        const int flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE;
        void* stack = mmap(nullptr, size, PROT_READ | PROT_WRITE, flags, -1, 0);
        if (stack == MAP_FAILED) { launch.record("cannot map fiber stacks"); ready = false; break; }
        mprotect(stack, page, PROT_NONE);  // a stack overflow faults instead of corrupting memory
        f.stack = stack;
        getcontext(&f.context);
        f.context.uc_stack.ss_sp = static_cast<char*>(stack) + page;
        f.context.uc_stack.ss_size = GJIT_STACK_BYTES;
        f.context.uc_link = nullptr;
        makecontext(&f.context, gjit_fiber_main, 0);
    }
    for (int b = launch.next_block++; ready && b < launch.grid && !launch.failed.load();
         b = launch.next_block++)
        gjit_run_block(*block, (unsigned)b);
    for (GjitFiber& f : block->fibers)
        if (f.stack) munmap(f.stack, size);
    gjit_block = nullptr;
    gjit_state = {};
}

// args[i] points at the value of the kernel's i-th parameter (cuLaunchKernel's convention);
// run_thread runs the kernel for the CUDA thread in gjit_thread_state(). Launches are independent.
GJIT_API int gjit_launch(void (*run_thread)(void**), int grid, int block, void** args, int host_threads,
                         char* error, int error_size) {
    GjitLaunch launch;
    launch.run_thread = run_thread;
    launch.args = args;
    launch.grid = grid;
    launch.threads = block;
    std::vector<std::thread> workers;
    const int n = std::max(1, std::min(host_threads, grid));
    try {
        for (int w = 0; w < n; ++w) workers.emplace_back(gjit_host_worker, std::ref(launch));
    } catch (std::exception& e) {
        launch.record(std::string("cannot start host threads: ") + e.what());
    }
    for (std::thread& w : workers) w.join();
    if (!launch.failed.load()) return 0;
    std::snprintf(error, error_size, "%s", launch.message.c_str());
    return 1;
}
// ---- end of host runtime ----
"""
)
