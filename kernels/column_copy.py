"""The first N columns of a row-major [M, PITCH] tensor into a contiguous [M, N] one.

gjit/runtime/padded_mm.py computes a product whose rows would be misaligned into PITCH >= N
columns and copies its N columns out with this kernel, which the wrapper hands it by name
(`copy=gjit_column_copy`: the first call's prebuild builds it with the graph's kernels).

ATen's copy of that strided view runs its generic elementwise kernel, one element per load and
store: 0.48 ms for GPT-2's 4096 x 50257 fp16 logits on an H200 (1.7 TB/s). Here each program
writes BLOCK consecutive elements of the output and reads them through the row and column of each
(N and PITCH are compile-time constants: the division is a multiply). A block wholly inside the
output stores without a mask, 16 bytes at a time (the output and BLOCK are aligned); only the last
block masks each element. The loads are of one element, coalesced.
"""

import triton
import triton.language as tl


@triton.jit
def gjit_column_copy(src, dst, numel, N: tl.constexpr, PITCH: tl.constexpr, BLOCK: tl.constexpr,
                 WIDE: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    if WIDE:  # the padded tensor's rows * PITCH >= 2**31 (its offsets, not only the output's)
        pid = pid.to(tl.int64)
    offsets = pid * BLOCK + tl.arange(0, BLOCK)
    if (pid + 1) * BLOCK <= numel:  # every block but the last: no mask, so the stores are vectors
        tl.store(dst + offsets, tl.load(src + (offsets // N) * PITCH + offsets % N))
    else:
        mask = offsets < numel
        tl.store(dst + offsets, tl.load(src + (offsets // N) * PITCH + offsets % N, mask), mask)
