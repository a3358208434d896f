"""Run generated CUDA C kernels on the CPU, to check their numerics without a GPU.

The kernel source (CUDA_PRELUDE + one `extern "C" __global__` kernel) compiles unchanged as
host C++ after HOST_HEADER, which defines GJIT_HOST and the CUDA names the kernels use. A
launch hands the grid's blocks to a few host threads; each runs one block at a time, its CUDA
threads as fibers (ucontext) that run in thread order until they wait at __syncthreads() or,
per warp, at a __shfl_*_sync. So a block of 1024 threads costs 1024 small stacks, not 1024 OS
threads, and the schedule is deterministic. The emulation is strict where CUDA leaves
behaviour undefined: a barrier that not every thread reaches (one returned early, or waits at
another line), a shuffle with a partial mask, a deadlock, shared memory over 48 KiB and a failed
GJIT_ASSERT (the prelude's; CUDA's device-side assert) all raise HostKernelError. Shared memory starts every
block as 0xff bytes (NaN floats). Each launch has its own state, so launches from two Python
threads may run at once.

Three kinds of files, in config.cache_dir/cuda_host/, each named by the hash of what built it
and written whole (temporary file, then os.replace): the runtime .so (launcher, fibers,
barriers; gjit/runtime/host_runtime.py), built once; HOST_HEADER and its precompiled form
(.gch), built once, so that a kernel does not parse <cmath> again; and one .so per program
(its kernels, compiled in one g++ run), linked against the runtime. A g++ run takes about
0.06 s plus 0.01-0.02 s per kernel (about twice that without the .gch, which g++ skips when it
does not fit, parsing the header instead). The kernels of one .so share its shared-memory
layout (one offset per call site, as CUDA gives one kernel), so the 48 KiB limit is checked
against their sum: generated kernels use a few hundred bytes, the partials of the prelude.

Not modelled: memory ordering and interleavings other than the fibers' schedule (a race
between blocks run by two host threads is a race here too), independent progress of the
threads in a warp, atomics, contraction of a * b + c into fma (nvcc does it, g++ -O1 does
not), CUDA's ulp bounds of the math functions (the host's libm is used), out-of-bounds
accesses (they crash the process) and integer division by zero (SIGFPE on the host).
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading

import torch

from gjit.codegen.common import numbered
from gjit.config import config
from gjit.runtime.host_runtime import HOST_HEADER, RUNTIME_SOURCE

HOST_THREADS = min(os.cpu_count() or 1, 16)  # blocks run this many at a time
# The runtime exports only its GJIT_API entry points.
RUNTIME_FLAGS = "-std=c++20 -O2 -shared -fPIC -pthread -w -fvisibility=hidden".split()
# A kernel, and the header's .gch (g++ uses a .gch only with the flags it was built with): hidden,
# non-unique symbols, so that every kernel .so keeps its own emulation state (shared memory
# offsets) even where the same inline functions are defined in another loaded kernel.
KERNEL_FLAGS = "-std=c++20 -O1 -shared -fPIC -w -fvisibility=hidden -fno-gnu-unique".split()
# Linked against the runtime, which is found beside the kernel or, by its soname, already loaded;
# a symbol that neither defines is a compile error, not a load error.
KERNEL_LINK_FLAGS = ["-Wl,-rpath,$ORIGIN", "-Wl,-z,defs"]
RUNTIME_KEY = hashlib.sha256("\0".join([RUNTIME_SOURCE, *RUNTIME_FLAGS]).encode()).hexdigest()
RUNTIME_NAME = f"gjit_host_runtime-{RUNTIME_KEY[:16]}.so"
HEADER_KEY = hashlib.sha256("\0".join([HOST_HEADER, *KERNEL_FLAGS, RUNTIME_KEY]).encode()).hexdigest()

LAUNCHER = r"""
static_assert(GjitSame<decltype(&{name}), void (*)({types})>::value,
              "the kernel's parameters differ from the ones given to host_kernel");
// args[i] points at the value of the kernel's i-th parameter (cuLaunchKernel's convention).
static void gjit_run_thread_{name}(void** args) {{
    {name}({unpacked});
}}
GJIT_API int gjit_host_launch_{name}(int grid, int block, void** args, int host_threads, char* error,
                                     int error_size) {{
    return gjit_launch(gjit_run_thread_{name}, grid, block, args, host_threads, error, error_size);
}}
"""

SCALAR_CTYPES = {
    "bool": ctypes.c_bool,
    "signed char": ctypes.c_byte,
    "unsigned char": ctypes.c_ubyte,
    "short": ctypes.c_short,
    "int": ctypes.c_int,
    "unsigned int": ctypes.c_uint,
    "long long": ctypes.c_longlong,
    "unsigned long long": ctypes.c_ulonglong,
    "float": ctypes.c_float,
    "double": ctypes.c_double,
}
POINTEE_DTYPES = {
    "float": torch.float32,
    "double": torch.float64,
    "__half": torch.float16,
    "__nv_bfloat16": torch.bfloat16,
    "long long": torch.int64,
    "int": torch.int32,
    "short": torch.int16,
    "signed char": torch.int8,
    "unsigned char": torch.uint8,
    "bool": torch.bool,
}


class HostCompileError(RuntimeError):
    pass


class HostKernelError(RuntimeError):
    pass


def _strip_type(ctype: str) -> str:
    return " ".join(ctype.replace("__restrict__", " ").replace("*", " * ").split()).replace(" *", "*")


@dataclasses.dataclass
class HostKernel:
    """A kernel compiled for the host: call it as `kernel(grid, block, args)`."""

    name: str
    params: list[tuple[str, str]]
    launch: ctypes._CFuncPtr

    def __call__(self, grid: int, block: int, args: list) -> None:
        if len(args) != len(self.params):
            raise TypeError(f"{self.name} takes {len(self.params)} arguments, got {len(args)}")
        if grid < 1 or block < 32 or block > 1024 or block % 32:
            raise ValueError(f"grid {grid}, block {block}: blocks are 32..1024 threads, a multiple of 32")
        values = [_to_ctype(name, ctype, arg) for (name, ctype), arg in zip(self.params, args)]
        pointers = (ctypes.c_void_p * len(values))(
            *[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values]
        )
        error = ctypes.create_string_buffer(4096)
        if self.launch(grid, block, pointers, HOST_THREADS, error, len(error)):
            raise HostKernelError(f"{self.name}<<<{grid}, {block}>>>: {error.value.decode()}")


def _to_ctype(name: str, ctype: str, arg: object) -> ctypes._SimpleCData:
    ctype = _strip_type(ctype)
    if ctype.endswith("*"):
        if isinstance(arg, int):
            return ctypes.c_void_p(arg)
        pointee = ctype.removeprefix("const ").removesuffix("*")
        if not isinstance(arg, torch.Tensor) or arg.device.type != "cpu":
            raise TypeError(f"{name} ({ctype}) takes a CPU tensor, got {arg!r:.80}")
        if pointee in POINTEE_DTYPES and arg.dtype != POINTEE_DTYPES[pointee]:
            raise TypeError(f"{name} ({ctype}) takes a {POINTEE_DTYPES[pointee]} tensor, got {arg.dtype}")
        return ctypes.c_void_p(arg.data_ptr())
    if ctype not in SCALAR_CTYPES:
        raise TypeError(f"{name}: no host marshalling for C type {ctype!r}")
    return SCALAR_CTYPES[ctype](arg)


_loaded: dict[str, list[ctypes._CFuncPtr]] = {}  # a shared object's hash -> its launchers
_runtime: list[ctypes.CDLL] = []  # the runtime, once loaded in this process
_lock = threading.Lock()


def host_kernel(source: str, name: str, params: list[tuple[str, str]]) -> HostKernel:
    """Compile `source` (CUDA_PRELUDE + kernel `name`) for the host; `params` are the kernel's
    (name, C type) in order."""
    return host_kernels([(source, name, params)])[0]


def host_kernels(kernels: list[tuple[str, str, list[tuple[str, str]]]]) -> list[HostKernel]:
    """Compile kernels given as (source, name, params) into one shared object, cached on disk by
    the hash of its text: one g++ run for a program's kernels (most of a run is g++ starting and
    reading the precompiled header). The prelude's include guard keeps its first copy only;
    each kernel's lines are numbered in its own file, `<name>.cu`."""
    parts = []
    for source, name, params in kernels:
        types = [_strip_type(ctype) for _, ctype in params]
        unpacked = ", ".join(f"*static_cast<{t}*>(args[{i}])" for i, t in enumerate(types))
        parts.append(f'#line 1 "{name}.cu"\n{source}\n#line 1 "gjit_host_launch_{name}.cpp"\n')
        parts.append(LAUNCHER.format(name=name, types=", ".join(types), unpacked=unpacked))
    text = "".join(parts)
    key = hashlib.sha256("\0".join([text, *KERNEL_LINK_FLAGS, HEADER_KEY]).encode()).hexdigest()
    with _lock:
        if key not in _loaded:
            runtime = runtime_library()
            path = os.path.join(config.cache_dir, "cuda_host", f"{key}.so")
            if not os.path.exists(path):  # g++ runs in a temporary dir: errors name <kernel>.cu
                args = [*KERNEL_FLAGS, "-include", host_header(), "kernels.cpp", runtime, *KERNEL_LINK_FLAGS]
                errors = _gxx(text, "kernels.cpp", args, path)
                if errors is not None:
                    raise HostCompileError(_compile_error(errors, kernels))
            library = ctypes.CDLL(path)
            int_, ptr = ctypes.c_int, ctypes.c_void_p
            launches = []
            for _, name, _ in kernels:
                launch = getattr(library, f"gjit_host_launch_{name}")
                # grid, block, args, host threads, error buffer and its size
                launch.argtypes = [int_, int_, ptr, int_, ctypes.c_char_p, int_]
                launch.restype = ctypes.c_int
                launches.append(launch)
            _loaded[key] = launches
    return [
        HostKernel(name, list(params), launch) for (_, name, params), launch in zip(kernels, _loaded[key])
    ]


def _compile_error(errors: str, kernels: list) -> str:
    """g++'s errors, then the numbered source of each kernel they name (of all, if they name none)."""
    named = [k for k in kernels if f"{k[1]}.cu:" in errors] or kernels
    sources = "".join(f"\n{name}.cu:\n{numbered(source)}" for source, name, _ in named)
    return f"g++ failed on {', '.join(k[1] for k in kernels)}:\n{errors}{sources}"


def runtime_library() -> str:
    """The path of the runtime .so in the cache dir. The first call in a process loads it
    (RTLD_GLOBAL); a kernel linked against it binds to that copy by its soname."""
    path = os.path.join(config.cache_dir, "cuda_host", RUNTIME_NAME)
    args = [*RUNTIME_FLAGS, "runtime.cpp", f"-Wl,-soname,{RUNTIME_NAME}"]
    _build_once(path, RUNTIME_SOURCE, "runtime.cpp", args, "the host runtime")
    if not _runtime:
        _runtime.append(ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL))
    return path


def host_header() -> str:
    """The path of HOST_HEADER in the cache dir, for `g++ -include`, with its .gch beside it. Where
    the .gch is missing (another process is writing it) or does not fit, g++ parses the header."""
    path = os.path.join(config.cache_dir, "cuda_host", f"header-{HEADER_KEY[:16]}", "gjit_host.h")
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=os.path.dirname(path), delete=False) as f:
            f.write(HOST_HEADER)
        os.replace(f.name, path)
    args = [*KERNEL_FLAGS, "-x", "c++-header", "gjit_host.h"]
    _build_once(path + ".gch", HOST_HEADER, "gjit_host.h", args, "the host header")
    return path


_built: dict[str, str] = {}  # name in cuda_host/ -> where this process built or found it


def _build_once(path: str, text: str, filename: str, args: list[str], what: str) -> None:
    """Build `path` with g++ unless it is there, or copy it from another cache dir where this
    process has it already (tests switch cache dirs)."""
    name = os.path.relpath(path, os.path.join(config.cache_dir, "cuda_host"))
    if not os.path.exists(path):
        known = _built.get(name)
        if known is not None and os.path.exists(known):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with tempfile.TemporaryDirectory(dir=os.path.dirname(path)) as tmp:
                shutil.copyfile(known, os.path.join(tmp, "out"))
                os.replace(os.path.join(tmp, "out"), path)
        else:
            errors = _gxx(text, filename, args, path)
            if errors is not None:
                raise HostCompileError(f"g++ failed on {what}:\n{errors}")
    _built[name] = path


def _gxx(text: str, filename: str, args: list[str], path: str) -> str | None:
    """Run g++ `args` -o `path` in a temporary dir that holds `text` as `filename`; g++'s errors,
    or None. The output is moved into place whole (os.replace), so processes that build the
    same file at once each write a complete one."""
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    compiler = shutil.which("g++")
    if compiler is None:
        raise HostCompileError("no host C++ compiler: install g++")
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        with open(os.path.join(tmp, filename), "w") as f:
            f.write(text)
        out = os.path.join(tmp, "out")
        result = subprocess.run([compiler, *args, "-o", out], capture_output=True, text=True, cwd=tmp)
        if result.returncode != 0:
            return result.stderr
        os.replace(out, path)
    return None
