"""The main job: compile a small model with gjit, run it, and show what was generated.

    python -m gjit.demo                  # pre-norm transformer block, kernels run in Triton's CPU interpreter
    python -m gjit.demo --model mlp      # Linear -> GELU -> Linear + residual
    python -m gjit.demo --model layernorm   # LayerNorm written out: pointwise fusion around reductions
    python -m gjit.demo --model gpt2-generate   # generate() with a KV cache: prefill and decode entries
    python -m gjit.demo --device cuda    # launch the same kernels on a GPU

It prints the generated kernels (name, fused ATen nodes, the source of the largest ones), the
externs and why they are externs, the guards of the entry, then the numbers: error against
eager, kernels launched against the ATen ops eager runs, gjit.stats() and compile time per
stage. Exits 1 if an output differs from eager by more than --atol.
"""

from __future__ import annotations

import argparse
import collections
import math
import sys
import time
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn

import gjit

# ----------------------------------------------------------------------------------------------
# Models (random weights, nothing downloaded)
# ----------------------------------------------------------------------------------------------


class Attention(nn.Module):
    """Multi-head self-attention written out: one qkv projection, split, softmax(q k^T / sqrt(d)) v."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        head_dim = dim // self.heads
        q, k, v = (
            t.view(batch, seq, self.heads, head_dim).transpose(1, 2) for t in self.qkv(x).split(dim, dim=-1)
        )
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(head_dim))
        out = scores.softmax(dim=-1) @ v
        return self.proj(out.transpose(1, 2).reshape(batch, seq, dim))


class MLP(nn.Module):
    """Linear -> GELU -> Linear with a residual connection."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """A pre-norm transformer block: x + attn(ln1(x)), then + mlp(ln2(x))."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)
        with torch.no_grad():  # random affine norms, not the identity they start as
            for norm in (self.ln1, self.ln2):
                norm.weight.normal_(1.0, 0.1)
                norm.bias.normal_(0.0, 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class LayerNorm(nn.Module):
    """LayerNorm over the last dim written out with mean and variance, so the pointwise math
    around the two reductions shows up as fused kernels (nn.LayerNorm exports as one
    native_layer_norm op)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(dim))
        self.bias = nn.Parameter(0.1 * torch.randn(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(-1, keepdim=True)
        var = ((x - mean) ** 2).mean(-1, keepdim=True)
        return (x - mean) / torch.sqrt(var + self.eps) * self.weight + self.bias


MODELS: dict[str, Callable[[int], nn.Module]] = {
    "block": lambda hidden: Block(hidden, heads=4),
    "mlp": lambda hidden: MLP(hidden, 4 * hidden),
    "layernorm": lambda hidden: LayerNorm(hidden),
}


# ----------------------------------------------------------------------------------------------
# Report helpers
# ----------------------------------------------------------------------------------------------


def section(title: str) -> None:
    print(f"\n== {title} " + "=" * max(0, 86 - len(title)))


def _is_view(target: object) -> bool:
    return isinstance(target, torch._ops.OpOverload) and (
        target.is_view or target == torch.ops.aten._unsafe_view.default
    )


def count_graph_ops(gm: torch.fx.GraphModule) -> collections.Counter[str]:
    """The call_function nodes of the exported graph, by what eager does for each."""
    counts: collections.Counter[str] = collections.Counter()
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        val = node.meta.get("val")
        returns_tensor = isinstance(val, (torch.Tensor, list, tuple))
        if not isinstance(node.target, torch._ops.OpOverload) or not returns_tensor:
            counts["size/getitem"] += 1  # sym_size, size arithmetic, tuple element
        elif _is_view(node.target):
            counts["view"] += 1
        else:
            counts["compute"] += 1
    return counts


def errors(actual: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    """(max abs error, max rel error), rel = |a - e| / max(|e|, 1e-3) per element."""
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        return math.inf, math.inf
    if not expected.dtype.is_floating_point:
        return (0.0, 0.0) if torch.equal(actual, expected) else (math.inf, math.inf)
    diff = (actual.double() - expected.double()).abs()
    if not torch.equal(actual.isnan(), expected.isnan()):
        return math.inf, math.inf
    diff = diff.nan_to_num(0.0)
    if diff.numel() == 0:
        return 0.0, 0.0
    rel = diff / expected.double().abs().clamp_min(1e-3)
    return float(diff.max()), float(rel.max())


def print_kernels(report: gjit.Report, show_source: int) -> None:
    section(f"kernels ({len(report.kernels)})")
    for k in report.kernels:
        print(f"{k.name}")
        print(f"    fuses: {', '.join(k.aten_nodes)}")
    # the kernels that fuse the most ATen nodes first, then the longest
    for k in sorted(report.kernels, key=lambda k: (-len(k.aten_nodes), -len(k.source)))[:show_source]:
        section(f"source of {k.name}")
        print(f"# written to {k.path}")
        print(k.source.rstrip())


def print_externs(report: gjit.Report) -> None:
    section(f"externs ({len(report.externs)}): run by eager ATen inside the compiled program")
    width = max((len(e.node) for e in report.externs), default=0)
    for e in report.externs:
        print(f"{e.node:<{width}} = {e.op}: {e.reason}")


# ----------------------------------------------------------------------------------------------
# The job
# ----------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m gjit.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=[*sorted(MODELS), "gpt2-generate"], default="block")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cpu: Triton interpreter")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--atol", type=float, default=1e-4, help="max abs error accepted against eager")
    parser.add_argument("--show-source", type=int, default=2, help="how many kernel sources to print")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokens", type=int, default=16, help="gpt2-generate: new tokens per generate()")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gjit.demo: --device cuda needs a CUDA GPU, none found (use --device cpu)", file=sys.stderr)
        return 2
    if args.model == "gpt2-generate":
        from gjit.demo_llm import run

        return run(args)
    device = torch.device(args.device)
    # no GPU: run the generated Triton kernels on CPU tensors through Triton's interpreter;
    # debug: poison every buffer gjit allocates, so an element a kernel forgot to write shows up
    gjit.config.interpret = args.device == "cpu"
    gjit.config.debug = True
    gjit.reset()

    torch.manual_seed(args.seed)
    model = MODELS[args.model](args.hidden).to(device).eval()
    x = torch.randn(args.batch, args.seq, args.hidden, device=device)
    mode = "Triton interpreter on CPU tensors" if gjit.config.interpret else f"Triton kernels on {device}"
    n_params = sum(p.numel() for p in model.parameters())
    print(f"gjit demo: model={args.model} ({type(model).__name__}, {n_params} parameters)")
    print(f"input x: {tuple(x.shape)} {x.dtype} on {device}; kernels run through the {mode}")

    with torch.no_grad():
        model(x)  # warm-up, so the eager time below is a steady-state call
        start = time.perf_counter()
        expected = model(x)
        eager_s = time.perf_counter() - start
        cm = gjit.compile(model)
        start = time.perf_counter()
        out = cm(x)  # first call: capture, lower, fuse, codegen, then run
        first_s = time.perf_counter() - start
        start = time.perf_counter()
        again = cm(x)  # second call: the guards admit it, the cached entry runs
        second_s = time.perf_counter() - start
        # another batch and sequence length: export kept those dims symbolic, so the same entry
        # serves it (its guard binds the new sizes and hands them to the kernels)
        x_other = torch.randn(args.batch + 1, args.seq * 2, args.hidden, device=device)
        compiles_before = gjit.stats()["compiles"]
        other = cm(x_other)
        other_recompiled = gjit.stats()["compiles"] > compiles_before
        expected_other = model(x_other)

    if not cm.entries:
        print(f"gjit could not capture the model and ran it eagerly: {cm.eager_reason}", file=sys.stderr)
        return 1
    report = gjit.explain(cm, x)
    entry = cm.entries[0]

    print_kernels(report, args.show_source)
    print(f"\nwrapper (allocates, runs externs, launches kernels): {entry.program.graph.wrapper_path}")
    print_externs(report)
    section("guards of the entry")
    print(report.guards)
    dynamic = ", ".join(entry.guards.dynamic_dims) or "none"
    print(f"\ndynamic dims: {dynamic}")
    served = "a new entry was compiled" if other_recompiled else "served by the same entry, no recompile"
    print(f"a call with x of shape {tuple(x_other.shape)}: {served}")

    section("numbers")
    exp_leaves = pytree.tree_leaves(expected)
    out_leaves, again_leaves = pytree.tree_leaves(out), pytree.tree_leaves(again)
    worst_abs = 0.0
    if len(out_leaves) != len(exp_leaves) or len(again_leaves) != len(exp_leaves):
        print(f"output structure differs from eager: {len(out_leaves)} vs {len(exp_leaves)} leaves")
        worst_abs = math.inf
    for k, (a, b, e) in enumerate(zip(out_leaves, again_leaves, exp_leaves)):
        if not isinstance(e, torch.Tensor):
            worst_abs = max(worst_abs, 0.0 if a == e and b == e else math.inf)
            continue
        abs1, rel1 = errors(a, e)
        abs2, _ = errors(b, e)
        worst_abs = max(worst_abs, abs1, abs2)
        print(
            f"output {k} {tuple(e.shape)} {e.dtype}: max abs error {abs1:.3e}, max rel error {rel1:.3e} "
            f"(second call: max abs {abs2:.3e})"
        )
    abs3, rel3 = errors(pytree.tree_leaves(other)[0], pytree.tree_leaves(expected_other)[0])
    worst_abs = max(worst_abs, abs3)
    print(f"output 0 at x {tuple(x_other.shape)}: max abs error {abs3:.3e}, max rel error {rel3:.3e}")
    gm = entry.program.captured.full_graph_module
    ops = count_graph_ops(gm)
    fx_nodes = {n.name: n for n in gm.graph.nodes}
    view_externs = [e for e in report.externs if _is_view(fx_nodes[e.node].target)]
    launches = len(report.kernels) + len(report.externs) - len(view_externs)
    print(
        f"exported graph: {sum(ops.values())} ATen call_function nodes = {ops['compute']} compute ops "
        f"(one eager kernel each) + {ops['view']} views + {ops['size/getitem']} size/getitem"
    )
    views = "".join(f"; {e.node} ({e.op}) is a view, no launch" for e in view_externs)
    print(
        f"gjit launches: {len(report.kernels)} generated kernels + "
        f"{len(report.externs) - len(view_externs)} externs = {launches} (eager: {ops['compute']}){views}"
    )
    print(
        f"time: eager {eager_s * 1000:.2f} ms, gjit first call (compile + run) {first_s * 1000:.1f} ms, "
        f"cached call {second_s * 1000:.2f} ms" + (" (kernels interpreted)" if gjit.config.interpret else "")
    )
    stats = gjit.stats()
    stats.pop("compile_seconds")  # the same numbers as report.timings, printed below
    print("gjit.stats(): " + ", ".join(f"{k}={v}" for k, v in stats.items()))
    stages = ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in report.timings.items())
    print(f"compile time per stage: {stages} (total {sum(report.timings.values()) * 1000:.1f} ms)")

    ok = worst_abs <= args.atol
    verdict = "OK" if ok else "MISMATCH"
    print(f"\n{verdict}: max abs error {worst_abs:.3e} vs eager (limit {args.atol:g})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
