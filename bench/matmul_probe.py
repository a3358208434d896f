"""Which matmul structure can reach cuBLAS on this card: a probe for the matmul template's next step.

    python bench/matmul_probe.py               # on a GPU: the benchmark models' linear layers
    python bench/matmul_probe.py --device cpu  # the kernels' numerics on small sizes (interpreted)

gjit's matmul template (kernels/matmul.py) loads its operand tiles through pointers and runs one
program per output tile; on an H200 its best configuration took 1.3-1.5x cuBLAS's time on GPT-2's
products (docs/bench.md). Hopper's known means are the tensor memory accelerator (TMA: a tile
copied to shared memory by one instruction, out-of-bounds elements zero) and a persistent grid (one
program per SM walks the tiles, so a tile's epilogue overlaps the next one's loads). This script
times, for each linear layer (y = x @ w.T + b, w as nn.Linear holds it, bias in the epilogue):

  pointers         the template's structure: masked pointer loads, one program per tile;
  tma              the same with both operands loaded through tensor descriptors;
  tma_persistent   TMA loads, one program per SM over the tiles (`tl.range(..., flatten=True)`);

each in two Hopper configurations (12 builds in all: about a minute), against
`torch.nn.functional.linear` (cuBLAS) in the same run. A variant this Triton cannot build shows
why. Every output is compared with torch's. (`tl.range(..., warp_specialize=True)` built the same
sm_90 kernel as without it under Triton 3.9: not a variant here.) tests/test_matmul_probe.py checks
the kernels on CPU and their sm_90 builds.
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

SHAPES = {  # name: (M, K, N, dtype): x [M, K] @ w [N, K].T + b
    "cuda": [
        ("gpt2 qkv", 4096, 768, 2304, torch.float16),
        ("gpt2 fc", 4096, 768, 3072, torch.float16),
        ("gpt2 proj", 4096, 3072, 768, torch.float16),
        ("bert out", 4096, 768, 768, torch.bfloat16),
        ("llama up", 4096, 2048, 5632, torch.bfloat16),
        ("llama down", 4096, 5632, 2048, torch.bfloat16),
    ],
    # float16 only: Triton's interpreter computes this kernel wrong in bfloat16 (not the card)
    "cpu": [("small", 200, 64, 96, torch.float16), ("ragged", 70, 48, 40, torch.float16)],
}
CONFIGS = {  # (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)
    "cuda": [(128, 256, 64, 8, 3), (128, 128, 64, 8, 4)],  # the H200's best for the template
    "cpu": [(32, 32, 16, 4, 2)],
}


@triton.jit
def _tile(tile, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """The (row, column) of output tile number `tile`, GROUP_M rows of tiles at a time."""
    tiles_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * tiles_n
    first_m = (tile // in_group) * GROUP_M
    rows = tl.minimum(tl.cdiv(M, BLOCK_M) - first_m, GROUP_M)
    return first_m + (tile % in_group) % rows, (tile % in_group) // rows


@triton.jit
def _epilogue(acc, bias, out, pid_m, pid_n, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    y = acc + tl.load(bias + rn, rn < N).to(tl.float32)
    tl.store(out + rm * N + rn, y.to(out.dtype.element_ty), (rm < M) & (rn < N))


@triton.jit
def linear_pointers(x, w, bias, out, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):  # fmt: skip
    pid_m, pid_n = _tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x + rm[:, None] * K + rk[None, :], (rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        b = tl.load(w + rn[None, :] * K + rk[:, None], (rn[None, :] < N) & (rk[:, None] < K), other=0.0)
        acc = tl.dot(a, b, acc)
    _epilogue(acc, bias, out, pid_m, pid_n, M, N, BLOCK_M, BLOCK_N)


@triton.jit
def linear_tma(x, w, bias, out, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):  # fmt: skip
    pid_m, pid_n = _tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    xs = tl.make_tensor_descriptor(x, shape=[M, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    ws = tl.make_tensor_descriptor(w, shape=[N, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K])
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        acc = tl.dot(xs.load([pid_m * BLOCK_M, k0]), ws.load([pid_n * BLOCK_N, k0]).T, acc)
    _epilogue(acc, bias, out, pid_m, pid_n, M, N, BLOCK_M, BLOCK_N)


@triton.jit
def linear_tma_persistent(x, w, bias, out, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, programs):  # fmt: skip
    xs = tl.make_tensor_descriptor(x, shape=[M, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    ws = tl.make_tensor_descriptor(w, shape=[N, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K])
    tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles, programs, flatten=True):
        pid_m, pid_n = _tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            acc = tl.dot(xs.load([pid_m * BLOCK_M, k0]), ws.load([pid_n * BLOCK_N, k0]).T, acc)
        _epilogue(acc, bias, out, pid_m, pid_n, M, N, BLOCK_M, BLOCK_N)


VARIANTS = ("pointers", "tma", "tma_persistent")


def launcher(variant: str, x, w, b, out, config, programs: int):
    """The launch of one variant in one configuration, as a callable."""
    bm, bn, bk, warps, stages = config
    m, k = x.shape
    n = w.shape[0]
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    common = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=stages)
    if variant in ("pointers", "tma"):
        kernel = linear_pointers if variant == "pointers" else linear_tma
        return lambda: kernel[(tiles,)](x, w, b, out, m, n, k, **common)
    grid = (min(programs, tiles),)
    return lambda: linear_tma_persistent[grid](x, w, b, out, m, n, k, **common, programs=grid[0])


def timed(fn, device: str) -> float:
    if device != "cuda":
        fn()
        return float("nan")
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=10, rep=50, return_mode="median"))


def best_of(variant: str, x, w, b, reference, device: str, programs: int) -> str:
    """The variant's best configuration: 'ms [config]', or why none ran right."""
    best, why = None, ""
    for config in CONFIGS[device]:
        out = torch.full_like(reference, float("nan"))
        try:
            launch = launcher(variant, x, w, b, out, config, programs)
            launch()
            tol = 2e-2 * max(1.0, reference.float().abs().max().item())
            if not torch.allclose(out.float(), reference.float(), atol=tol, rtol=0):
                why = f"WRONG in {config}"
                continue
            ms = timed(launch, device)
        except Exception as e:  # noqa: BLE001 - a variant or configuration this Triton cannot build
            why = f"{type(e).__name__}: {str(e).splitlines()[0][:60] if str(e) else ''}"
            continue
        if best is None or ms < best[0]:
            best = (ms, config)
    if best is None:
        return why
    return f"{best[0]:.3f} {list(best[1])}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda")
    device = parser.parse_args().device
    programs = torch.cuda.get_device_properties(0).multi_processor_count if device == "cuda" else 4
    # a device-side tensor descriptor takes global scratch memory, from an allocator Triton calls
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=device))
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreted: no times)"
    print(f"linear layers on {name}, torch {torch.__version__}, triton {triton.__version__}")
    print("| layer | M x K x N | dtype | cuBLAS ms | " + " | ".join(VARIANTS) + " |")
    print("|---|---|---|---:|" + "---|" * len(VARIANTS))
    torch.manual_seed(0)
    for label, m, k, n, dtype in SHAPES[device]:
        x = torch.randn(m, k, device=device).to(dtype)
        w = (torch.randn(n, k, device=device) / k**0.5).to(dtype)
        b = torch.randn(n, device=device).to(dtype)
        reference = torch.nn.functional.linear(x.float(), w.float(), b.float()).to(dtype)
        library = timed(lambda: torch.nn.functional.linear(x, w, b), device)  # noqa: B023
        cells = [best_of(v, x, w, b, reference, device, programs) for v in VARIANTS]
        dt = str(dtype).removeprefix("torch.")
        print(f"| {label} | {m} x {k} x {n} | {dt} | {library:.3f} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
