"""pytest-benchmark suite: per-call time of eager, torch.compile and gjit on gjit.bench's cases.

    .venv/bin/python -m pytest bench/test_bench.py --benchmark-only        # quick cases
    GJIT_BENCH_FULL=1 .venv/bin/python -m pytest bench/test_bench.py --benchmark-only

Each gjit row also carries the non-timing figures (kernels, modeled bytes) in extra_info. On a
CPU-only machine gjit's generated kernels cannot run natively, so its per-call time there is
guard + dispatch plus the eager fallback interpreter; on a GPU it is the generated kernels.
"""

import os

import pytest
import torch

import gjit
from gjit.bench import CASES, QUICK

FULL = os.environ.get("GJIT_BENCH_FULL") == "1"
SELECTED = [(c, s) for c in CASES if FULL or c.name in QUICK for s in (c.sizes if FULL else c.sizes[:1])]
GPU = torch.cuda.is_available()


def prepare(case, size):
    model, args = case.make(size)
    if GPU:
        model = model.cuda() if isinstance(model, torch.nn.Module) else model
        args = tuple(a.cuda() for a in args)
    return model, args


def sync(fn, args):
    def run():
        out = fn(*args)
        if GPU:
            torch.cuda.synchronize()
        return out

    return run


@pytest.mark.parametrize("system", ["eager", "torch.compile", "gjit"])
@pytest.mark.parametrize("case, size", SELECTED, ids=[f"{c.name}[{s}]" for c, s in SELECTED])
def test_per_call(benchmark, case, size, system):
    model, args = prepare(case, size)
    with torch.no_grad():
        if system == "eager":
            fn = model
        elif system == "torch.compile":
            torch._dynamo.reset()
            fn = torch.compile(model)
        else:
            gjit.reset()
            fn = gjit.compile(model)
            report = gjit.explain(fn, *args)
            benchmark.extra_info.update(
                kernels=len(report.kernels),
                externs=len(report.externs),
                bytes_gjit=report.traffic.gjit,
                bytes_ideal=report.traffic.ideal,
                bytes_eager=report.traffic.eager,
                runs="generated kernels" if GPU else "eager fallback (CPU)",
            )
        fn(*args)  # compile outside the timing
        benchmark(sync(fn, args))
