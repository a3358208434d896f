"""Kernel and extern counts of gjit on tiny real models, next to torch.compile (inductor, CPU).

    .venv/bin/python bench/models_report.py            # prints the table, writes docs/models.md
    .venv/bin/python bench/models_report.py --no-write --models gpt2-sdpa conv_bn_relu

Models and inputs come from tests/model_zoo.py (random weights from configs, nothing downloaded),
the same ones tests/test_models.py and tests/test_architectures.py check. gjit runs its generated
kernels in Triton's CPU interpreter; torch.compile runs inductor's default CPU backend (C++
kernels, needs gcc).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import operator
import pathlib
import subprocess
import sys
import time
from typing import Any

import torch
import torch._inductor.metrics
import torch.utils._pytree as pytree
import transformers
import triton

import gjit

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from helpers import run_compiled  # noqa: E402
from model_zoo import DESCRIPTIONS, MODELS, MORE_MODELS, max_rel_err  # noqa: E402

ALL_MODELS = {**MODELS, **MORE_MODELS}

DOC = ROOT / "docs" / "models.md"
TOLERANCE = 1e-4


def short(op: str) -> str:
    """aten.addmm.default -> addmm; aten.index.Tensor -> index.Tensor."""
    name = op.removeprefix("aten.")
    return name.removesuffix(".default")


def op_counts(ops: list[str]) -> str:
    counts = collections.Counter(short(op) for op in ops)
    return ", ".join(f"{op} x{n}" if n > 1 else op for op, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def graph_op_counts(gm: torch.fx.GraphModule) -> tuple[int, int]:
    """(call_function nodes, of which compute ops: not views, not getitem)."""
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    views = [
        n
        for n in calls
        if n.target is operator.getitem or (isinstance(n.target, torch._ops.OpOverload) and n.target.is_view)
    ]
    return len(calls), len(calls) - len(views)


def run_gjit(model: torch.nn.Module, inputs: tuple) -> dict[str, Any]:
    gjit.reset()
    # every product a template, as a GPU where they win runs it: on the CPU the default ("auto")
    # leaves matmuls and attention to ATen, nothing being measured (gjit/choice/)
    with torch.no_grad(), gjit.config.scope(matmul="template"):
        expected = model(*inputs)
        start = time.perf_counter()
        out, cm = run_compiled(model, *inputs)
        seconds = time.perf_counter() - start
        report = gjit.explain(cm, *inputs)
    eager_runs = gjit.stats()["eager_runs"]
    out_leaves, out_spec = pytree.tree_flatten(out)
    exp_leaves, exp_spec = pytree.tree_flatten(expected)
    err = max(max_rel_err(a, e) for a, e in zip(out_leaves, exp_leaves) if isinstance(e, torch.Tensor))
    # the exported, decomposed graph gjit compiled (gjit internals: a bench may look, tests do not)
    gm = cm.entries[-1].program.captured.graph_module
    calls, compute = graph_op_counts(gm)
    return {
        "kernels": len(report.kernels),
        "externs": [e.op for e in report.externs],
        "calls": calls,
        "compute": compute,
        "err": err,
        "matched": eager_runs == 0 and out_spec == exp_spec and err < TOLERANCE,
        "eager_runs": eager_runs,
        "seconds": seconds,
        "kernel_names": [k.name for k in report.kernels],
        "traffic": report.traffic,
    }


def run_inductor(model: torch.nn.Module, inputs: tuple) -> int:
    torch._dynamo.reset()
    torch._inductor.metrics.reset()
    with torch.no_grad():
        torch.compile(model)(*inputs)
    return torch._inductor.metrics.generated_kernel_count


def inductor_column(name: str, model: torch.nn.Module, inputs: tuple) -> tuple[int, str]:
    count = run_inductor(model, inputs)
    if name != "transformer_encoder_layer":
        return count, str(count)
    # Under no_grad, dynamo takes nn.TransformerEncoderLayer's fast path: the whole layer is one
    # aten._transformer_encoder_layer_fwd extern. torch.export takes the regular path, so gjit
    # compiles the decomposed layer; with the fast path off inductor sees the same ops.
    enabled = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        decomposed = run_inductor(model, inputs)
    finally:
        torch.backends.mha.set_fastpath_enabled(enabled)
    return decomposed, f"{decomposed} (fast path off); {count} (default: fast path)"


def measure(name: str) -> dict[str, Any]:
    model, inputs = ALL_MODELS[name]()
    row = {"name": name, **run_gjit(model, inputs)}
    start = time.perf_counter()
    row["inductor"], row["inductor_text"] = inductor_column(name, model, inputs)
    row["inductor_seconds"] = time.perf_counter() - start
    return row


def kb(traffic) -> str:
    return f"{traffic.gjit / 1024:.1f} / {traffic.eager / 1024:.1f} / {traffic.ideal / 1024:.1f}"


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| model | gjit kernels | gjit externs | ATen ops (call_function / compute) "
        "| torch.compile kernels (C++) | modeled KB gjit / eager / ideal "
        "| gjit matches eager (max rel err) |\n"
        "|---|---:|---|---:|---:|---:|---|\n"
    )
    lines = []
    for r in rows:
        externs = f"{len(r['externs'])}: {op_counts(r['externs'])}" if r["externs"] else "0"
        verdict = "yes" if r["matched"] else ("**no: ran eagerly**" if r["eager_runs"] else "**no**")
        lines.append(
            f"| {r['name']} | {r['kernels']} | {externs} | {r['calls']} / {r['compute']} "
            f"| {r['inductor_text']} | {kb(r['traffic'])} | {verdict} ({r['err']:.1e}) |"
        )
    return head + "\n".join(lines) + "\n"


def gjit_revision() -> str:
    """The commit gjit was measured at, and whether its sources had uncommitted changes."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "gjit", "codegen", "guards", "kernels"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown revision"
    return f"commit {head}" + (" with uncommitted changes to gjit's sources" if dirty else "")


def document(rows: list[dict[str, Any]]) -> str:
    listing = lambda group: "\n".join(
        f"- `{r['name']}`: {DESCRIPTIONS[r['name']]}" for r in rows if r["name"] in group
    )
    models, more = listing(MODELS), listing(MORE_MODELS)
    over = [r["name"] for r in rows if r["kernels"] > r["inductor"]]
    target = (
        "every model meets it"
        if not over
        else "not met by " + ", ".join(f"`{n}`" for n in over) + " (see the notes below)"
    )
    kernels = "\n".join(f"- `{r['name']}`: " + ", ".join(f"`{k}`" for k in r["kernel_names"]) for r in rows)
    return f"""# gjit on tiny real models

Recorded by `bench/models_report.py` so later changes can be compared: rerun it and diff this file.
gjit at {gjit_revision()}; torch {torch.__version__}, transformers {transformers.__version__},
triton {triton.__version__}; CPU only; {datetime.date.today().isoformat()}.

Every model is built from a config with random weights (`tests/model_zoo.py`; nothing is
downloaded): 2 layers, hidden 64, 4 heads, vocab 128, batch 2, sequence 8, `use_cache=False`,
eval mode, `torch.manual_seed(0)`, called under `torch.no_grad()`. HF models appear twice,
once per `attn_implementation` ("eager": matmul + softmax attention; "sdpa": one
`scaled_dot_product_attention` extern per layer). Both export with torch 2.13.

{models}

## Table

{table([r for r in rows if r["name"] in MODELS])}
## More architectures

The same columns for the models of `tests/test_architectures.py` (default attention
implementation; that test checks numerics, externs, kernels and bytes against eager on both
backends):

{more}

{table([r for r in rows if r["name"] in MORE_MODELS])}
Columns:

- **gjit kernels**: `len(gjit.explain(cm, *inputs).kernels)`, generated Triton kernels.
- **gjit externs**: `gjit.explain(...).externs`, ops that run as eager ATen calls, with counts.
- **ATen ops**: `call_function` nodes in the exported graph after `run_decompositions()` (the graph
  gjit lowers); "compute" leaves out views (`OpOverload.is_view`) and `getitem`.
- **torch.compile kernels**: `torch._inductor.metrics.generated_kernel_count` after
  `torch._dynamo.reset(); torch._inductor.metrics.reset(); torch.compile(model)(*inputs)` under
  `torch.no_grad()`, default inductor on CPU. **On CPU inductor generates C++ (OpenMP) kernels, not
  Triton**; its CPU scheduler fuses differently from its Triton one, so this count is a reference,
  not the count inductor would reach on a GPU. Inductor's externs (matmul, conv, sdpa) are not counted.
- **modeled KB**: `gjit.explain(...).traffic` (gjit/debug/byte_model.py) at these sizes: bytes gjit's
  kernels and externs move, eager's (one kernel per non-view ATen op, reading its inputs and writing
  its outputs), and the ideal (graph inputs, weights included, read once; outputs written once).
- **gjit matches eager**: gjit's output (kernels run in Triton's interpreter, poisoned buffers)
  against the eager model, every output tensor, `max|gjit - eager| / max|eager|` below {TOLERANCE:g}
  (the largest over the outputs is shown), and gjit did not fall back to eager.

Target (from the issue): no more gjit kernels than torch.compile generates: {target}.

## Kernels per model

{kernels}

## Notes

- `transformer_encoder_layer`: under `torch.no_grad()` dynamo takes PyTorch's fast path, so
  default inductor compiles one `aten._transformer_encoder_layer_fwd` extern and no kernel; the
  first count (fast path off via `torch.backends.mha.set_fastpath_enabled(False)`) is the
  comparable one and is the one used for the target.
- HF models built with `use_cache=True` return a `DynamicCache`, which `torch.export` cannot
  flatten: gjit logs the export error (it names `DynamicCache`) and runs the model eagerly.
  `tests/test_models.py::test_hf_use_cache_true_*` records the current behaviour.
"""


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="*", default=list(ALL_MODELS), choices=list(ALL_MODELS))
    parser.add_argument("--no-write", action="store_true", help=f"print only, do not write {DOC}")
    args = parser.parse_args()
    rows = []
    for name in args.models:
        row = measure(name)
        rows.append(row)
        gjit_part = f"gjit {row['kernels']} kernels, {len(row['externs'])} externs, rel err {row['err']:.1e}"
        inductor_part = f"torch.compile {row['inductor_text']} ({row['inductor_seconds']:.1f} s)"
        print(f"{name}: {gjit_part} ({row['seconds']:.1f} s); {inductor_part}", flush=True)
    print()
    print(table(rows))
    if not args.no_write:
        DOC.write_text(document(rows))
        print(f"wrote {DOC.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
