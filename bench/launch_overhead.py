"""Host time per kernel launch. Without a GPU: Triton's own CUDA driver and C launcher over a libcuda
that launches nothing (tests/null_cuda.py), kernels built for sm_90. With `--device cuda`: the card's
own driver (each round synchronized at its end; a launch's figure is the host's time to enqueue it).

    .venv/bin/python bench/launch_overhead.py            # prints the tables
    .venv/bin/python bench/launch_overhead.py --json out.json
    python bench/launch_overhead.py --device cuda        # on a GPU

One pointwise kernel (three tensors, two ints, a constexpr), launched by: Triton's path
(`kernel[grid](...)`: JITFunction.run, what gjit's wrappers did before gjit/runtime/launch.py),
gjit's pre-bound `Launcher`, the compiled kernel's launcher called directly (`CompiledKernel.run`,
the floor a Python caller can reach through Triton), and Triton's C launch function alone. Then the
device wrapper of a 12-layer GPT-2 (tiny widths, GPT-2 small's depth: 75 launches a call) run
whole, each way: the host time of one call (wrapper, allocations, launches) and per launch. All
medians; the machine's CPU decides the figures (a GPU host's launch adds the driver's own
cuLaunchKernel, about 2-3 us).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl
from triton.runtime.driver import driver

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import gjit  # noqa: E402
from gjit.bench import median_us  # noqa: E402
from gjit.runtime.launch import Launcher  # noqa: E402
from helpers import first_graph_call  # noqa: E402
from model_zoo import gpt2_12  # noqa: E402
from null_cuda import launches, null_driver  # noqa: E402


@triton.jit
def axpy(x, y, out, n, scale, XBLOCK: tl.constexpr):
    i = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)
    tl.store(out + i, tl.load(x + i, i < n) * scale + tl.load(y + i, i < n), i < n)


def synchronized(fn, device: str):
    """fn, and on a GPU a synchronize after it: a round's launches are all enqueued and run."""
    if device != "cuda":
        return fn

    def run() -> None:
        fn()
        torch.cuda.synchronize()

    return run


def one_kernel(number: int, repeat: int, device: str) -> dict[str, float]:
    tensors = "cuda" if device == "cuda" else "cpu"  # the null driver launches nothing: CPU memory
    x, y, out = (torch.randn(4096, device=tensors) for _ in range(3))
    grid = (4,)
    axpy[grid](x, y, out, 4096, 3, XBLOCK=1024)  # built for sm_90
    kernel = axpy.run(x, y, out, 4096, 3, XBLOCK=1024, grid=grid, warmup=False)
    launcher = Launcher(axpy)
    launcher[grid](x, y, out, 4096, 3, XBLOCK=1024)
    run, function, metadata = kernel.run, kernel.function, kernel.packed_metadata
    stream = driver.active.get_current_stream(driver.active.get_current_device())

    def raw() -> None:
        run(4, 1, 1, stream, function, metadata, None, None, None, x, y, out, 4096, 3, 1024)

    def c_only() -> None:  # Triton 3.9's CudaLauncher: its C function (other versions: not measured)
        run.launch(4, 1, 1, stream, function, False, False, metadata, None, None, None, None, None,
                   run.arg_annotations, run.kernel_signature, (x, y, out, 4096, 3, 1024))  # fmt: skip

    def triton_path() -> None:
        axpy[grid](x, y, out, 4096, 3, XBLOCK=1024)

    def prebound() -> None:
        launcher[grid](x, y, out, 4096, 3, XBLOCK=1024)

    def per_launch(fn) -> float:
        # rounds of `number` launches, each round synchronized at its end on a GPU
        batch = synchronized(lambda: [fn() for _ in range(number)], device)
        return median_us(batch, 1, repeat) / number

    try:
        c_only()
        c_launch_us = per_launch(c_only)
    except Exception:  # another Triton's launcher
        c_launch_us = float("nan")
    return {
        "triton_path_us": per_launch(triton_path),
        "gjit_launcher_us": per_launch(prebound),
        "compiled_kernel_run_us": per_launch(raw),
        "c_launch_us": c_launch_us,
    }


def gpt2_call(number: int, repeat: int, device: str) -> dict[str, float]:
    model, args = gpt2_12()
    model.config.use_cache = False
    if device != "cuda":  # compiled on CPU tensors (kernels checked in the interpreter)
        graph, inputs, sizes = first_graph_call(model, *args)[1:]
    else:  # the same program compiled for the card
        model, args = model.cuda(), tuple(a.cuda() for a in args)
        with torch.no_grad():
            compiled = gjit.compile(model)
            compiled(*args)
        entry = compiled.entries[0]
        sizes = entry.guards.check(list(args))
        graph, inputs = entry.program.graph, entry.program.captured.graph_inputs(list(args))
    row: dict[str, float] = {}
    for prebound in (False, True):
        with gjit.config.scope(prebound_launches=prebound):
            call = graph.call_fn(interpret=False)
        with torch.no_grad():
            before = launches() if device != "cuda" else 0
            call(inputs, sizes)
            row["launches"] = launches() - before if device != "cuda" else len(graph.kernels)
            batch = synchronized(lambda: [call(inputs, sizes) for _ in range(number)], device)  # noqa: B023
            us = median_us(batch, 1, repeat) / number
        name = "gjit" if prebound else "triton_path"
        row[f"{name}_call_us"] = us
        row[f"{name}_per_launch_us"] = us / row["launches"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--device", default="null", choices=("null", "cuda"))
    opts = parser.parse_args()
    torch.set_num_threads(1)
    if opts.device == "null":
        driver.set_active(null_driver())
    kernel = one_kernel(20000, opts.repeat, opts.device)
    print("one launch (us)        | Triton's path | gjit Launcher | CompiledKernel.run | C launch alone")
    print(
        f"axpy, 5 args + XBLOCK  | {kernel['triton_path_us']:13.2f} | {kernel['gjit_launcher_us']:13.2f} | "
        f"{kernel['compiled_kernel_run_us']:18.2f} | {kernel['c_launch_us']:14.2f}"
    )
    call = gpt2_call(200, opts.repeat, opts.device)
    print()
    print("12-layer GPT-2 wrapper | launches | Triton's path: call, per launch | gjit: call, per launch")
    print(
        f"host time (us)        | {call['launches']:8.0f} | {call['triton_path_call_us']:9.1f}, "
        f"{call['triton_path_per_launch_us']:5.2f}          | {call['gjit_call_us']:9.1f}, "
        f"{call['gjit_per_launch_us']:5.2f}"
    )
    where = torch.cuda.get_device_name() if opts.device == "cuda" else "the null driver (sm_90)"
    print(f"{where}; {os.cpu_count()} CPUs, torch {torch.__version__}, triton {triton.__version__}, 1 thread")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"one_kernel": kernel, "gpt2_12": call}, f, indent=1)


if __name__ == "__main__":
    main()
