"""The attention template: softmax(score(Q @ K^T)) @ V, flash-attention style.

A program takes a tile of BLOCK_M queries of one batch element (batch and head) and walks the
keys in blocks of BLOCK_N: the scores of the tile against a block (a tensor-core dot over the
whole head dim), the score's modifications (scaling, masks, biases: codegen prints them from
the graph), then an online softmax: the running row max `m_i`, the running sum of exponentials
`l_i` and the output accumulator are rescaled whenever the max grows, and the block's
probabilities are multiplied with its values into the accumulator (a second dot). The score
matrix never reaches memory. After the last block, the accumulator over `l_i` is the output
tile, and codegen's epilogue (the consumers of the output) runs on it before the stores.

Codegen (codegen/triton/attention.py) fills the holes: the batch index's dims, the loads (and
cheap pointwise work) of the query tile [BLOCK_M, BLOCK_D], the key tile [BLOCK_D, BLOCK_N] and
the value tile [BLOCK_N, BLOCK_E] (the prologue), the score modification on `qk`, and the
epilogue.
"""

from __future__ import annotations

import dataclasses

import torch

from gjit.kernels.matmul import power_of_2


@dataclasses.dataclass(frozen=True)
class AttentionBlocks:
    """One configuration: queries per tile, keys per step, the head dims padded to powers of 2,
    and the warps that share a tile."""

    m: int
    n: int
    d: int
    e: int
    warps: int = 4
    stages: int | None = None  # key steps in flight (None: Triton's default)

    def as_constexprs(self) -> dict[str, int]:
        return {"BLOCK_M": self.m, "BLOCK_N": self.n, "BLOCK_D": self.d, "BLOCK_E": self.e}


# (widest head dim, queries per tile, keys per step, warps), by operand width: the largest tiles
# that build for sm_90 without spills even with every stride a size argument (tests/test_aot.py);
# 16-bit tiles of 64 queries use Hopper's wgmma, float32 (IEEE, no TF32) has no tensor-core dot.
TILES = {
    "16-bit": ((64, 64, 32, 8), (128, 64, 32, 8), (256, 16, 16, 4)),
    "float32": ((64, 16, 16, 4), (128, 16, 16, 8)),  # wider float32 heads spill: ATen runs them
}


def attention_blocks(queries: int, keys: int, dim: int, dim_v: int, dtype: torch.dtype) -> AttentionBlocks:
    """Tile sizes for (example) sizes: `queries` x `keys` scores over head dims `dim` (query/key)
    and `dim_v` (value), from TILES; no larger than the problem (at least 16, tl.dot's smallest)."""
    d, e = max(16, power_of_2(dim)), max(16, power_of_2(dim_v))
    wide = "16-bit" if dtype in (torch.float16, torch.bfloat16) else "float32"
    _, block_m, block_n, warps = next(t for t in TILES[wide] if max(d, e) <= t[0])
    if queries <= 16 and wide == "16-bit":  # a decode step's few queries: fewer threads
        warps = 4
    block_m = min(block_m, max(16, power_of_2(queries)))
    block_n = min(block_n, max(16, power_of_2(keys)))
    return AttentionBlocks(block_m, block_n, d, e, warps)


# Configurations a GPU measures besides the table's (gjit/tuning.py), by operand width: (queries
# per tile, keys per step, warps, stages), clipped to the problem. Flash-attention kernels on
# Hopper take 128 queries and 64 or 128 keys per step; a decode step's one query wants few warps.
CANDIDATES = {
    "16-bit": ((128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 4, 3)),
    "float32": ((64, 32, 4, 2), (32, 32, 4, 3)),
}


def attention_configs(
    queries: int, keys: int, dim: int, dim_v: int, dtype: torch.dtype
) -> list[AttentionBlocks]:
    """The table's tiles (attention_blocks) first, then the CANDIDATES a GPU measures, clipped to
    the problem; no duplicates."""
    first = attention_blocks(queries, keys, dim, dim_v, dtype)
    out = [first]
    wide = "16-bit" if dtype in (torch.float16, torch.bfloat16) else "float32"
    for block_m, block_n, warps, stages in CANDIDATES[wide]:
        blocks = AttentionBlocks(
            min(block_m, max(16, power_of_2(queries))),
            min(block_n, max(16, power_of_2(keys))),
            first.d,
            first.e,
            warps,
            stages,
        )
        if all((b.m, b.n, b.warps) != (blocks.m, blocks.n, blocks.warps) for b in out):
            out.append(blocks)
    return out


def tile_order(index_dtype: str, causal: bool = False) -> list[str]:
    """The template's first lines: which batch element and query tile (`tile_m`) this program
    computes. Causal, a batch element's tiles run last row first: the tiles that see the most keys
    start first, and the last programs of the launch are short ones (flash attention's order)."""
    pid = "tl.program_id(0)" if index_dtype == "int32" else "tl.program_id(0).to(tl.int64)"
    tile = "tiles_m - 1 - pid % tiles_m" if causal else "pid % tiles_m"
    return [
        f"pid = {pid}",
        "tiles_m = (L + BLOCK_M - 1) // BLOCK_M",
        "batch = pid // tiles_m",
        f"tile_m = {tile}",
        "rm = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)",
    ]


def template(
    head: list[str],
    query: list[str],
    key: list[str],
    score: list[str],
    value: list[str],
    dot_options: tuple[str, str],
    probs_type: str,
    empty_rows: str,
    epilogue: list[str],
    causal: bool = False,
    full_score: list[str] | None = None,
    base_2: bool = True,
) -> list[str]:
    """The kernel body: `head` (tile order, batch dims), the query tile `q` (its lines end in the
    assignment), the loop over key blocks around the key tile `k`, the score block `s` and the
    value tile `v`, the online softmax, then the output tile `out` and the epilogue on it. Each
    dot has its options (`dot_options`: q @ k, p @ v); the probabilities enter the second dot as
    `probs_type`, the value tile's dtype.

    With `base_2`, the score lines give `s` in base-2 units (the score times log2(e), codegen folds
    the factor into the score's scale): the softmax takes exp2, one instruction, where exp is a
    multiply and an exp2. Without (a score that may hold finfo.min, which overflows in base 2),
    `s` is the score itself and the softmax takes exp. `full_score`, where codegen has it, is the
    score of a block with nothing to mask: every key in range and, causal, at or before the
    tile's first query. Those blocks run first, in a loop of their own (flash attention's blocks
    off the diagonal), and `score`, which masks, only in the blocks after them.

    A row whose scores so far are all -inf (masked) keeps the max at -inf; its exponentials are
    taken against 0 instead (exp(-inf) = 0, never -inf - -inf = NaN), so it adds nothing. A row
    masked to the end has l_i = 0: 0/0 = NaN, as softmax gives, or zeros where `empty_rows` is
    "zero", as scaled_dot_product_attention gives. A NaN score makes its row NaN, as in eager."""
    # rows past the end are not stored; with no keys at all the product is 0, as eager's
    finish = "out = acc / tl.where((rm < L) & (S > 0), l_i, 1.0)[:, None]"
    if empty_rows == "zero":  # acc is 0 where l_i is
        finish = "out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]"
    # keys past the tile's last query are all masked: no block after them
    keys_end = "tl.minimum(S, (tile_m + 1) * BLOCK_M)" if causal else "S"
    # blocks wholly before the tile's first query and before S
    full_end = "tl.minimum(tile_m * BLOCK_M, S) // BLOCK_N * BLOCK_N" if causal else "S // BLOCK_N * BLOCK_N"

    exp, base = ("tl.exp2", " in base 2") if base_2 else ("tl.exp", "")

    def step(what: str, score_lines: list[str]) -> list[str]:
        return [
            "    rn = n0 + tl.arange(0, BLOCK_N)",
            "    # the key tile [BLOCK_D, BLOCK_N] (prologue)",
            *(f"    {ln}" for ln in key),
            f"    qk = tl.dot(q, k{dot_options[0]})",
            f"    # the score block [BLOCK_M, BLOCK_N]{what}",
            *(f"    {ln}" for ln in score_lines),
            f"    # online softmax{base}: rescale what is summed so far when the row max grows",
            "    m_new = tl.maximum(m_i, tl.max(s, 1))",
            "    m_use = tl.where(m_new == float('-inf'), 0.0, m_new)",
            f"    p = {exp}(s - m_use[:, None])",
            f"    alpha = {exp}(m_i - m_use)",
            "    l_i = l_i * alpha + tl.sum(p, 1)",
            "    # the value tile [BLOCK_N, BLOCK_E] (prologue)",
            *(f"    {ln}" for ln in value),
            f"    acc = tl.dot(p.to({probs_type}), v, acc * alpha[:, None]{dot_options[1]})",
            "    m_i = m_new",
        ]

    if full_score is None:
        loops = [
            f"keys_end = {keys_end}",
            "for n0 in range(0, keys_end, BLOCK_N):",
            *step(": the graph's scaling, masks and biases", score),
        ]
    else:
        loops = [
            f"keys_end = {keys_end}",
            f"full_end = {full_end}",
            "for n0 in range(0, full_end, BLOCK_N):",
            *step(
                " of keys all in range and before the tile's first query: no bound or causal mask"
                if causal
                else " of keys all in range: no bound mask",
                full_score,
            ),
            "for n0 in range(full_end, keys_end, BLOCK_N):",
            *step(": the graph's scaling, masks and biases", score),
        ]
    return [
        *head,
        "# the query tile [BLOCK_M, BLOCK_D] (prologue), loaded once",
        *query,
        "m_i = tl.full([BLOCK_M], float('-inf'), tl.float32)",
        "l_i = tl.zeros([BLOCK_M], tl.float32)",
        "acc = tl.zeros([BLOCK_M, BLOCK_E], tl.float32)",
        *loops,
        finish,
        "# the epilogue, on the output tile",
        *epilogue,
    ]
