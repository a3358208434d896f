"""A graph's first call on a GPU builds its kernels: one after another in Triton's launcher, or in
`gjit.config.compile_workers` processes at once (gjit/runtime/prebuild.py). Measured here without
a GPU, for an H100's target (sm_90):

    .venv/bin/python bench/first_launch.py                       # gpt2, bert, llama (sdpa), gpt2-12
    .venv/bin/python bench/first_launch.py --models llama-sdpa --workers 2 4

Per model, in this process, each time on an empty Triton cache and with no kernel compiled in
memory: the first call's kernel launches (recorded from a real call, run in the interpreter) go
through Triton's launcher (`run(warmup=True)`: its own specialization, compile and on-disk cache,
nothing launched) on a driver that names sm_90:

- in turn: what a first call does without workers (each launch compiles its kernel);
- prebuilt: gjit's prebuild (the wrapper's fake run, Triton's specializations, the builds handed to
  the workers), then the same launches, each waiting for its own build and loading it from the cache
  (the last column counts launches that compiled all the same: a misprediction; 0 expected).

The seconds are wall time from the start of the first launch (or of the prebuild) to the last
launch's binary being ready; a GPU adds the same module loads to both.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import gjit  # noqa: E402
import model_zoo  # noqa: E402
from gjit.codegen.toolchain.compile_only import finish_warm_up  # noqa: E402
from gjit.runtime import graph as graph_module  # noqa: E402
from gjit.runtime import prebuild  # noqa: E402
from helpers import first_graph_call, kernel_launches, through_tritons_launcher  # noqa: E402

MODELS = ("gpt2-sdpa", "bert-sdpa", "llama-sdpa", "gpt2-12")


def build(name: str):
    return model_zoo.gpt2_12() if name == "gpt2-12" else model_zoo.MODELS[name]()


def first_call(model, args):
    """The entry's graph, its wrapper's inputs and sizes, and the kernel launches of a real call."""
    _, graph, inputs, sizes = first_graph_call(model, *args)
    return graph, inputs, sizes, kernel_launches(graph, inputs, sizes)


def fresh(graph) -> dict:
    """An empty Triton cache, no kernel compiled in memory, a new device wrapper: its namespace."""
    triton.knobs.cache.dir = tempfile.mkdtemp(prefix="gjit-first-launch-")
    graph_module._KERNELS.clear()
    graph._calls.clear()
    return graph.call_fn(interpret=False).__globals__


def launch_all(namespace, launches) -> int:
    """Every launch through Triton's launcher; how many compiled there (missed Triton's cache)."""
    return through_tritons_launcher(namespace, launches).count(False)


def measure(name: str, workers: list[int], repeat: int) -> None:
    model, args = build(name)
    graph, inputs, sizes, launches = first_call(model, args)
    distinct = len({k.code_of or k.name for k in graph.kernels})
    rows, at_launch = {}, 0
    for _ in range(repeat):
        namespace = fresh(graph)
        start = time.perf_counter()
        launch_all(namespace, launches)
        rows.setdefault("in turn", []).append(time.perf_counter() - start)
        for n in workers:
            namespace = fresh(graph)
            start = time.perf_counter()
            with gjit.config.scope(compile_workers=n):
                graph.prebuild(graph.call_fn(interpret=False), inputs, sizes)
            at_launch += launch_all(namespace, launches)
            rows.setdefault(f"{n} workers", []).append(time.perf_counter() - start)
    serial = statistics.median(rows["in turn"])
    cells = [f"{statistics.median(v):.2f} s ({serial / statistics.median(v):.2f}x)" for v in rows.values()]
    print(f"| {name} | {len(launches)} | {distinct} | " + " | ".join(cells) + f" | {at_launch} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--workers", nargs="+", type=int, default=[os.cpu_count() or 1])
    parser.add_argument("--repeat", type=int, default=1, help="runs per model; the median is printed")
    opts = parser.parse_args()
    os.environ.setdefault("GJIT_CACHE", "0")
    driver.set_active(prebuild.TargetDriver(GPUTarget("cuda", 90, 32)))
    finish_warm_up()
    print(f"first launches for sm_90 on {os.cpu_count()} CPU(s), {triton.__version__=}, {torch.__version__=}")
    heads = " | ".join(["in turn", *(f"{n} workers" for n in opts.workers)])
    print(f"| model | launches | distinct kernels | {heads} | prebuilt yet compiled at launch |")
    print("|---|---:|---:|" + "---:|" * (2 + len(opts.workers)))
    for name in opts.models:
        measure(name, opts.workers, opts.repeat)


if __name__ == "__main__":
    main()
