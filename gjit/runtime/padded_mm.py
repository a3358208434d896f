"""Matrix products whose output rows would start off the tensor cores' alignment.

cuBLAS picks its fast tensor-core kernels only when each row of the output starts on a 16-byte
boundary. A row-major output of N columns has rows N * itemsize bytes apart, so a 16-bit product
with N not a multiple of 8 (GPT-2's vocabulary of 50257, say) runs a slow fallback kernel: on an
H200, GPT-2's 4096 x 768 @ 768 x 50257 logits took 3.06 ms in that kernel against 0.46 ms in the
aligned one that torch.compile's program ran (bench/models_gpu.py, 2026-11-28).

The wrapper calls these instead of `aten.mm` / `aten.addmm` where the output's N is static and
misaligned (`gjit.wrapper.pads_product`): the right operand (and a bias) gets zero columns up to
`padded_columns`, the product runs aligned, and its first N columns are copied out to the layout
eager returns by kernels/column_copy.py (ATen's copy of the strided view took 0.48 ms for those
logits, 1.7 TB/s). (Writing the product into a padded view through `out=` does not help: ATen computes
into a contiguous buffer and copies, the same slow kernel; measured on the H200.) Products of few
rows keep ATen's own call: their kernels (gemv) do not mind the alignment, and the copies would
cost more than they save.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
import triton

from gjit import logs
from gjit.wrapper import padded_columns

log = logs.logger("output_code")
_FAILED: list[str] = []  # why the copy kernel could not run here, once: ATen copies from then on

LEAST_ROWS = 128  # fewer output rows: ATen's own call
COPY_BLOCK = 1024  # output elements per program of the copy out (Inductor's XBLOCK for a copy)


def _extra_columns(b: torch.Tensor) -> int:
    return padded_columns(b.shape[1], b.dtype) - b.shape[1]


def _padded_operand(b: torch.Tensor) -> torch.Tensor:
    """The right operand [K, N] with zero columns up to `padded_columns`: a weight read transposed
    (a linear's, N x K in memory) padded along its rows, a contiguous copy; any other b along its
    columns."""
    pad = _extra_columns(b)
    if b.stride(0) == 1 and b.stride(1) == b.shape[0]:
        return F.pad(b.t(), (0, 0, 0, pad)).t()
    return F.pad(b, (0, pad))


def mm(a: torch.Tensor, b: torch.Tensor, *, copy: Any) -> torch.Tensor:
    """`copy`: kernels/column_copy.py's kernel, as the graph loaded it (compiled or interpreted)."""
    if a.shape[0] < LEAST_ROWS:
        return torch.mm(a, b)
    return first_columns(torch.mm(a, _padded_operand(b)), b.shape[1], copy)


def addmm(
    bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: float = 1, alpha: float = 1, copy: Any
) -> torch.Tensor:
    if a.shape[0] < LEAST_ROWS or bias.dim() != 1 or bias.shape[0] != b.shape[1]:
        return torch.addmm(bias, a, b, beta=beta, alpha=alpha)
    out = torch.addmm(F.pad(bias, (0, _extra_columns(b))), a, _padded_operand(b), beta=beta, alpha=alpha)
    return first_columns(out, b.shape[1], copy)


def first_columns(padded: torch.Tensor, n: int, copy: Any) -> torch.Tensor:
    """The first `n` columns of a row-major [M, P] product, contiguous, by the kernel `copy`."""
    rows, pitch = padded.shape[0], padded.stride(0)
    assert padded.dim() == 2 and padded.stride(1) == 1, padded.stride()
    out = torch.empty((rows, n), dtype=padded.dtype, device=padded.device)
    numel = out.numel()
    if numel == 0:
        return out
    if _FAILED:
        return out.copy_(padded[:, :n])
    grid = (triton.cdiv(numel, COPY_BLOCK),)
    wide = rows * pitch >= 2**31  # the loads reach row * pitch, past the output's numel
    try:
        copy[grid](padded, out, numel, N=n, PITCH=pitch, BLOCK=COPY_BLOCK, WIDE=wide, num_warps=4)
    except Exception as e:  # it does not build here (another Triton): ATen's copy, the same values
        _FAILED.append(logs.error_line(e))
        log.warning("gjit: the padded products' copy kernel failed (%s); ATen copies them", _FAILED[0])
        return out.copy_(padded[:, :n])
    return out
