"""The matmul template: a tiled product of two operands with fp32 accumulation on tensor cores.

Codegen (codegen/triton/matmul.py) fills the template's holes with code it prints from the
region: how the batch index splits into the batch dims, the loads (and cheap pointwise work) of
a [BLOCK_M, BLOCK_K] tile of the left operand and a [BLOCK_K, BLOCK_N] tile of the right one at
k offset `k0` (the prologue), and the epilogue: the pointwise nodes that consume the product,
computed on the accumulator tile, and the stores. Program ids walk the output tiles in groups of
GROUP_M rows of tiles, so the right operand's columns a group reads stay in L2.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class MatmulBlocks:
    """One configuration of the template: tile sizes and the tile-order group."""

    m: int
    n: int
    k: int
    group_m: int = 8
    warps: int = 4
    stages: int | None = None  # software-pipelined k steps in flight (None: Triton's default)

    def as_constexprs(self) -> dict[str, int]:
        return {"BLOCK_M": self.m, "BLOCK_N": self.n, "BLOCK_K": self.k, "GROUP_M": self.group_m}


def power_of_2(n: int) -> int:
    """The smallest power of 2 >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 2 ** (n - 1).bit_length()


def matmul_blocks(m: int, n: int, k: int, dtype: torch.dtype) -> MatmulBlocks:
    """Tile sizes for a product of (example) sizes [m x k] @ [k x n] in `dtype`, from a small table
    by shape class: a tile no larger than the product (at least 16, tl.dot's smallest), at most
    64 x 64 x 16 for float32 (8 warps: float32 dots run on the FMA units, a thread holds more of
    each tile) and 64 x 128 x 32 for 16-bit operands (Triton's default 4 warps): those build for
    sm_90 without spills even when every stride is a size argument (tests/test_aot.py checks it)."""
    wide = dtype in (torch.float16, torch.bfloat16)
    block_m = min(64, max(16, power_of_2(m)))
    block_n = min(128 if wide else 64, max(16, power_of_2(n)))
    block_k = min(32 if wide else 16, max(16, power_of_2(k)))
    return MatmulBlocks(block_m, block_n, block_k, warps=4 if wide else 8)


SHARED_MEMORY = 96 * 1024  # what a configuration's operand buffers may take: below every GPU's
# shared memory per block from sm_80 (99 KB on sm_86/sm_89, 163 KB on sm_80, 227 KB on sm_90)
DEFAULT_STAGES = 3  # Triton's num_stages on NVIDIA GPUs when a kernel names none


def fit_stages(blocks: MatmulBlocks, itemsize: int, loops: int = 1) -> MatmulBlocks:
    """`blocks` with no more k steps in flight than fit SHARED_MEMORY: each stage buffers a
    [BLOCK_M, BLOCK_K] and a [BLOCK_K, BLOCK_N] tile of `itemsize` bytes, per k loop (products
    launched together each keep their own: `loops`); at least one."""
    stage = (blocks.m * blocks.k + blocks.k * blocks.n) * itemsize * loops
    stages = blocks.stages or DEFAULT_STAGES
    fit = max(1, min(stages, SHARED_MEMORY // stage))
    return blocks if fit == stages else dataclasses.replace(blocks, stages=fit)


def row_blocks(m: int, n: int, k: int, dtype: torch.dtype) -> MatmulBlocks:
    """Tiles for a product whose epilogue reduces each output row (a norm after a linear,
    gjit/fusion/rows.py): BLOCK_N covers the row (N at most 1024, 512 in float32), and as many rows
    as keep a tile at 8192 elements (16 at least: tl.dot's smallest), so the accumulator and the
    norm's values on it fit the registers; k steps as the table's (16 from 512 columns, so two fit
    SHARED_MEMORY), 8 warps from 256 columns."""
    wide = dtype in (torch.float16, torch.bfloat16)
    block_n = max(16, power_of_2(n))
    block_m = max(16, min(64, power_of_2(m), 8192 // block_n))
    block_k = min(32 if wide and block_n < 512 else 16, max(16, power_of_2(k)))  # 2 stages fit
    return MatmulBlocks(block_m, block_n, block_k, warps=8 if block_n >= 256 or not wide else 4)


# Configurations a GPU measures besides the table's (gjit/tuning.py), by operand width: (m, n, k,
# warps, stages), clipped to the problem. Large 16-bit products want 128-row tiles, k steps of 64
# and three or four tiles in flight (Hopper's tensor cores); few rows (a decode step) want narrow
# m and long k steps; float32 (IEEE) dots run on the FMA units and want smaller k steps.
CANDIDATES = {
    "16-bit": ((128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 32, 4, 4), (64, 128, 64, 4, 4)),
    "16-bit few rows": ((16, 128, 128, 4, 4), (32, 64, 128, 4, 4), (16, 256, 64, 4, 3)),
    "float32": ((128, 64, 32, 8, 3), (64, 128, 32, 8, 3), (64, 64, 32, 4, 4)),
}


def matmul_configs(m: int, n: int, k: int, dtype: torch.dtype) -> list[MatmulBlocks]:
    """The table's tiles (matmul_blocks) first, then the CANDIDATES a GPU measures, each clipped to
    the problem (no tile past the next power of 2 of its size, at least 16); no duplicates."""
    wide = dtype in (torch.float16, torch.bfloat16)
    shape = "float32" if not wide else "16-bit few rows" if m <= 32 else "16-bit"
    out = [matmul_blocks(m, n, k, dtype)]
    for bm, bn, bk, warps, stages in CANDIDATES[shape]:
        blocks = MatmulBlocks(
            min(bm, max(16, power_of_2(m))),
            min(bn, max(16, power_of_2(n))),
            min(bk, max(16, power_of_2(k))),
            warps=warps,
            stages=stages,
        )
        if all((b.m, b.n, b.k) != (blocks.m, blocks.n, blocks.k) for b in out):
            out.append(blocks)
    return out


def tile_order(index_dtype: str, has_batch: bool, widths: list[str]) -> list[str]:
    """The template's first lines: which output tile (and batch element) this program computes.
    `widths`: the N of each product the kernel computes (several share the left operand: the
    column tiles of the first, then of the next; each product's branch sets its `rn`)."""
    pid = "tl.program_id(0)" if index_dtype == "int32" else "tl.program_id(0).to(tl.int64)"
    lines = [f"pid = {pid}", "tiles_m = (M + BLOCK_M - 1) // BLOCK_M"]
    if len(widths) == 1:
        lines.append("tiles_n = (N + BLOCK_N - 1) // BLOCK_N")
    else:
        lines += [f"tiles_n{p} = ({n} + BLOCK_N - 1) // BLOCK_N" for p, n in enumerate(widths)]
        lines.append("tiles_n = " + " + ".join(f"tiles_n{p}" for p in range(len(widths))))
    if has_batch:
        lines += ["batch = pid // (tiles_m * tiles_n)", "pid = pid % (tiles_m * tiles_n)"]
    lines += [
        "# GROUP_M rows of tiles at a time: the right operand's columns they read stay in L2",
        "group = pid // (GROUP_M * tiles_n)",
        "first_m = group * GROUP_M",
        "group_m = tl.minimum(tiles_m - first_m, GROUP_M)",
        "pid_m = first_m + (pid % (GROUP_M * tiles_n)) % group_m",
        "pid_n = (pid % (GROUP_M * tiles_n)) // group_m",
        "rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)",
    ]
    if len(widths) == 1:
        lines.append("rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)")
    return lines


def shared_lhs(widths: list[str], products: list[list[str]]) -> list[str]:
    """Products of one left operand in one kernel: a program's column tile `pid_n` is one of
    the first product's (N = widths[0]), or of the next's after those, ...; the program runs
    that product's lines (prologue, k loop, epilogue) only."""
    lines: list[str] = []
    for p, (width, body) in enumerate(zip(widths, products)):
        before = " + ".join(f"tiles_n{q}" for q in range(p)) or "0"
        if p == len(widths) - 1:
            lines.append(f"else:  # product {p}")
        else:
            cond = "if" if p == 0 else "elif"
            lines.append(f"{cond} pid_n < {' + '.join(f'tiles_n{q}' for q in range(p + 1))}:  # product {p}")
        first = "pid_n" if p == 0 else f"(pid_n - ({before}))"
        inner = [f"N = {width}", f"rn = {first} * BLOCK_N + tl.arange(0, BLOCK_N)", *body]
        lines += [f"    {ln}" for ln in inner]
    return lines


def template(
    head: list[str],
    lhs: list[str],
    lhs_value: str,
    rhs: list[str],
    rhs_value: str,
    dot_options: str,
    epilogue: list[str],
) -> list[str]:
    """The kernel body: `head` (tile order, batch dims), the k loop around the operand tiles'
    lines and values (`lhs_value`, `rhs_value`: each zero outside its tile's mask, so what a
    masked-off lane would compute never reaches the sum, and in the dot's dtype), the dot, then
    the epilogue on `acc`."""
    loop = [
        "acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)",
        "for k0 in range(0, K, BLOCK_K):",
        "    # the left operand's tile [BLOCK_M, BLOCK_K] (prologue)",
        *(f"    {ln}" for ln in lhs),
        f"    a = {lhs_value}",
        "    # the right operand's tile [BLOCK_K, BLOCK_N] (prologue)",
        *(f"    {ln}" for ln in rhs),
        f"    b = {rhs_value}",
        f"    acc = tl.dot(a, b, acc{dot_options})",
        "# the epilogue, on the output tile",
    ]
    return head + loop + epilogue
