"""Which kernel ATen's scaled_dot_product_attention runs for each layout of a mask, and its time.

    python bench/sdpa_masks.py            # on a GPU: BERT-base's attention, bf16 32 x 12 x 128 x 64

BERT under torch.export gets transformers' padding mask as a bool tensor expanded from a
[1, 1, L, 1] one (strides 0 on the batch and key dims); on an H200 its SDPA ran the math path
(float32 GEMMs, 0.28 ms a layer) where eager, with no mask at all, ran the flash kernel. This
prints, for that mask and the layouts gjit could hand over instead, the kernels that ran (from
torch.profiler), the median ms, the error against the math path in float64, and what a row whose
every key is masked gives.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from triton.testing import do_bench

B, H, L, D = 32, 12, 128, 64


def kernels(fn) -> list[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted({e.name[:60] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})


def main() -> None:
    dt, dev = torch.bfloat16, "cuda"
    q, k, v = (torch.randn(B, L, H, D, device=dev, dtype=dt).transpose(1, 2) for _ in range(3))
    keep = (torch.arange(L, device=dev) < L - 3).view(1, 1, L, 1)  # the last 3 queries see nothing
    traced = keep.expand(B, 1, L, L)  # strides (0, L, 1, 0), as export's mask
    additive = torch.where(traced, 0.0, float("-inf")).to(dt)
    masks = {
        "none": None,
        "bool, export's layout": traced,
        "bool, dense": traced.contiguous(),
        "additive bf16, eager's conversion": additive,
        "additive bf16, dense": additive.contiguous(),
    }
    ref_mask = traced.contiguous()
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=ref_mask)
    print(f"SDPA on {torch.cuda.get_device_name()}, torch {torch.__version__}, B{B} H{H} L{L} D{D} {dt}")
    for name, mask in masks.items():
        stride = tuple(mask.stride()) if mask is not None else "-"
        fn = lambda m=mask: F.scaled_dot_product_attention(q, k, v, attn_mask=m)  # noqa: E731
        out = fn()
        ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
        rows = out[:, :, -3:].float()
        dead = "nan" if rows.isnan().any() else ("zeros" if (rows == 0).all() else "other")
        if mask is None:
            err = "-"
        else:
            live = ref[:, :, : L - 3]
            err = f"{((out[:, :, : L - 3].double() - live).norm() / live.norm()).item():.1e}"
        print(f"\n{name}: mask strides {stride}, {ms:.3f} ms, rel err {err}, fully masked rows: {dead}")
        for kname in kernels(fn):
            print(f"    {kname}")


if __name__ == "__main__":
    main()
