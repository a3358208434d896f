"""libdevice for Triton's CPU interpreter.

Generated kernels call `libdevice.tanh`, `libdevice.expm1`, ... exactly as they do on a GPU.
Triton's interpreter does not implement extern (libdevice) calls, so this module gives
the interpreter's builder an implementation of `create_extern_elementwise` that maps each
libdevice symbol to the same function evaluated by torch in float64 and rounded to the
argument's precision. The kernel source is unchanged: what the tests run is what a GPU runs,
and `tests/test_interpret_libdevice.py` checks these stand-ins against float64 references.
`load_module` imports a kernel file either way.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import dataclasses
import functools
import os
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import triton

from gjit.codegen.toolchain.files import import_file


@functools.cache
def _libm(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The C library's double `name` over a float64 tensor: glibc's Bessel functions are accurate
    to a few ulp where torch's float64 ones lose up to 1e-5 (relatively) near their zeros."""
    fn = getattr(ctypes.CDLL(ctypes.util.find_library("m")), name)
    fn.restype, fn.argtypes = ctypes.c_double, [ctypes.c_double]
    return lambda x: torch.tensor([fn(v) for v in x.reshape(-1).tolist()], dtype=torch.float64).reshape(
        x.shape
    )


def _bessel(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: _libm(name)(x)


# libdevice function name (without __nv_ and precision suffix) -> float64 implementation
LIBDEVICE: dict[str, Callable[..., torch.Tensor]] = {
    "tan": torch.tan,
    "tanh": torch.tanh,
    "sinh": torch.sinh,
    "cosh": torch.cosh,
    "asin": torch.asin,
    "acos": torch.acos,
    "atan": torch.atan,
    "asinh": torch.asinh,
    "acosh": torch.acosh,
    "atanh": torch.atanh,
    "erfinv": torch.erfinv,
    "expm1": torch.expm1,
    "log1p": torch.log1p,
    "log10": torch.log10,
    "rsqrt": torch.rsqrt,
    "trunc": torch.trunc,
    "rint": torch.round,  # round half to even, like rint
    "pow": torch.pow,
    "atan2": torch.atan2,
    "copysign": torch.copysign,
    "fmod": torch.fmod,
    "signbit": lambda x: torch.signbit(x).to(torch.int32),
    "erfc": torch.erfc,
    "erfcx": torch.special.erfcx,
    "lgamma": torch.lgamma,
    "normcdfinv": torch.special.ndtri,
    "hypot": torch.hypot,
    "cyl_bessel_i0": torch.special.i0,
    "cyl_bessel_i1": torch.special.i1,
    "j0": _bessel("j0"),
    "j1": _bessel("j1"),
    "y0": _bessel("y0"),
    "y1": _bessel("y1"),
    "nextafter": torch.nextafter,
}
# functions whose result depends on the argument's precision: evaluated in it, not in float64
NATIVE = {"nextafter"}


def _lookup(symbol: str, float32: bool) -> Callable[..., torch.Tensor]:
    name = symbol.removeprefix("__nv_")
    if name.endswith("f" if float32 else "d") and name[:-1] in LIBDEVICE:
        name = name[:-1]  # tanhf, signbitd
    if name not in LIBDEVICE:
        raise NotImplementedError(f"libdevice symbol {symbol} has no interpreter implementation in gjit")
    return LIBDEVICE[name]


def create_extern_elementwise(self, lib_name, lib_path, symbol, arg_list, ret_type, is_pure):
    from triton.runtime.interpreter import TensorHandle, _get_np_dtype

    arrays = [np.asarray(a.data) for a in arg_list]
    float32 = any(a.dtype == np.float32 for a in arrays)
    fn = _lookup(symbol, float32)
    wide_dtype = np.float32 if float32 and symbol.removeprefix("__nv_")[:-1] in NATIVE else np.float64
    wide = [torch.from_numpy(np.ascontiguousarray(a, dtype=wide_dtype)) for a in np.broadcast_arrays(*arrays)]
    scalar_type = ret_type.scalar  # a block type when the arguments are blocks
    with np.errstate(over="ignore"):  # rounding to float32 overflows to inf, as on a GPU
        result = fn(*wide).numpy().astype(_get_np_dtype(scalar_type))
    return TensorHandle(result, scalar_type)


def _patch_lang_with_libdevice(patch_lang: Callable) -> Callable:
    """Wrap the interpreter's `_patch_lang(fn)`: besides `tl`, bind the `libdevice` stubs that
    `fn` sees to CUDA libdevice's externs, run by the interpreter's builder (restored after).
    Inside a kernel launch (`_Launch`) the launch holds the patch, the kernel's and its device
    functions', until it ends."""
    import triton.language
    from triton.language.extra import libdevice as stubs
    from triton.language.extra.cuda import libdevice as cuda_libdevice
    from triton.runtime import interpreter

    def scoped(fn):
        scope = patch_lang(fn)
        # a scalar argument as a loop bound (`range(0, rnumel, RBLOCK)`): Triton before 3.7 holds
        # it as a 1-element array, which NumPy 2.4 no longer converts with int(); newer Tritons
        # squeeze it, as here
        if hasattr(scope, "set_attr"):
            scope.set_attr(triton.language.core.tensor, "__index__", lambda t: int(t.handle.data.squeeze()))
        if any(value is stubs for value in fn.__globals__.values()):
            for name in dir(stubs):
                member = getattr(cuda_libdevice, name, None)
                if not name.startswith("_") and callable(member):
                    interpreter._patch_attr(stubs, name, member, interpreter.interpreter_builder, scope)
        return scope

    def patch(fn):
        launch = getattr(_launches, "current", None)
        if launch is None:  # outside a launch: the caller restores it (Triton's InterpretedFunction,
            return scoped(fn)  # a helper called from Python, never did)
        # the kernel, or a device function its programs call (Triton's InterpretedFunction: gjit's
        # helpers, which never restores; tl.sum): the launch restores it when it ends
        launch.hold(fn)
        return _Launch.HELD

    patch.gjit_libdevice = True
    patch.scoped = scoped
    return patch


_launches = threading.local()  # .current: the kernel launch in progress in this thread, if any
_RUNNING: list[_Launch] = []  # every thread's launches in progress, oldest first (a forked child undoes them)


class _Launch:
    """The patches of one interpreted kernel launch (`GridExecutor.__call__`, `_launching`): the
    kernel's own, then those of the device functions its programs call (tl.sum, tl.zeros, ...:
    Triton's standard library, interpreted; gjit's helpers), each module's made once a launch and
    put back, last first, when the launch ends, where each call of such a function patched and
    restored `tl.core` (hundreds of attributes) for itself: most of an interpreted reduction's
    time."""

    HELD = types.SimpleNamespace(restore=lambda: None)  # what a patch inside a launch hands back

    def __init__(self):
        self.held, self.modules = [], set()
        _launches.current = self
        _RUNNING.append(self)

    def hold(self, fn: Callable) -> None:
        """Patch what `fn` sees, unless a function of its module did this launch."""
        from triton.runtime import interpreter

        if id(fn.__globals__) not in self.modules:
            self.modules.add(id(fn.__globals__))
            self.held.append(interpreter._patch_lang.scoped(fn))

    def restore(self) -> None:
        while self.held:
            self.held.pop().restore()
        _launches.current = None
        _RUNNING.remove(self)


def _launching(call: Callable) -> Callable:
    """`GridExecutor.__call__` (a kernel launch: every program of its grid) as one `_Launch`."""

    def launch(self, *args, **kwargs):
        held = _Launch()
        try:
            return call(self, *args, **kwargs)
        finally:
            held.restore()

    launch.gjit_launch = True
    return launch


_STDLIB: dict[str, tuple] = {}


class _ScopedDeviceFunction:
    """An interpreted device function that undoes its patches of `tl` when its kernel launch ends,
    or when it returns if called outside one (Triton's own InterpretedFunction leaves them in
    place, which breaks later GPU compiles)."""

    def __init__(self, fn: Callable):
        from triton.runtime.interpreter import InterpretedFunction

        self.fn = fn
        self.interpreted = InterpretedFunction(fn)

    def __call__(self, *args, **kwargs):
        from triton.runtime import interpreter

        scope = interpreter._patch_lang(self.fn)  # held by the launch in progress, if any
        try:
            return self.interpreted.rewrite()(*args, **kwargs)
        finally:
            scope.restore()


# Triton's interpreter is process-wide: its one builder holds the program id of the block it runs,
# and an interpreted kernel patches `triton.language` itself while it runs (as does the swap
# below), so interpreted runs take turns: one thread's wrapper call at a time. Re-entrant: a
# torch.cond branch is a nested call. (Kernels on a GPU take no lock.)
_INTERPRETER = threading.RLock()
_depth = 0  # interpreted calls in progress (in the thread that holds _INTERPRETER)
_INSTALLING = threading.Lock()  # not _INTERPRETER: a load (holding graph.LOAD_LOCK) installs, and an
# interpreted call (holding _INTERPRETER) may load a torch.cond branch's wrapper


def _after_fork_in_child() -> None:
    """A fork has no interpreted run in progress (the thread that ran one is not in it), so `tl`'s
    helpers are Triton's own again: a build worker forked meanwhile compiles them for a GPU."""
    global _INTERPRETER, _depth
    while _RUNNING:  # `tl` as Triton has it, for the child's GPU builds
        _RUNNING[-1].restore()
    if _depth:
        _put_back_stdlib()
    _INTERPRETER, _depth = threading.RLock(), 0


os.register_at_fork(after_in_child=_after_fork_in_child)


@contextlib.contextmanager
def stdlib_interpreted() -> Iterator[None]:
    """Run with `tl`'s @jit standard-library helpers (tl.sigmoid, tl.zeros, tl.sum, ...) swapped
    for interpreted versions, holding the interpreter (one thread at a time, see _INTERPRETER).

    Triton builds those helpers when `triton.language` is imported; unless TRITON_INTERPRET
    was set then, they are GPU JITFunctions that an interpreted kernel cannot call. Swapping
    them only while interpreted kernels run keeps the process able to compile real GPU code.
    """
    global _depth
    with _INTERPRETER:
        _depth += 1
        try:
            if _depth > 1:  # a nested call runs inside the outer one's swap
                yield
            else:
                yield from _swapped_stdlib()
        finally:
            _depth -= 1


def _swapped_stdlib() -> Iterator[None]:
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    if not _STDLIB:
        for name in dir(tl):
            obj = getattr(tl, name)
            if isinstance(obj, JITFunction):
                _STDLIB[name] = (obj, _ScopedDeviceFunction(obj.fn))
    from triton.runtime.interpreter import interpreter_builder

    for name, (_, interpreted) in _STDLIB.items():
        setattr(tl, name, interpreted)
    options = interpreter_builder.options
    # device_assert only exists in kernels generated in debug mode; let the interpreter run them.
    # Integer adds and multiplies wrap as on the card and in eager, unchecked: the interpreter's
    # own overflow check (six more operations for each) asserts where int32 data wraps
    interpreter_builder.options = dataclasses.replace(options, debug=True, sanitize_overflow=False)
    try:
        yield
    finally:
        interpreter_builder.options = options
        _put_back_stdlib()


def _put_back_stdlib() -> None:
    import triton.language as tl

    for name, (original, _) in _STDLIB.items():
        setattr(tl, name, original)


def create_assert(self, condition, message):
    """Triton's interpreter asserts on the handle object (always true): check the values."""
    if not np.all(condition.data):
        raise AssertionError(message)


def _rounding_cast(cast_impl: Callable) -> Callable:
    """float32 (or float16) -> bfloat16 rounds to nearest even, as on a GPU (the interpreter's
    own conversion drops the low mantissa bits); every other cast is the interpreter's."""
    from triton.runtime.interpreter import TensorHandle

    def cast(self, src, dst_type):
        import triton.language as tl

        data = np.asarray(src.data)
        if dst_type.scalar != tl.bfloat16 or data.dtype not in (np.float32, np.float16):
            return cast_impl(self, src, dst_type)
        bits = torch.from_numpy(np.ascontiguousarray(data)).to(torch.bfloat16).view(torch.int16)
        return TensorHandle(bits.numpy().view(np.uint16), tl.bfloat16)

    cast.gjit_rounding = True
    return cast


def _boolean_result(compare: Callable) -> Callable:
    """A comparison's handle is int1: the interpreter tags it with its operands' dtype, so a
    scalar comparison splatted to a block (`scalar_cmp | block_cmp`) became float data."""
    from triton.runtime.interpreter import TensorHandle

    def create(self, lhs, rhs):
        import triton.language as tl

        return TensorHandle(np.asarray(compare(self, lhs, rhs).data, dtype=np.bool_), tl.int1)

    create.gjit_boolean = True
    return create


def _bfloat16_dot(dot: Callable) -> Callable:
    """tl.dot of bfloat16 tiles: the interpreter keeps bfloat16 as its uint16 bits and multiplies
    those; widen them to the float32 values first (a GPU's tensor cores multiply the values exactly
    into the float32 accumulator)."""
    from triton.runtime.interpreter import TensorHandle

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        import triton.language as tl

        def widened(h):
            if h.dtype.scalar != tl.bfloat16:
                return h
            bits = np.asarray(h.data).astype(np.uint32) << 16
            return TensorHandle(bits.view(np.float32), tl.float32)

        return dot(self, widened(a), widened(b), d, input_precision, max_num_imprecise_acc)

    create_dot.gjit_bfloat16 = True
    return create_dot


def _older_triton(builder: type) -> None:
    """What Triton's interpreter does as the compiler does since Triton 3.7 (the GPU image's 3.6 does
    not): a bfloat16 constant (`get_bf16`, absent before), and `tl.maximum`/`tl.minimum` without NaN
    propagation as LLVM's maxnum/minnum, the other operand where one is NaN (3.6 propagated it)."""
    import triton.language as tl

    if not hasattr(builder, "get_bf16"):
        builder.get_bf16 = lambda self, value: self.create_fp_trunc(self.get_fp32(value), tl.bfloat16)
    builder.create_maxnumf = lambda self, lhs, rhs: self.binary_op(lhs, rhs, np.fmax)
    builder.create_minnumf = lambda self, lhs, rhs: self.binary_op(lhs, rhs, np.fmin)


def install() -> None:
    """Teach Triton's interpreter libdevice (idempotent).

    Interpreted kernels see `triton.language.extra.libdevice`, whose functions are stubs that
    only the compiler resolves; while a kernel runs they are bound to CUDA libdevice's externs,
    whose `create_extern_elementwise` calls end here.
    """
    with _INSTALLING:  # two threads at once would wrap a method twice
        _install()


def _install() -> None:
    from triton.runtime import interpreter

    interpreter.InterpreterBuilder.create_extern_elementwise = create_extern_elementwise
    interpreter.InterpreterBuilder.create_assert = create_assert
    if not hasattr(interpreter.InterpreterBuilder.cast_impl, "gjit_rounding"):
        interpreter.InterpreterBuilder.cast_impl = _rounding_cast(interpreter.InterpreterBuilder.cast_impl)
    if not hasattr(interpreter.InterpreterBuilder.create_dot, "gjit_bfloat16"):
        interpreter.InterpreterBuilder.create_dot = _bfloat16_dot(interpreter.InterpreterBuilder.create_dot)
    _older_triton(interpreter.InterpreterBuilder)
    for name in dir(interpreter.InterpreterBuilder):
        compare = getattr(interpreter.InterpreterBuilder, name)
        if name.startswith(("create_icmp", "create_fcmp")) and not hasattr(compare, "gjit_boolean"):
            setattr(interpreter.InterpreterBuilder, name, _boolean_result(compare))
    if not getattr(interpreter._patch_lang, "gjit_libdevice", False):
        interpreter._patch_lang = _patch_lang_with_libdevice(interpreter._patch_lang)
    if not getattr(interpreter.GridExecutor.__call__, "gjit_launch", False):
        interpreter.GridExecutor.__call__ = _launching(interpreter.GridExecutor.__call__)


def load_module(path: str, extra: dict[str, Any] | None = None, interpret: bool = False) -> types.ModuleType:
    """Import a generated file; with `interpret`, its @triton.jit kernels become interpreted."""
    if not interpret:
        return import_file(path, extra)
    install()
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = True
        return import_file(path, extra, suffix="_interp")
