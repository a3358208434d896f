"""Calls per second of one cached entry from 1, 2, 4 and 8 threads: gjit next to torch.compile and eager.

    .venv/bin/python bench/threads.py                    # CPU, prints the table
    .venv/bin/python bench/threads.py --device cuda      # on a GPU
    .venv/bin/python bench/threads.py --json out.json --seconds 2

One model (Linear, GELU, LayerNorm, Linear on a [16, 256] input), compiled and called once before
the threads start, so every timed call is a cached call of one entry. Each thread calls it in a
loop with its own input (the same shape) for `--seconds`; the figure is all threads' calls over
the wall time, the median of `--repeat` runs. Rows:

- eager: the model itself;
- torch.compile: inductor (C++ kernels on a CPU, Triton on a GPU), Dynamo's cached frame;
- gjit: the compiled callable. On a CPU without a GPU its graph runs in the eager fallback
  interpreter (FX, op by op), so this is not a kernel figure there;
- gjit guard + dispatch: the same calls with the entry's graph run replaced by one returning its
  outputs (as bench/host_overhead.py does): what gjit adds around the kernels, from N threads at
  once. It takes no lock (gjit/locks.py);
- Python: a plain Python loop of a few microseconds, no torch and no lock: what the GIL alone does
  to calls from several threads on this machine, to read the rows above against.

torch runs one intra-op thread (torch.set_num_threads(1)), so the columns show how calls from
several Python threads share the process, not ATen's own parallelism.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from collections.abc import Callable

import torch

import gjit

THREADS = (1, 2, 4, 8)


def model(device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.LayerNorm(512), torch.nn.Linear(512, 256)
    )
    return net.to(device).eval()


def calls_per_second(
    call: Callable[[torch.Tensor], object], threads: int, seconds: float, device: str
) -> float:
    """All threads' calls of `call` (each with its own input) per second of wall time."""
    inputs = [torch.randn(16, 256, device=device) for _ in range(threads)]
    counts = [0] * threads
    start = threading.Barrier(threads + 1)
    stop = threading.Event()

    def loop(i: int) -> None:
        with torch.no_grad():
            call(inputs[i])
            start.wait()
            n = 0
            while not stop.is_set():
                call(inputs[i])
                n += 1
            if device == "cuda":
                torch.cuda.synchronize()
        counts[i] = n

    workers = [threading.Thread(target=loop, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    start.wait()
    began = time.perf_counter()
    time.sleep(seconds)
    stop.set()
    for w in workers:
        w.join()
    return sum(counts) / (time.perf_counter() - began)


def systems(device: str) -> dict[str, Callable]:
    net = model(device)
    x = torch.randn(16, 256, device=device)
    with torch.no_grad():
        compiled = torch.compile(net)
        compiled(x)
        cm = gjit.compile(net)
        cm(x)
        stub = gjit.compile(net)  # its own entry, whose graph run returns precomputed outputs
        stub(x)
        entry = stub.entries[0]
        outputs = entry.program.graph.run(entry.program.captured.graph_inputs([x]), entry.guards.check([x]))
        entry.program.graph.run = lambda graph_inputs, sizes: outputs
    return {
        "eager": net,
        "torch.compile": compiled,
        "gjit": cm,
        "gjit guard + dispatch": stub,
        "Python": python_loop,
    }


def python_loop(x: torch.Tensor) -> int:
    total = 0
    for i in range(100):
        total += i
    return total


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--seconds", type=float, default=1.0, help="per run of a cell")
    parser.add_argument("--repeat", type=int, default=3, help="runs per cell; the median is shown")
    parser.add_argument("--json", help="also write the rows to this file")
    opts = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for name, call in systems(opts.device).items():
        runs = {
            n: [calls_per_second(call, n, opts.seconds, opts.device) for _ in range(opts.repeat)]
            for n in THREADS
        }
        rates = {n: statistics.median(r) for n, r in runs.items()}
        rows.append({"system": name, **{f"{n} threads": rates[n] for n in THREADS}})
    gjit_compiles = gjit.stats()["compiles"]
    head = ["calls/s", *(f"{n} thread{'s' if n > 1 else ''}" for n in THREADS)]
    print(" | ".join(f"{h:>22s}" if k == 0 else f"{h:>10s}" for k, h in enumerate(head)))
    for r in rows:
        cells = [f"{r[f'{n} threads']:10.0f}" for n in THREADS]
        print(" | ".join([f"{r['system']:>22s}", *cells]))
    load = os.getloadavg()[0]
    print(
        f"device: {opts.device}, torch {torch.__version__}, {os.cpu_count()} CPUs, 1 intra-op thread, "
        f"median of {opts.repeat} runs of {opts.seconds:g} s per cell, load average {load:.1f}; "
        f"gjit compiles: {gjit_compiles}"
    )
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"device": opts.device, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
