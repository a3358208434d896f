"""libdevice for Triton's CPU interpreter.

Generated kernels call `libdevice.tanh`, `libdevice.expm1`, ... exactly as they do on a GPU.
Triton's interpreter does not implement extern (libdevice) calls, so this module gives
the interpreter's builder an implementation of `create_extern_elementwise` that maps each
libdevice symbol to the same function evaluated by torch in float64 and rounded to the
argument's precision. The kernel source is unchanged: what the tests run is what a GPU runs,
and `tests/test_interpret_libdevice.py` checks these stand-ins against float64 references.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

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
}


def _lookup(symbol: str, float32: bool) -> Callable[..., torch.Tensor]:
    name = symbol.removeprefix("__nv_")
    if float32 and name.endswith("f") and name[:-1] in LIBDEVICE:
        name = name[:-1]
    if name not in LIBDEVICE:
        raise NotImplementedError(f"libdevice symbol {symbol} has no interpreter implementation in gjit")
    return LIBDEVICE[name]


def create_extern_elementwise(self, lib_name, lib_path, symbol, arg_list, ret_type, is_pure):
    from triton.runtime.interpreter import TensorHandle, _get_np_dtype

    arrays = [np.asarray(a.data) for a in arg_list]
    float32 = any(a.dtype == np.float32 for a in arrays)
    fn = _lookup(symbol, float32)
    wide = [torch.from_numpy(np.ascontiguousarray(a, dtype=np.float64)) for a in np.broadcast_arrays(*arrays)]
    out_np_dtype = _get_np_dtype(ret_type)
    result = fn(*wide).numpy().astype(out_np_dtype)
    return TensorHandle(result, ret_type)


def install() -> None:
    """Teach Triton's interpreter libdevice (idempotent)."""
    from triton.runtime.interpreter import InterpreterBuilder

    InterpreterBuilder.create_extern_elementwise = create_extern_elementwise
