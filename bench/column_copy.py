"""The copy out of a padded product (gjit/runtime/padded_mm.py): kernels/column_copy.py against
ATen's copy of the same strided view, beside a plain copy of as many bytes (the card's copy rate).

    python bench/column_copy.py             # on a GPU: GPT-2's and BERT's logits, and a short one
    python bench/column_copy.py --device cpu  # the script itself, on small sizes (interpreted)

Each row: the [M, N] output, its padded pitch, ms of ATen's `padded[:, :N].contiguous()`, of the
kernel, of the plain copy, and the kernel's rate (bytes read and written a ms) as a fraction of the
plain copy's. The outputs are compared bit for bit.
"""

from __future__ import annotations

import argparse

import torch

from gjit.runtime.graph import LIBRARY_KERNELS, load_kernel
from gjit.runtime.padded_mm import first_columns
from gjit.wrapper import COLUMN_COPY, padded_columns

SHAPES = {  # rows, columns, dtype
    "cuda": [(4096, 50257, torch.float16), (4096, 30522, torch.bfloat16), (512, 50257, torch.float16)],
    "cpu": [(40, 257, torch.float16), (7, 300, torch.bfloat16)],
}


def timed(fn, device: str) -> float:
    if device != "cuda":
        fn()
        return float("nan")
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=200, return_mode="median"))


def row(rows: int, n: int, dtype: torch.dtype, kernel, device: str) -> str:
    """One shape's line of the table; the kernel's output checked against ATen's, bit for bit."""
    pitch = padded_columns(n, dtype)
    padded = torch.randn(rows, pitch, device=device).to(dtype)
    plain = torch.empty(rows, n, device=device, dtype=dtype)
    aten_out, ours = padded[:, :n].contiguous(), first_columns(padded, n, kernel)
    assert torch.equal(aten_out.view(torch.int16), ours.view(torch.int16)), "the kernel copied another thing"
    aten_ms = timed(lambda: padded[:, :n].contiguous(), device)
    ours_ms = timed(lambda: first_columns(padded, n, kernel), device)
    copy_ms = timed(lambda: torch.empty_like(plain).copy_(plain), device)
    name = str(dtype).removeprefix("torch.")
    times = f"{aten_ms:.3f} | {ours_ms:.3f} | {copy_ms:.3f} | {copy_ms / ours_ms:.2f}"
    return f"| {rows} x {n} | {name} | {pitch} | {times} |"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda")
    device = parser.parse_args().device
    kernel = load_kernel(LIBRARY_KERNELS[COLUMN_COPY], COLUMN_COPY, interpret=device != "cuda")
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreted: no times)"
    print(f"copy out of a padded product on {name}, torch {torch.__version__}")
    print("| M x N | dtype | pitch | ATen ms | kernel ms | plain copy ms | kernel / copy rate |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for rows, n, dtype in SHAPES["cuda" if device == "cuda" else "cpu"]:
        print(row(rows, n, dtype, kernel, device))


if __name__ == "__main__":
    main()
