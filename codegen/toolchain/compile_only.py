"""Ahead-of-time compilation of generated kernels for a real GPU target, without a GPU.

`triton.compile` with `GPUTarget("cuda", 90, 32)` runs the whole NVIDIA pipeline (TTIR,
TTGIR, LLVM IR, PTX, and a cubin through the ptxas that ships with Triton), so a kernel
that compiles here is real sm_90 code. Pointer arguments and `xnumel` are marked 16-divisible,
as Triton's launcher specializes them on a GPU when the sizes allow; given the arguments of one
launch, a kernel is specialized as Triton's launcher would for that launch (gjit.aot).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import multiprocessing
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import triton
from triton.backends.compiler import GPUTarget

from gjit.codegen.common import KernelSource
from gjit.codegen.toolchain.files import import_file


def compile_kernel(
    kernel: KernelSource,
    path: str,
    arch: int = 90,
    aligned: bool = True,
    ones: tuple[str, ...] = (),
    divisible: tuple[str, ...] = (),
    launch: dict[str, Any] | None = None,
):
    """Compile `kernel` (its source file at `path`) for sm_<arch>; returns Triton's CompiledKernel.
    As Triton's launcher specializes integer arguments on a GPU: `ones` are passed as the constant
    1, `divisible` (sizes) are known multiples of 16. `launch`: the value of each argument in one
    launch (a pointer as anything with `data_ptr()`); then the kernel is specialized exactly as
    Triton's launcher would for that launch (ints equal to 1 constant, multiples of 16 divisible,
    16-byte aligned pointers), and `aligned`, `ones` and `divisible` are not used."""
    fn = getattr(import_file(path), kernel.name)
    params = [p for p in kernel.signature if p not in kernel.blocks]
    if launch is not None:
        ones, divisible = _specialized(launch)
    attrs = {}
    for k, p in enumerate(params):
        if p in ones:  # a constant: no attribute
            continue
        if launch is not None:
            known = p in divisible
        else:
            known = aligned and (kernel.signature[p].startswith("*") or p in (*NUMELS, *divisible))
        if known:
            attrs[(k,)] = [["tt.divisibility", 16]]
    signature = dict(kernel.signature) | {p: "constexpr" for p in ones}
    source = triton.compiler.ASTSource(
        fn=fn, signature=signature, constexprs=dict(kernel.blocks) | {p: 1 for p in ones}, attrs=attrs
    )
    # as a launch builds it: its options, and debug=True (its asserts) where its decorator asks
    options = kernel.launch_options() | ({"debug": True} if kernel.debug else {})
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


NUMELS = ("xnumel", "rnumel", "ynumel")  # marked divisible where no launch says otherwise


def _specialized(launch: dict[str, Any]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(ones, divisible) of one launch's arguments, by Triton's launcher's rules."""
    ones = tuple(p for p, v in launch.items() if type(v) is int and v == 1)
    divisible = tuple(
        p
        for p, v in launch.items()
        if (type(v) is int and v != 1 and v % 16 == 0) or (hasattr(v, "data_ptr") and v.data_ptr() % 16 == 0)
    )
    return ones, divisible


_warm_up: threading.Thread | None = None
_warm_up_lock = threading.Lock()


def _triton_one_time_work() -> None:
    try:
        import triton.compiler.code_generator  # noqa: F401
        from triton.runtime.cache import triton_key
    except ImportError:  # another Triton: its first compile pays whatever it needs
        return
    triton_key()  # lru-cached: every later compile of this process reads it


def start_warm_up() -> None:
    """Start Triton's one-time work of a process on a background thread: the hash of its sources
    and library that keys its cache (about 0.5 s, mostly hashing, which releases the GIL) and
    the import of its code generator. Called where GPU binaries will be built, before capture,
    so it runs beside export instead of after it. Idempotent."""
    global _warm_up
    with _warm_up_lock:
        if _warm_up is None:
            _warm_up = threading.Thread(target=_triton_one_time_work, name="gjit-triton-warm-up", daemon=True)
            _warm_up.start()


def finish_warm_up() -> None:
    """Wait for the warm-up (starting it if nobody did): forked build workers inherit its result."""
    start_warm_up()
    assert _warm_up is not None
    _warm_up.join()


def build_pool(workers: int, spawn: bool = True) -> concurrent.futures.ProcessPoolExecutor | None:
    """Processes that build kernels at once, as Inductor's compile workers do. Forked where the
    platform can: a build touches no tensor and no device, and a fork starts in milliseconds where
    a fresh interpreter imports torch and Triton again (seconds); else spawned when `spawn` allows.
    None where no worker can start (a daemonic process, or no fork and no spawn allowed)."""
    if multiprocessing.current_process().daemon:
        return None
    methods = multiprocessing.get_all_start_methods()
    if "fork" not in methods and not spawn:
        return None
    context = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    return concurrent.futures.ProcessPoolExecutor(workers, mp_context=context)


@contextlib.contextmanager
def quiet_forks() -> Iterator[None]:
    """Around the submits that start a pool's workers: Python 3.12+ warns on any fork of a
    threaded process, and a build worker uses no thread it did not start."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*fork.*", category=DeprecationWarning)
        yield
