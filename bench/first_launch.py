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

    .venv/bin/python bench/first_launch.py --early     # the builds started while codegen runs

With `--early`, per model: a whole cold compile (gjit's disk cache off) to its first build started
and to its first call's binaries ready, each time on an empty Triton cache, the builds started at
the first call (the prebuild) or during codegen (gjit/runtime/early_builds.py, which the first
call's prebuild then waits for). The compile runs on CPU tensors told they are for a GPU; the first
call's launches go through Triton's launcher as above, and its outputs come from eager ATen
(nothing here checks values: the tests do).
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
from gjit.runtime import early_builds, prebuild  # noqa: E402
from gjit.runtime import graph as graph_module  # noqa: E402
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


def compile_and_first_launches(model, args, launches: list, workers: int, early: bool) -> tuple[float, float]:
    """Seconds from `gjit.compile(model)(*args)` to its first build handed to a worker, and to its
    first call's last binary ready: the first call prebuilds as on a GPU and launches `launches`
    through Triton's launcher."""
    ready, submitted = [], []

    def submit(*a, **kw):
        submitted.append(time.perf_counter())
        return submit_one(*a, **kw)

    def first_call(self, inputs: list, sizes: tuple) -> list:
        call = self.call_fn(interpret=False)  # a new graph's: nothing compiled in memory yet
        self.prebuild(call, inputs, sizes)
        assert launch_all(call.__globals__, launches) == 0, "a launch compiled its kernel itself"
        ready.append(time.perf_counter())
        return list(graph_module.FallbackInterpreter(self.graph_module).run(*inputs))

    run, wanted, submit_one = graph_module.CompiledGraph.run, early_builds.wanted, prebuild.submit
    graph_module.CompiledGraph.run = first_call
    early_builds.wanted = lambda graph: early
    prebuild.submit = submit
    try:
        triton.knobs.cache.dir = tempfile.mkdtemp(prefix="gjit-first-launch-")
        graph_module._KERNELS.clear()
        start = time.perf_counter()
        with gjit.config.scope(compile_workers=workers), torch.no_grad():
            gjit.compile(model)(*args)
    finally:
        graph_module.CompiledGraph.run, early_builds.wanted, prebuild.submit = run, wanted, submit_one
    return submitted[0] - start, ready[0] - start


def measure_early(name: str, workers: int, repeat: int) -> None:
    model, args = build(name)
    graph, _, _, launches = first_call(model, args)
    times: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    for k in range(repeat):
        for early in (k % 2 == 0, k % 2 == 1):  # alternating which goes first
            times[early].append(compile_and_first_launches(model, args, launches, workers, early))
    (late_start, late), (soon_start, soon) = (
        [statistics.median(column) for column in zip(*times[early])] for early in (False, True)
    )
    cells = f"{late_start:.2f} / {late:.2f} s | {soon_start:.2f} / {soon:.2f} s | {late - soon:+.2f} s"
    print(f"| {name} | {len(graph.kernels)} | {cells} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--workers", nargs="+", type=int, default=[os.cpu_count() or 1])
    parser.add_argument("--repeat", type=int, default=1, help="runs per model; the median is printed")
    parser.add_argument("--early", action="store_true", help="compile to first binaries, early builds or not")
    opts = parser.parse_args()
    os.environ.setdefault("GJIT_CACHE", "0")
    driver.set_active(prebuild.TargetDriver(GPUTarget("cuda", 90, 32)))
    finish_warm_up()
    print(f"first launches for sm_90 on {os.cpu_count()} CPU(s), {triton.__version__=}, {torch.__version__=}")
    if opts.early:
        workers = opts.workers[0]
        print(f"first build started / last binary ready, s after the compile's start ({workers} workers)")
        print("| model | kernels | builds from the first call | builds from codegen | saved |")
        print("|---|---:|---:|---:|---:|")
        for name in opts.models:
            measure_early(name, opts.workers[0], opts.repeat)
        return
    heads = " | ".join(["in turn", *(f"{n} workers" for n in opts.workers)])
    print(f"| model | launches | distinct kernels | {heads} | prebuilt yet compiled at launch |")
    print("|---|---:|---:|" + "---:|" * (2 + len(opts.workers)))
    for name in opts.models:
        measure(name, opts.workers, opts.repeat)


if __name__ == "__main__":
    main()
