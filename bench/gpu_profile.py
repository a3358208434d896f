"""What bench/models_gpu.py measures in each of its processes, and how its figures are read.

- Timing: a round is `number` calls between two synchronizations (ms per call); the host's time to
  enqueue one call is the wall time from its entry to its return after a synchronization (the GPU
  may still be running it); a call that synchronizes inside (`.item()`, a copy to the host) is
  found with torch's own sync debug mode, counted per call.
- Kernels: one `torch.profiler` run of a few calls gives every kernel (CUPTI's kernel events, with
  their names and durations), memory copies and sets, and the runtime's launch calls; `summarize`
  turns them into figures per call: kernels, launches, GPU ms split by `KERNEL_CLASSES` into
  matmul, attention and other, and the slowest kernels. On a CPU (the dry run) the top-level ATen
  ops stand in for kernels, so the same code runs.
- Correctness: an output's error against a float32 run, next to eager's own; tokens against
  eager's, where a first differing token is a near tie when eager's own logits put the two within
  their error against float32.
"""

from __future__ import annotations

import os
import re
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

# Kernel names to what they compute, first match wins. Generated pointwise and reduction kernels
# come first whatever ops their names list (Inductor names a kernel that pads an SDPA operand after
# the SDPA); Inductor's templates are matmuls unless they are attention; then library kernels.
KERNEL_CLASSES: tuple[tuple[str, str], ...] = (
    ("other", r"^(triton_(poi|red|per|for)_|gjit_(poi|red|scan|scatter)_)"),
    ("attention", r"^triton_tem_fused.*(attention|flex)|^gjit_attn_|flash|fmha|attention|sdpa|_mha_"),
    ("matmul", r"^triton_tem_|^gjit_mm_|gemm|gemv|cutlass|cublas|xmma|nvjet|wgmma|splitk"),
    ("matmul", r"^aten::(mm|addmm|bmm|baddbmm|matmul|linear)$"),  # the dry run's CPU ops
)
_CLASSES = [(cls, re.compile(pattern, re.IGNORECASE)) for cls, pattern in KERNEL_CLASSES]
CLASS_NAMES = ("matmul", "attention", "other")
# the runtime and driver calls that start work on the GPU (kernels, CUDA graphs)
LAUNCH_APIS = frozenset(
    {
        "cudaLaunchKernel",
        "cudaLaunchKernelExC",
        "cudaLaunchCooperativeKernel",
        "cuLaunchKernel",
        "cuLaunchKernelEx",
        "cudaGraphLaunch",
        "cuGraphLaunch",
    }
)


def classify(name: str) -> str:
    """matmul, attention or other, by the kernel's name (KERNEL_CLASSES)."""
    for cls, pattern in _CLASSES:
        if pattern.search(name):
            return cls
    return "other"


def verdict(host_ms: float | None, gpu_ms: float | None) -> str:
    """host-bound when enqueuing a call takes the CPU at least as long as its kernels take the GPU."""
    if host_ms is None or gpu_ms is None:
        return "?"
    return "host-bound" if host_ms >= gpu_ms else "kernel-bound"


# -- timing ----------------------------------------------------------------------------------------


def synchronizer(device: str) -> Callable[[], None]:
    if device.startswith("cuda"):
        import torch

        return torch.cuda.synchronize
    return lambda: None


def time_round(fn: Callable[[], Any], number: int, sync: Callable[[], None]) -> float:
    """ms per call of `number` calls between two synchronizations."""
    sync()
    start = time.perf_counter()
    for _ in range(number):
        fn()
    sync()
    return (time.perf_counter() - start) / number * 1e3


def host_ms(fn: Callable[[], Any], calls: int, sync: Callable[[], None]) -> float:
    """Median ms from a call's entry to its return, each after a synchronization (not waiting for
    the GPU to finish it): the CPU's time to enqueue the call."""
    times = []
    for _ in range(calls):
        sync()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    sync()
    return statistics.median(times) * 1e3


def host_profile(fn: Callable[[], Any], calls: int, per: int = 1, top: int = 12) -> list[dict]:
    """Where the CPU's time to enqueue a call goes: Python's profiler over `calls` calls of `fn`
    (each making `per` calls of the compiled function), the `top` functions by their own time,
    each with ms and calls per compiled call. The profiler's own cost inflates every figure
    (most the many small calls): read shares, not times."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    try:
        for _ in range(calls):
            fn()
    finally:
        profiler.disable()
    # (file, line, name) -> (calls, primitive calls, own s, cumulative s, callers)
    stats = pstats.Stats(profiler).stats
    n = calls * per
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    return [
        {"function": f"{name} ({os.path.basename(file)}:{line})", "own_ms": own / n * 1e3, "calls": count / n}
        for (file, line, name), (count, _, own, _, _) in rows
    ]


def syncs_in(fn: Callable[[], Any], device: str) -> tuple[Any, int]:
    """fn()'s result and how many times it synchronized with the GPU (torch's sync debug mode:
    `.item()`, a copy to the host, an explicit synchronize). On a CUDA device only."""
    import torch

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return out, sum("synchroniz" in str(w.message) for w in caught)


# -- kernels ---------------------------------------------------------------------------------------


def profile(fn: Callable[[], Any], calls: int, device: str) -> list[tuple[str, str, float]]:
    """`calls` calls of fn under torch.profiler: (kind, name, us) per kernel, copy and launch."""
    import torch
    from torch.profiler import ProfilerActivity

    cuda = device.startswith("cuda")
    sync = synchronizer(device)
    # on a GPU the CPU's ops are left out (a generate() has tens of thousands), unless without them
    # the profiler sees no kernel
    tries = [[ProfilerActivity.CUDA], [ProfilerActivity.CPU, ProfilerActivity.CUDA]]
    for activities in tries if cuda else [[ProfilerActivity.CPU]]:
        sync()
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(calls):
                fn()
            sync()
        recs = records(prof.events(), cuda)
        if any(kind == "kernel" for kind, _, _ in recs):
            break
    return recs


def records(events: Any, cuda: bool) -> list[tuple[str, str, float]]:
    """The profiler's events as (kind, name, us): "kernel", "copy" (memcpy, memset) or "launch"
    (a runtime call in LAUNCH_APIS). Without CUDA, top-level ATen ops are the kernels."""
    from torch.autograd import DeviceType

    out = []
    for e in events:
        us = e.time_range.elapsed_us()
        if cuda and e.device_type == DeviceType.CUDA:
            out.append(("copy" if e.name.startswith(("Memcpy", "Memset")) else "kernel", e.name, us))
        elif cuda and e.name in LAUNCH_APIS:
            out.append(("launch", e.name, us))
        elif not cuda and e.device_type == DeviceType.CPU and e.name.startswith("aten::"):
            parent = e.cpu_parent
            while parent is not None and not parent.name.startswith("aten::"):
                parent = parent.cpu_parent
            if parent is None:
                out.append(("kernel", e.name, us))
    return out


def summarize(recs: list[tuple[str, str, float]], calls: int, slowest: int = 30) -> dict[str, Any]:
    """Per call: kernels, copies, launches, GPU ms (kernels and copies) by class, and the `slowest`
    kernels by time (name, ms per call, launches per call)."""
    by_class = dict.fromkeys(CLASS_NAMES, 0.0)
    per_name: dict[str, list[float]] = {}
    counts = {"kernel": 0, "copy": 0, "launch": 0, "graph": 0}
    for kind, name, us in recs:
        counts[kind] += 1
        if kind == "launch":
            counts["graph"] += "GraphLaunch" in name
            continue
        by_class[classify(name) if kind == "kernel" else "other"] += us
        if kind == "kernel":
            per_name.setdefault(name, []).append(us)
    top = sorted(per_name.items(), key=lambda item: -sum(item[1]))[:slowest]
    return {
        "kernels_per_call": counts["kernel"] / calls,
        "copies_per_call": counts["copy"] / calls,
        "launches_per_call": counts["launch"] / calls,  # the runtime's and driver's launch calls
        "graph_launches_per_call": counts["graph"] / calls,  # CUDA graphs replayed
        "gpu_ms_per_call": sum(by_class.values()) / calls / 1e3,
        "ms_by_class": {cls: us / calls / 1e3 for cls, us in by_class.items()},
        "slowest": [
            {"name": name, "ms_per_call": sum(times) / calls / 1e3, "per_call": len(times) / calls}
            for name, times in top
        ],
    }


# -- correctness -----------------------------------------------------------------------------------

ERROR_FACTOR = 4.0  # a compiled output may be this many times as far from float32 as eager's
ERROR_FLOOR = 1e-4  # relative error always accepted (float32 models: eager's own is 0)


def rel_err(actual: Any, reference: Any) -> float:
    """||actual - reference|| / ||reference||, in float32."""
    diff = (actual.float() - reference.float()).norm()
    return float(diff / reference.float().norm().clamp_min(1e-30))


def output_ok(err: float, eager_err: float) -> bool:
    return err <= max(ERROR_FACTOR * eager_err, ERROR_FLOOR)


def first_difference(tokens: Any, expected: Any) -> int | None:
    """The first position (in the sequence) where the token rows differ, None when equal."""
    if tokens.shape != expected.shape:
        return min(tokens.shape[-1], expected.shape[-1])
    differs = (tokens != expected).any(dim=0).nonzero()
    return int(differs[0]) if len(differs) else None


def near_tie(logits: Any, reference: Any, chosen: int, expected: int) -> tuple[bool, float, float]:
    """Whether a compiled run choosing `chosen` where eager chose `expected` is rounding: eager's
    logits (one position) give the two within their own error against the float32 `reference`.
    Returns (tie, gap, error)."""
    gap = float(logits[expected].float() - logits[chosen].float())
    err = float((logits.float() - reference.float()).abs().max())
    return gap <= 2 * err + 1e-6, gap, err
