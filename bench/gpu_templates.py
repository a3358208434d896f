"""On a GPU: gjit's matmul and attention templates against ATen, per shape of real models.

    python bench/gpu_templates.py --json out.json      # needs CUDA; prints a markdown table

Each case is a matmul with the pointwise work that follows it in the model (bias, GELU, residual
add, SiLU gate), or one attention, at the sizes of GPT-2 small, BERT-base and a Llama-7B layer.
Per case the median time (triton.testing.do_bench) of: gjit as it compiles by default (on a GPU
the template's tile configurations and, per region, the template against ATen's kernels measured
at compile time: gjit/tuning.py, gjit/choice/), gjit's template in the table's configuration
(`gjit.config.matmul = "template"`, `gjit.config.tune = False`; one kernel, epilogue fused), gjit
with `gjit.config.matmul = "aten"` (the extern plus a pointwise kernel), eager, and torch.compile
(default mode). `table/aten` under 1 means the untuned
template is faster. fp32 products are IEEE fp32 in every system (no TF32: torch's default).
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch
import torch.nn.functional as F

import gjit


def _linear(x, w, b):
    return F.linear(x, w, b)


def _linear_gelu(x, w, b):
    return F.gelu(F.linear(x, w, b), approximate="tanh")


def _linear_residual(x, w, b, r):
    return F.linear(x, w, b) + r


def _gated_mlp(x, wg, wu):
    return F.silu(F.linear(x, wg)) * F.linear(x, wu)


def _causal_sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v)


def _eager_attention(q, k, v):
    scores = q @ k.transpose(-1, -2) * (1 / math.sqrt(q.shape[-1]))
    return torch.softmax(scores, -1) @ v


def _filled_causal_attention(q, k, v):
    """minGPT's attention: a causal mask filled with -inf (here built in the program)."""
    t = q.shape[-2]
    hidden = torch.triu(torch.ones(t, t, dtype=torch.bool, device=q.device), 1)
    scores = (q @ k.transpose(-1, -2) * (1 / math.sqrt(q.shape[-1]))).masked_fill(hidden, float("-inf"))
    return torch.softmax(scores, -1) @ v


def _mm_case(name, fn, rows, k, n, dtype, residual=False, gated=False):
    def make():
        x = torch.randn(rows, k, device="cuda", dtype=dtype)
        w = torch.randn(n, k, device="cuda", dtype=dtype) / math.sqrt(k)
        if gated:
            return fn, (x, w, torch.randn(n, k, device="cuda", dtype=dtype) / math.sqrt(k))
        b = torch.randn(n, device="cuda", dtype=dtype)
        args = (x, w, b) + ((torch.randn(rows, n, device="cuda", dtype=dtype),) if residual else ())
        return fn, args

    return name, f"{rows}x{k} @ {k}x{n}", dtype, 2 * rows * k * n * (2 if gated else 1), make


def _attn_case(name, fn, batch, heads, queries, keys, dim, dtype, causal):
    def make():
        q = torch.randn(batch, heads, queries, dim, device="cuda", dtype=dtype)
        kv = [torch.randn(batch, heads, keys, dim, device="cuda", dtype=dtype) for _ in range(2)]
        return fn, (q, *kv)

    flops = 4 * batch * heads * queries * keys * dim // (2 if causal else 1)
    return name, f"B{batch} H{heads} L{queries} S{keys} D{dim}", dtype, flops, make


HALF, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
CASES = [
    # GPT-2 small, batch 8 x 512 tokens
    _mm_case("gpt2 qkv (linear)", _linear, 4096, 768, 2304, HALF),
    _mm_case("gpt2 fc (linear+gelu)", _linear_gelu, 4096, 768, 3072, HALF),
    _mm_case("gpt2 proj (linear+residual)", _linear_residual, 4096, 3072, 768, HALF, residual=True),
    _mm_case("gpt2 fc fp32", _linear_gelu, 4096, 768, 3072, F32),
    # BERT-base, batch 32 x 128 tokens
    _mm_case("bert out (linear+residual)", _linear_residual, 4096, 768, 768, BF16, residual=True),
    # a Llama-7B layer, 2048 tokens; a decode step with 8 sequences
    _mm_case("llama mlp (gate*up, silu)", _gated_mlp, 2048, 4096, 11008, BF16, gated=True),
    _mm_case("llama down (linear+residual)", _linear_residual, 2048, 11008, 4096, BF16, residual=True),
    _mm_case("llama decode qkv", _linear, 8, 4096, 12288, BF16),
    _attn_case("gpt2 causal sdpa", _causal_sdpa, 8, 12, 512, 512, 64, HALF, True),
    _attn_case("mingpt causal masked_fill", _filled_causal_attention, 8, 12, 512, 512, 64, HALF, True),
    _attn_case("bert sdpa", _sdpa, 32, 12, 128, 128, 64, BF16, False),
    _attn_case("bert eager attention", _eager_attention, 32, 12, 128, 128, 64, BF16, False),
    _attn_case("llama causal sdpa", _causal_sdpa, 1, 32, 2048, 2048, 128, BF16, True),
    _attn_case("llama decode sdpa", _sdpa, 8, 32, 1, 2048, 128, BF16, False),
]


def measure(case) -> dict:
    from triton.testing import do_bench

    name, shape, dtype, flops, make = case
    fn, args = make()
    expected = fn(*args)
    row = {"case": name, "shape": shape, "dtype": str(dtype).removeprefix("torch."), "flops": flops}
    with torch.no_grad():
        settings = {"gjit": {}, "table": {"tune": False, "matmul": "template"}, "aten": {"matmul": "aten"}}
        for setting, knobs in settings.items():
            with gjit.config.scope(**knobs):
                cm = gjit.compile(fn)
                out = cm(*args)
                report = gjit.explain(cm, *args)
                row[f"{setting}_kernels"] = [k.name for k in report.kernels]
                row[f"{setting}_externs"] = len(report.externs)
                row[f"{setting}_tuning"] = [m for m in report.matmuls if m.startswith("tuned")]
                row[f"{setting}_max_err"] = (out.double() - expected.double()).abs().max().item()
                row[f"{setting}_ms"] = do_bench(lambda cm=cm: cm(*args))
        row["eager_ms"] = do_bench(lambda: fn(*args))
        torch._dynamo.reset()
        compiled = torch.compile(fn)
        compiled(*args)
        row["inductor_ms"] = do_bench(lambda: compiled(*args))
    row["gjit_tflops"] = flops / row["gjit_ms"] / 1e9
    return row


def table(rows: list[dict]) -> str:
    lines = [
        "| case | shape | dtype | gjit ms | table ms | aten ms | table/aten | gjit/aten | eager ms "
        "| torch.compile ms | gjit TFLOP/s | gjit kernels (externs) |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | {r['shape']} | {r['dtype']} | error: {r['error']} |||||||||")
            continue
        lines.append(
            f"| {r['case']} | {r['shape']} | {r['dtype']} | {r['gjit_ms']:.3f} | {r['table_ms']:.3f} "
            f"| {r['aten_ms']:.3f} | {r['table_ms'] / r['aten_ms']:.2f} | {r['gjit_ms'] / r['aten_ms']:.2f} "
            f"| {r['eager_ms']:.3f} | {r['inductor_ms']:.3f} | {r['gjit_tflops']:.0f} "
            f"| {', '.join(r['gjit_kernels'])} ({r['gjit_externs']}) |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", default="gpu_templates.json")
    parser.add_argument("--cases", nargs="*", help="only cases whose name contains one of these")
    opts = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/gpu_templates.py needs a CUDA device", file=sys.stderr)
        return 2
    rows = []
    for case in CASES:
        if opts.cases and not any(c in case[0] for c in opts.cases):
            continue
        print(f"measuring {case[0]} ...", file=sys.stderr, flush=True)
        try:
            rows.append(measure(case))
        except Exception as e:  # one broken case must not hide the others' figures
            rows.append({"case": case[0], "shape": case[1], "dtype": str(case[2]), "error": repr(e)[:300]})
        print(json.dumps(rows[-1], default=str), file=sys.stderr, flush=True)
    print(f"gpu_templates on {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(table(rows))
    with open(opts.json, "w") as f:
        json.dump(rows, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
