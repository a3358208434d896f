"""Host overhead of a cached gjit call: guard evaluation plus dispatch, for 1, 4 and 16 inputs.

    .venv/bin/python bench/host_overhead.py            # prints the table
    .venv/bin/python bench/host_overhead.py --json out.json

host overhead = time of `cm(*args)` minus time of calling the entry's compiled graph directly
with the same arguments, both medians over many calls. So that the difference is not lost in the
noise of executing the graph (on a CPU-only machine the eager fallback, whose per-call cost
varies by more than the overhead itself), the graph's run is replaced by one that returns its
precomputed outputs in both timings: what remains is exactly what gjit adds around the wrapper
(argument normalization, flattening, the guard function, reading parameters, rebuilding the
output pytree). The table also shows the guard function alone, and, in the same run, end-to-end
per-call times of eager, torch.compile (inductor) and gjit on the same tiny inputs. On a
CPU-only machine gjit's end-to-end figure is host overhead plus the eager fallback interpreter,
not kernel speed.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch

import gjit
from gjit.bench import host_overhead_us, median_us

SIZES = (1, 4, 16)
REPEAT = 7


def program(n: int) -> Callable:
    """A graph with n tensor inputs: one fused pointwise region reading all of them."""

    def f(*xs):
        out = xs[0] * 2
        for k, x in enumerate(xs[1:]):
            out = out + x * (k + 3)
        return out.relu()

    return f


def inputs(n: int) -> list[torch.Tensor]:
    return [torch.randn(4, 8) for _ in range(n)]


def measure(n: int, dynamic: bool) -> dict[str, float]:
    gjit.reset()
    fn = program(n)
    cm = gjit.compile(fn, dynamic=None if dynamic else False)
    args = inputs(n)
    if dynamic:
        for x in args:
            gjit.mark_dynamic(x, 0)
    with torch.no_grad():
        cm(*args)
        entry, flat = cm.entries[0], list(args)
        end_to_end = median_us(lambda: cm(*args), number=500, repeat=REPEAT)
        overhead = host_overhead_us(cm, args, number=20000, repeat=REPEAT)
        guard = median_us(lambda: entry.guards.check(flat), number=20000, repeat=REPEAT)
        eager = median_us(lambda: fn(*args), number=500, repeat=REPEAT)
        torch._dynamo.reset()
        compiled = torch.compile(fn, dynamic=dynamic or None)
        compiled(*args)
        inductor = median_us(lambda: compiled(*args), number=500, repeat=REPEAT)
    return {
        "inputs": n,
        "dynamic": dynamic,
        "symbols": len(entry.guards.symbols),
        "guards": len(entry.guards.guards),
        "guard_fn_us": guard,
        "host_overhead_us": overhead,
        "gjit_call_us": end_to_end,
        "eager_us": eager,
        "torch_compile_us": inductor,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", help="also write the rows to this file")
    opts = parser.parse_args()
    torch.set_num_threads(1)
    rows = [measure(n, dynamic) for n in SIZES for dynamic in (False, True)]
    head = ("inputs", "dims", "guards", "guard fn", "guard+dispatch", "gjit call", "eager", "torch.compile")
    print(" | ".join(head))
    for r in rows:
        print(
            f"{r['inputs']:6d} | {'dynamic' if r['dynamic'] else 'static':7s} | {r['guards']:6d} | "
            f"{r['guard_fn_us']:6.2f} us | {r['host_overhead_us']:9.2f} us | {r['gjit_call_us']:7.1f} us | "
            f"{r['eager_us']:6.1f} us | {r['torch_compile_us']:6.1f} us"
        )
    print(f"device: {'cuda' if torch.cuda.is_available() else 'cpu'}, torch {torch.__version__}, 1 thread")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
