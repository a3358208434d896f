"""Where a template beat the library, measured on a card: the table the per-region choice reads
when nothing can be measured (tuning off, `gjit.aot` for a card that is not there, a package
built without measuring; gjit/choice/). Everywhere else the library runs (cuBLAS, SDPA), so
an entry is only a measurement on a real card, at its sizes, of the region as it fused: the
template's kernel (in the configuration it ran in) against the library's kernels plus the
generated kernels that carry what the template fused. A region matches an entry exactly: the
card's compute capability, the kind, the operand dtype, the sizes at the call (the product's
(batch..., M, N, K), an attention's (batch..., L, Ev, S, D)), the ATen ops of every node the
region computes, and for float32 whether TF32 was allowed.

What the H200 leases measured where the library won is the table's silence: BERT's 768 x 768
bf16 linear + residual (template 0.032 ms, ATen 0.024), GPT-2's qkv (0.041 in its best tiles
against 0.028), every causal and non-causal SDPA, float32 on the FMA units (6x cuBLAS).
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class Win:
    """One measurement where the template was faster than the library's kernels."""

    capability: int  # the card's compute capability, major * 10 + minor (sm_90: 90)
    card: str
    kind: str  # "matmul" | "attention"
    dtype: torch.dtype  # the operands'
    sizes: tuple[int, ...]
    ops: tuple[str, ...]  # sorted: the ATen op of every node the region computes
    config: int  # the template's tile configuration that ran (codegen's index into its candidates)
    tiles: str  # that configuration, for people
    template_ms: float
    aten_ms: float
    source: str
    causal: bool = False  # an attention's causal mask (sdpa's is_causal)
    tf32: bool | None = None  # float32 products: TF32 allowed; None for 16-bit operands

    def provenance(self) -> str:
        return f"{self.card}, {self.source}"


WINS = (
    # bench/gpu_templates.py "llama down (linear+residual)": x[2048, 11008] @ w^T + b + r, bfloat16
    Win(
        90, "NVIDIA H200", "matmul", torch.bfloat16, (2048, 4096, 11008), ("add", "addmm", "addmm"),
        config=2, tiles="128 x 256 x 64, 8 warps, 3 stages", template_ms=0.242, aten_ms=0.258,
        source="docs/bench.md, third lease: the template in its measured tiles (GEMM, bias and "
        "residual in one kernel) against cuBLAS's GEMM plus the add kernel",
    ),
    # bench/gpu_templates.py "bert eager attention": softmax(q @ k^T / 8) @ v written out, B32 H12
    # L128 S128 D64, bfloat16 (the batch and head dims flattened by matmul's reshapes: 384)
    Win(
        90, "NVIDIA H200", "attention", torch.bfloat16, (384, 128, 64, 128, 64),
        ("_softmax", "_softmax", "_softmax", "bmm", "bmm", "mul"),
        config=0, tiles="the table's", template_ms=0.026, aten_ms=0.102,
        source="docs/bench.md, first lease: whole calls, the attention template against the two "
        "bmm externs and gjit's softmax kernel",
    ),
)  # fmt: skip


def lookup(
    capability: int | None,
    kind: str,
    dtype: torch.dtype,
    sizes: tuple[int, ...],
    ops: tuple[str, ...],
    causal: bool = False,
    tf32: bool | None = None,
) -> Win | None:
    """The entry measured for exactly this region on a card of `capability`, or None."""
    for win in WINS:
        key = (win.capability, win.kind, win.dtype, win.sizes, win.ops, win.causal, win.tf32)
        if key == (capability, kind, dtype, tuple(sizes), tuple(ops), causal, tf32):
            return win
    return None


def candidate_sizes(capability: int | None) -> set[tuple[torch.dtype, tuple[int, ...]]]:
    """(dtype, sizes) of the entries for a card: before fusion, a product of none of these sizes
    cannot match, so it is lowered as an extern at once."""
    return {(w.dtype, w.sizes) for w in WINS if w.capability == capability}
