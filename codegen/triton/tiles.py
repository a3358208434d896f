"""A Triton reduction kernel's tile: XBLOCK rows by RBLOCK elements of each, its warps, and
whether a row stays in registers (persistent) or is walked in chunks (looped).

The tile follows how memory runs along a row (`ReductionPlan.walk`):

  inner (a row is contiguous: softmax, layer norm, a sum over the last dim):
    persistent up to `persistent_max` elements, a tile of about 1024 elements (a longer row, one
    row a program over enough warps that each thread holds 16 elements, up to 16 warps);
    longer rows one row a program, chunks of 2048 elements over 8 warps: 8 elements a thread,
    and the row's second pass (a softmax's output, a norm's) finds it in L2, not in memory.
    A static row of up to MEASURED_PERSISTENT elements past `persistent_max` has both: looped
    (configuration 0, the table's) and persistent (1), which tuning times on the card
    (`measured_persistent`; gjit/choice/row_kernels.py);
  outer (the kept dims are contiguous: a sum over the first dim):
    a tile wide along the kept dims, short along the reduced one, 512 elements: each of its
    rows 128 elements, narrower where that leaves too few programs to fill the card, but at
    least 64 bytes of contiguous memory (16-byte vector loads, two 32-byte sectors); persistent
    only when the whole row fits that short side (then as wide as the tile allows).

`GJIT_RBLOCK` (a non-zero `rblock`) forces a looped kernel's chunk, as tests do to walk short rows
in several steps.
"""

from __future__ import annotations

import dataclasses

from gjit.codegen.common import next_power_of_2
from gjit.config import CompileOptions

TILE = 1024  # elements of an inner persistent tile
LONG_ROW_CHUNK = 2048  # elements of a long row's chunk, one row a program
LONG_ROW_WARPS = 8
PERSISTENT_PER_THREAD = 16  # a persistent row longer than a tile: warps so each thread holds this many
MAX_WARPS = 16
OUTER_TILE = 512  # elements of an outer tile (4 a thread at 4 warps)
OUTER_PROGRAMS = 512  # enough programs for about four per SM of a 132-SM card
LEAST_RUN = 64  # bytes: the least contiguous run an outer tile's row reads
# the longest row a persistent kernel may hold (16 warps of 16 elements a thread) where tuning
# weighs it against the looped one: on an H200 (2026-11-28) a float32 layer norm over 16384 rows
# of 8192 took 0.322 ms looped and 0.262 persistent, torch.compile's 0.254
MEASURED_PERSISTENT = 8192


@dataclasses.dataclass(frozen=True)
class RowTiles:
    xblock: int
    rblock: int
    persistent: bool
    num_warps: int = 4
    walk: str = "inner"

    def text(self) -> str:
        """The kernel header's line."""
        warps = f", {self.num_warps} warps" if self.num_warps != 4 else ""
        walk = "rows contiguous" if self.walk == "inner" else "kept dims contiguous, tiles span rows"
        return f"tile: {self.xblock} rows x {self.rblock} elements{warps} ({walk})"


def reduction_tiles(
    walk: str,
    xhint: int,
    rhint: int,
    persistent: bool,
    r_static: bool,
    itemsize: int,
    options: CompileOptions,
) -> RowTiles:
    """The tile of a reduction kernel of `xhint` rows of `rhint` elements (example sizes) whose
    narrowest data is `itemsize` bytes; `persistent`: what the row length and the setting allow."""
    xmax = next_power_of_2(max(xhint, 1))
    rmax = next_power_of_2(max(rhint, 1))
    if walk == "outer" and options.reduction != "persistent":
        xblock = outer_xblock(xhint, itemsize)
        rblock = max(1, min(OUTER_TILE // xblock, rmax))
        if persistent and r_static and rmax <= rblock:  # a short row: the whole tile across rows
            return RowTiles(min(xmax, max(xblock, OUTER_TILE // rmax)), rmax, True, walk=walk)
        return RowTiles(xblock, options.rblock or rblock, False, walk=walk)
    if persistent:
        warps = min(MAX_WARPS, max(4, rmax // (32 * PERSISTENT_PER_THREAD)))
        return RowTiles(min(xmax, max(1, TILE // rmax)), rmax, True, warps, walk)
    if options.rblock:
        return RowTiles(min(xmax, max(1, TILE // options.rblock)), options.rblock, False, walk=walk)
    rblock = min(LONG_ROW_CHUNK, rmax)
    if rblock < LONG_ROW_CHUNK:  # a short row looped because the setting says so
        return RowTiles(min(xmax, max(1, TILE // rblock)), rblock, False, walk=walk)
    return RowTiles(1, rblock, False, LONG_ROW_WARPS, walk)


def measured_persistent(
    walk: str, rhint: int, persistent: bool, r_static: bool, options: CompileOptions
) -> bool:
    """Whether a reduction kernel of rows of `rhint` elements (example sizes) is emitted in two
    configurations, looped (0) and persistent (1), for tuning to time on the card: an inner row
    the table loops over (longer than `persistent_max`) of at most MEASURED_PERSISTENT elements, of
    a static length (a dynamic one would need a guard that the row fits the block), under the
    "auto" reduction setting without a forced chunk (`rblock`)."""
    looped_by_the_table = options.reduction == "auto" and not options.rblock and not persistent
    return walk == "inner" and looped_by_the_table and r_static and rhint <= MEASURED_PERSISTENT


def outer_xblock(xhint: int, itemsize: int) -> int:
    """Rows of an outer tile: 128, halved while that leaves fewer than OUTER_PROGRAMS programs,
    never below LEAST_RUN bytes nor above the rows there are."""
    least = max(1, LEAST_RUN // itemsize)
    xblock = 128
    while xblock > least and -(-xhint // xblock) < OUTER_PROGRAMS:
        xblock //= 2
    return max(1, min(xblock, next_power_of_2(max(xhint, 1))))
