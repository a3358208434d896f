"""python -m gjit.bench: gjit next to eager and torch.compile on kernel cases and tiny models.

    python -m gjit.bench                      # quick subset: one table, bench_results.json, a PNG
    python -m gjit.bench --full               # every case and size, and the dynamic-shape replay;
                                              # on a GPU also device-filling sizes (0.5-1 GiB inputs)
    python -m gjit.bench --cases softmax gpt2 --json out.json --png out.png
    python -m gjit.bench --device-sizes --cases sum_first softmax_vocab   # on a GPU: the large sizes only

Per case: kernels gjit launches (and externs), ATen ops eager launches, kernels torch.compile
generates; modeled bytes gjit / ideal / eager (gjit/debug/byte_model.py); cold compile time (export
to runnable, every kernel built for sm_90 included, into empty caches) and warm compile time (a
second gjit.compile: export, then the on-disk cache entry and Triton's binaries; bench/warm_start.py
measures it across processes, per stage) next to torch.compile's first call; host
overhead of a cached call (guard + dispatch); registers and spills of every kernel for sm_90.
On a GPU also the median kernel time (triton.testing.do_bench) of each system, gjit's achieved
GB/s and its fraction of a device-to-device copy. On CPU gjit's kernels would only run in
Triton's interpreter: no kernel time is reported there, because it would not be kernel speed.

The dynamic-shape replay (--full, or --dynamic) sends 200 seeded calls with batch and sequence
drawn from a skewed distribution through gjit and torch.compile and reports compiles, total
compile time, guard + dispatch per call and the per-call latency of cache hits.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
import triton

import gjit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass
class Case:
    name: str
    make: Callable[[int], tuple[Any, tuple]]  # size -> (model or function, example args)
    sizes: tuple[int, ...]  # quick runs the first; --full all of them
    group: str
    device_sizes: tuple[int, ...] = ()  # --full on a GPU adds these: inputs of about 0.5-1 GiB


def _ten_op_chain(x, b):
    y = (x + b) * 1.5
    y = torch.sigmoid(y) - 0.25
    y = torch.tanh(y * y) + x
    return torch.relu(y).exp() / (1 + b.abs())


def _rms_norm(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def _attention(q, k, v):
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    return torch.softmax(scores, -1) @ v


def _gelu_mlp(d: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d)).eval()


def _hf(name: str) -> Callable[[int], tuple[Any, tuple]]:
    def make(_: int) -> tuple[Any, tuple]:
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        import model_zoo  # the tiny HF models of tests/ (random weights from configs)

        return model_zoo.MODELS[name]()

    return make


def _r(*shape: int) -> torch.Tensor:
    return torch.randn(*shape)


def _embedding(n: int) -> tuple[Any, tuple]:
    return (lambda w, i: w[i] * 2, (_r(1000, 64), torch.randint(0, 1000, (n, 32))))


def _cross_entropy(n: int) -> tuple[Any, tuple]:
    return (lambda x, y: F.cross_entropy(x, y), (_r(n, 32000), torch.randint(0, 32000, (n,))))


def _channels_last(x: torch.Tensor) -> torch.Tensor:
    return x.permute(0, 2, 3, 1).contiguous()


def _bottleneck(dtype: torch.dtype) -> Callable[[int], tuple[Any, tuple]]:
    """Two of ResNet-50's first-stage bottleneck blocks (1x1, 3x3 and 1x1 convolutions, each with a
    batch norm, ReLU, the residual), evaluated on images of N x N (2 of them below 32, else 32)."""

    def block() -> torch.nn.Module:
        layers = []
        for cin, cout, k in ((256, 64, 1), (64, 64, 3), (64, 256, 1)):
            layers += [torch.nn.Conv2d(cin, cout, k, padding=k // 2, bias=False), torch.nn.BatchNorm2d(cout)]
            layers.append(torch.nn.ReLU())
        return torch.nn.Sequential(*layers[:-1])

    class Blocks(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([block(), block()])

        def forward(self, x):
            for b in self.blocks:
                x = torch.relu(x + b(x))
            return x

    def make(n: int) -> tuple[Any, tuple]:
        torch.manual_seed(0)
        model = Blocks().eval()
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.1, 0.1)
                m.running_var.uniform_(0.5, 1.5)
        return model.to(dtype), (torch.randn(2 if n < 32 else 32, 256, n, n, dtype=dtype),)

    return make


def _qkv(n: int) -> tuple:
    return tuple(_r(2, 4, n, 32) for _ in range(3))


def _fn(fn: Callable, *shapes: tuple[int, ...]) -> Callable[[int], tuple[Any, tuple]]:
    """A case of `fn` over random inputs; N in a shape stands for the case's size."""
    return lambda n: (fn, tuple(_r(*[d if d > 0 else n for d in shape]) for shape in shapes))


N = -1  # in a shape: the case's size
CASES = [
    Case("pointwise_short", _fn(lambda x: x * 2 + 1, (N, N)), (256, 2048), "pointwise", (16384,)),
    Case("pointwise_10op", _fn(_ten_op_chain, (N, N), (N,)), (256, 2048), "pointwise", (16384,)),
    Case("pointwise_bcast", _fn(lambda x, b, c: (x + b) * c, (N, N), (N,), (N, 1)), (256,), "pointwise"),
    Case("softmax", _fn(lambda x: torch.softmax(x, -1), (N, 512)), (256, 4096), "reduction", (2**19,)),
    Case("log_softmax", _fn(lambda x: torch.log_softmax(x, -1), (N, 512)), (256,), "reduction"),
    Case("layer_norm", _fn(lambda x: F.layer_norm(x, (768,)), (N, 768)), (256, 4096), "reduction", (2**18,)),
    Case("rms_norm", _fn(_rms_norm, (N, 768), (768,)), (256,), "reduction"),
    # rows past gjit.config.persistent_max: looped kernels, two passes over the row
    Case("softmax_vocab", _fn(lambda x: torch.softmax(x, -1), (N, 32000)), (16,), "reduction", (4096,)),
    Case("layer_norm_wide", _fn(lambda x: F.layer_norm(x, (8192,)), (N, 8192)), (64,), "reduction", (2**14,)),
    # rows of 1025-8192: looped by default, persistent under GJIT_PERSISTENT_MAX=8192 (gpu_checks.sh)
    Case("softmax_2k", _fn(lambda x: torch.softmax(x, -1), (N, 2048)), (16,), "reduction", (2**16,)),
    Case("rms_norm_4k", _fn(_rms_norm, (N, 4096), (4096,)), (16,), "reduction", (2**15,)),
    Case("cross_entropy", _cross_entropy, (16,), "reduction", (4096,)),
    Case("sum_last", _fn(lambda x: x.sum(-1), (N, 512)), (256,), "reduction", (2**19,)),
    Case("sum_first", _fn(lambda x: x.sum(0), (512, N)), (256,), "reduction", (2**19,)),
    Case("mean_middle", _fn(lambda x: x.mean(1), (8, N, 64)), (256,), "reduction"),
    Case("amax_last", _fn(lambda x: x.amax(-1), (N, 512)), (256,), "reduction"),
    Case("transpose_add", _fn(lambda x, y: x.t() + y, (N, N), (N, N)), (256,), "pointwise", (8192,)),
    Case("channels_last", _fn(_channels_last, (N, 64, 56, 56)), (2,), "pointwise", (512,)),
    # one output of many elements: partials of chunks, then their sum (gjit/lowering/split.py)
    Case("sum_all", _fn(lambda x: x.sum(), (N, N)), (256,), "reduction", (16384,)),
    # scans: along a contiguous row, and down the first dim (few columns: a program a column; many:
    # a tile across them, codegen/triton/scan.py)
    Case("cumsum_last", _fn(lambda x: x.cumsum(-1), (N, 4096)), (16,), "scan", (2**15,)),
    Case("cumsum_first", _fn(lambda x: x.cumsum(0), (4096, N)), (16,), "scan", (64, 2**15)),
    Case("embedding", _embedding, (64,), "indexing"),
    # convolutions (cuDNN) with their batch norms, ReLUs and residuals: channels-last on a GPU
    # (gjit/lowering/convolutions.py; GJIT_CONV_LAYOUT=traced keeps the model's layout)
    Case("conv_block", _bottleneck(torch.float32), (8,), "block", (56,)),
    Case("conv_block_bf16", _bottleneck(torch.bfloat16), (8,), "block", (56,)),
    Case("gelu_mlp", lambda n: (_gelu_mlp(64), (_r(n, 64),)), (64,), "block"),
    Case("attention", lambda n: (_attention, _qkv(n)), (64,), "block"),
    Case("encoder_layer", _hf("transformer_encoder_layer"), (0,), "model"),
    Case("gpt2", _hf("gpt2-sdpa"), (0,), "model"),
    Case("bert", _hf("bert-sdpa"), (0,), "model"),
    Case("llama", _hf("llama-sdpa"), (0,), "model"),
]
QUICK = ["pointwise_10op", "softmax", "layer_norm", "sum_first", "transpose_add", "gelu_mlp", "gpt2"]


def median_us(fn: Callable[[], Any], number: int = 200, repeat: int = 5) -> float:
    """Median over `repeat` rounds of the mean time of `number` calls, in microseconds."""
    fn()
    rounds = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        rounds.append((time.perf_counter() - start) / number * 1e6)
    return statistics.median(rounds)


def host_overhead_us(cm: gjit.CompiledFunction, args: tuple, number: int = 2000, repeat: int = 5) -> float:
    """cm(*args) minus a direct call of the entry's graph, with the graph's run replaced by one
    returning its outputs: what gjit adds around the wrapper (see bench/host_overhead.py)."""
    flat = list(args)
    entry = next(e for e in reversed(cm.entries) if e.guards.check(flat) is not None)
    graph, sizes = entry.program.graph, entry.guards.check(flat)
    outputs = graph.run(entry.program.captured.graph_inputs(flat), sizes)
    graph.run = lambda graph_inputs, sizes: outputs
    try:
        call = median_us(lambda: cm(*args), number, repeat)
        direct = median_us(lambda: graph.run(None, sizes), number, repeat)
    finally:
        del graph.run
    return call - direct


@contextlib.contextmanager
def scratch_caches() -> Iterator[None]:
    """Empty gjit and Triton caches for one case: its cold compile builds everything, the warm one
    (a second gjit.compile of the model) reads gjit's on-disk entry and Triton's binaries."""
    with tempfile.TemporaryDirectory(prefix="gjit_bench_") as root, triton.knobs.cache.scope():
        triton.knobs.cache.dir = os.path.join(root, "triton")
        with gjit.config.scope(cache=True, cache_dir=os.path.join(root, "gjit")):
            yield


def measure(case: Case, size: int, gpu: bool) -> dict[str, Any]:
    model, args = case.make(size)
    if gpu:
        model = model.cuda() if isinstance(model, torch.nn.Module) else model
        args = tuple(a.cuda() for a in args)
    row: dict[str, Any] = {"case": case.name, "size": size, "group": case.group}
    with torch.no_grad(), scratch_caches():
        gjit.reset()
        start = time.perf_counter()
        cm = gjit.compile(model)
        aot = gjit.aot(cm, *args)
        row["gjit_cold_s"] = time.perf_counter() - start
        start = time.perf_counter()
        gjit.aot(gjit.compile(model), *args)
        row["gjit_warm_s"] = time.perf_counter() - start
        report = gjit.explain(cm, *args)
        row |= {
            "gjit_kernels": len(report.kernels),
            "gjit_externs": len(report.externs),
            "eager_ops": report.traffic.eager_kernels,
            "bytes_gjit": report.traffic.gjit,
            "bytes_ideal": report.traffic.ideal,
            "bytes_eager": report.traffic.eager,
            "gjit_over_ideal": report.traffic.gjit / max(report.traffic.ideal, 1),
            "max_registers": max((k.registers for k in aot.kernels), default=0),
            "spilling_kernels": [k.name for k in aot.kernels if k.spills],
            "row_kernels_tuned": report.row_kernels,  # on a GPU: looped or persistent, both times
        }
        with gjit.config.scope(interpret=not gpu):
            cm(*args)
        row["host_overhead_us"] = host_overhead_us(cm, args)
        torch._dynamo.reset()
        torch._inductor.metrics.reset()
        with torch._inductor.utils.fresh_cache():  # cold, like gjit's: no FX graph cache hit
            compiled = torch.compile(model)
            start = time.perf_counter()
            compiled(*args)
            row["inductor_cold_s"] = time.perf_counter() - start
            row["inductor_kernels"] = torch._inductor.metrics.generated_kernel_count
            if gpu:
                row |= gpu_times(model, cm, compiled, args, report.traffic.gjit)
    return row


def gpu_times(model, cm, compiled, args, gjit_bytes: int) -> dict[str, float]:
    from triton.testing import do_bench

    big = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    copy_ms = do_bench(lambda: torch.empty_like(big).copy_(big))
    copy_gbs = 2 * big.numel() / copy_ms / 1e6
    times = {
        "eager_ms": do_bench(lambda: model(*args)),
        "inductor_ms": do_bench(lambda: compiled(*args)),
        "gjit_ms": do_bench(lambda: cm(*args)),
    }
    gbs = gjit_bytes / times["gjit_ms"] / 1e6
    return times | {"gjit_gbs": gbs, "gjit_fraction_of_copy": gbs / copy_gbs}


def replay_dynamic(calls: int = 200, seed: int = 0, gpu: bool = False) -> list[dict[str, Any]]:
    """Seeded (batch, seq) calls skewed toward short sequences through gjit and torch.compile."""
    rng = random.Random(seed)
    shapes = [
        (rng.choice([1, 2, 2, 4, 4, 4, 8]), min(128, int(rng.paretovariate(1.2) * 8))) for _ in range(calls)
    ]
    torch.manual_seed(0)
    model = torch.nn.TransformerEncoderLayer(64, 4, 128, batch_first=True).eval()
    device = "cuda" if gpu else "cpu"
    model = model.to(device)
    inputs = [torch.randn(b, s, 64, device=device) for b, s in shapes]
    rows = []
    with torch.no_grad():
        gjit.reset()
        cm = gjit.compile(model)
        rows.append(_replay("gjit", cm, inputs, lambda: gjit.stats()["compiles"]))
        rows[-1]["guard_dispatch_us"] = host_overhead_us(cm, (inputs[-1],))
        torch._dynamo.reset()
        counters = torch._dynamo.utils.counters
        counters.clear()
        rows.append(
            _replay("torch.compile", torch.compile(model), inputs, lambda: counters["stats"]["unique_graphs"])
        )
    for r in rows:
        r["distinct_shapes"] = len(set(shapes))
    return rows


def _replay(
    system: str, fn: Callable, inputs: list[torch.Tensor], compiles: Callable[[], int]
) -> dict[str, Any]:
    compile_s, hits = 0.0, []
    for x in inputs:
        before = compiles()
        start = time.perf_counter()
        fn(x)
        elapsed = time.perf_counter() - start
        if compiles() > before:
            compile_s += elapsed
        else:
            hits.append(elapsed * 1e6)
    return {
        "system": system,
        "calls": len(inputs),
        "compiles": compiles(),
        "compile_s": compile_s,
        "hit_latency_us": statistics.median(hits) if hits else float("nan"),
    }


COLUMNS = [
    ("case", "case", "{}"),
    ("size", "size", "{}"),
    ("gjit k", "gjit_kernels", "{}"),
    ("ext", "gjit_externs", "{}"),
    ("eager ops", "eager_ops", "{}"),
    ("inductor k", "inductor_kernels", "{}"),
    ("bytes/ideal", "gjit_over_ideal", "{:.2f}"),
    ("KB gjit/eager", None, None),
    ("cold s", "gjit_cold_s", "{:.2f}"),
    ("warm s", "gjit_warm_s", "{:.2f}"),
    ("inductor s", "inductor_cold_s", "{:.2f}"),
    ("host us", "host_overhead_us", "{:.1f}"),
    ("regs", "max_registers", "{}"),
    ("spills", "spilling_kernels", "{}"),
]


def format_table(rows: list[dict[str, Any]]) -> str:
    cells = []
    for r in rows:
        line = []
        for _, key, fmt in COLUMNS:
            if key is None:
                line.append(f"{r['bytes_gjit'] / 1024:.0f}/{r['bytes_eager'] / 1024:.0f}")
            elif key == "spilling_kernels":
                line.append(str(len(r[key])))
            else:
                line.append(fmt.format(r[key]))
        cells.append(line)
    heads = [c[0] for c in COLUMNS]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(heads)]
    out = [" | ".join(h.rjust(w) for h, w in zip(heads, widths))]
    out.append("-+-".join("-" * w for w in widths))
    out += [" | ".join(c.rjust(w) for c, w in zip(line, widths)) for line in cells]
    if rows and "gjit_ms" in rows[0]:
        out.append("")
        out += [
            f"{r['case']}[{r['size']}]: eager {r['eager_ms']:.3f} ms, "
            f"torch.compile {r['inductor_ms']:.3f} ms, gjit {r['gjit_ms']:.3f} ms "
            f"({r['gjit_gbs']:.0f} GB/s, {r['gjit_fraction_of_copy']:.0%} of a copy)"
            for r in rows
        ]
    return "\n".join(out)


def plot(rows: list[dict[str, Any]], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG (pip install matplotlib)", file=sys.stderr)
        return False
    labels = [f"{r['case']}[{r['size']}]" for r in rows]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(8, len(rows) * 0.7), 8))
    xs = range(len(rows))
    top.bar([x - 0.2 for x in xs], [r["gjit_over_ideal"] for r in rows], 0.4, label="gjit")
    top.bar(
        [x + 0.2 for x in xs], [r["bytes_eager"] / max(r["bytes_ideal"], 1) for r in rows], 0.4, label="eager"
    )
    top.axhline(1.0, color="k", lw=0.8)
    top.set_ylabel("modeled bytes / ideal")
    top.legend()
    bottom.bar([x - 0.2 for x in xs], [r["gjit_cold_s"] for r in rows], 0.4, label="gjit (cold, with sm_90)")
    bottom.bar([x + 0.2 for x in xs], [r["inductor_cold_s"] for r in rows], 0.4, label="torch.compile")
    bottom.set_ylabel("compile time (s)")
    bottom.legend()
    for ax in (top, bottom):
        ax.set_xticks(list(xs), labels, rotation=45, ha="right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--full", action="store_true", help="every case and size, and the dynamic replay")
    parser.add_argument("--cases", nargs="*", help="only these cases")
    parser.add_argument("--dynamic", action="store_true", help="run the dynamic-shape replay")
    parser.add_argument(
        "--device-sizes",
        action="store_true",
        help="on a GPU, only each case's device-filling size (its largest where it has none)",
    )
    parser.add_argument("--json", default="bench_results.json", help="where to write the rows")
    parser.add_argument("--png", default="bench_results.png", help="where to draw the plot")
    opts = parser.parse_args(argv)
    gpu = torch.cuda.is_available()
    names = opts.cases or ([c.name for c in CASES] if opts.full else QUICK)
    with torch.no_grad():  # first compiles of the process: imports and start-up, not measured
        warm_up = torch.randn(8, device="cuda" if gpu else "cpu")
        gjit.aot(lambda x: x + 1, warm_up)
        with torch._inductor.utils.fresh_cache():
            torch.compile(lambda x: x + 1)(warm_up)
    rows = []
    for case in [c for c in CASES if c.name in names]:
        if opts.device_sizes and gpu:
            sizes = case.device_sizes or case.sizes[-1:]
        else:
            sizes = case.sizes + (case.device_sizes if gpu else ()) if opts.full else case.sizes[:1]
        for size in sizes:
            print(f"measuring {case.name} [{size}] ...", file=sys.stderr, flush=True)
            rows.append(measure(case, size, gpu))
            print(json.dumps(rows[-1], default=str), file=sys.stderr, flush=True)  # a cut-off run keeps it
    device = torch.cuda.get_device_name() if gpu else "CPU (kernels built for sm_90; no kernel times)"
    print(f"gjit.bench on {device}, torch {torch.__version__}")
    print(format_table(rows))
    result: dict[str, Any] = {"device": device, "rows": rows}
    if opts.full or opts.dynamic:
        dyn = replay_dynamic(gpu=gpu)
        result["dynamic"] = dyn
        print("\ndynamic-shape replay (200 calls, seeded, batch x seq skewed):")
        for r in dyn:
            extra = f", guard+dispatch {r['guard_dispatch_us']:.1f} us" if "guard_dispatch_us" in r else ""
            print(
                f"  {r['system']:<14} compiles {r['compiles']}, compile {r['compile_s']:.1f} s, "
                f"cache-hit latency {r['hit_latency_us']:.0f} us{extra} "
                f"({r['distinct_shapes']} distinct shapes)"
            )
    with open(opts.json, "w") as f:
        json.dump(result, f, indent=1, default=str)
    drawn = plot(rows, opts.png) if rows else False
    print(f"\nwrote {opts.json}" + (f" and {opts.png}" if drawn else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
