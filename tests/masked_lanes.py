"""Masked-off lanes of a load hold garbage in the tests, as on a GPU.

On a GPU, `tl.load(ptr, mask)` without `other` leaves the lanes where the mask is off undefined;
Triton's interpreter gives them 0, so a kernel that lets such a lane reach a sum, a max or an
index (and would be wrong on a GPU) passes on the CPU. The tests' interpreter instead fills them
with NaN (floats), 1031 (integers: out of range of the tests' indexed buffers) or True: any
kernel that reads a masked-off lane where it matters fails its comparison with eager, or its
bounds assert.
"""

from __future__ import annotations

import numpy as np


def poison_masked_loads() -> bool:
    """Patch Triton's interpreter (its builder's masked load); False where this Triton's
    interpreter does not have the internals it patches (the tests then run unpatched)."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    builder = getattr(interpreter, "InterpreterBuilder", None)
    real = getattr(builder, "create_masked_load", None)
    to_numpy = getattr(interpreter, "_get_np_dtype", None)
    handle = getattr(interpreter, "TensorHandle", None)
    if real is None or to_numpy is None or handle is None or getattr(real, "poisoned", False):
        return bool(getattr(real, "poisoned", False))

    def create_masked_load(self, ptrs, mask, other, *args, **kwargs):
        if other is None:
            dtype = ptrs.get_element_ty()
            np_dtype = to_numpy(dtype)
            if np.issubdtype(np_dtype, np.floating):
                fill = np.full_like(ptrs.data, np.nan, dtype=np_dtype)
            elif np_dtype == np.bool_:
                fill = np.ones_like(ptrs.data, dtype=np_dtype)
            else:  # past any buffer the tests index, small enough that its cube is no int32 overflow
                fill = np.full_like(ptrs.data, min(1031, np.iinfo(np_dtype).max), dtype=np_dtype)
            other = handle(fill, dtype)
        return real(self, ptrs, mask, other, *args, **kwargs)

    create_masked_load.poisoned = True
    builder.create_masked_load = create_masked_load
    return True
