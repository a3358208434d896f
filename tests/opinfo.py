"""torch's OpInfo database (`op_db`) through gjit: each sample compiled, run through the generated
kernels (Triton's interpreter, poisoned buffers) and compared with eager.

    python tests/opinfo.py                          # all of op_db in float32: the table per family
    python tests/opinfo.py --every 10               # every tenth op (the default suite's subset)
    python tests/opinfo.py --dtypes float16 bfloat16 --report docs/opinfo.md
    python tests/opinfo.py --ops hypot cumsum -v    # some ops, every sample's outcome
    python tests/opinfo.py --inductor /tmp/inductor.json --report docs/opinfo.md
                                                    # and torch.compile's kernels on the same samples

A sample's outcome is one of
- kernel: compiled, and gjit generated at least one kernel for it;
- extern: compiled, every op ran as an ATen call inside the compiled program;
- eager: capture failed and gjit ran the call eagerly (as it promises, with a logged reason);
- wrong: a value differs from eager beyond the tolerance of its dtype, and (where the op runs in
  float64) it is farther from the float64 result than about twice eager's own error; for an op
  whose eager result depends on the random seed (dropout in training, bernoulli), a shape or dtype differs;
- crash: gjit raised where eager did not.
A sample eager rejects is not counted. An op's outcome is its worst sample's if any was wrong or
crashed, else its best sample's (kernel > extern > eager).

With --inductor, each sample also runs through torch.compile (CPU Inductor, a fresh Dynamo cache per
sample) and the op is "kernel" for Inductor if it generated a kernel for one of its samples. Those
outcomes are kept in the given JSON file (by op and dtype) and read back on the next run, so a
sweep after a gjit change compares against them without compiling with Inductor again.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import sys
import time
import traceback
import warnings
from typing import Any

import torch
import torch.utils._pytree as pytree

import gjit

# ops whose result holds whatever memory held (gjit's debug mode poisons it)
UNDEFINED_VALUES = {
    "empty",
    "empty_like",
    "empty_strided",
    "new_empty",
    "new_empty_strided",
    "empty_permuted",
}
ORDER = ("crash", "wrong", "kernel", "extern", "eager")  # an op's outcome: the first its samples had


def op_db() -> list:
    from torch.testing._internal import common_methods_invocations as methods
    from torch.testing._internal.common_methods_invocations import op_db as database

    # OpInfo wraps its random ops to reseed and then restore the generator inside the call; a
    # compiled program does not replay a seed set while tracing. Unwrapped, eager and gjit both
    # draw from the generator the sweep seeds, and the sweep sees that they draw.
    methods.wrapper_set_seed = lambda op, *args, **kwargs: op(*args, **kwargs)

    return sorted(database, key=lambda op: (op.name, op.variant_test_name))


def op_name(op) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def family(op) -> str:
    """A coarse op family for the report: what kind of kernel the op needs."""
    from torch.testing._internal.opinfo.core import BinaryUfuncInfo, ReductionOpInfo, UnaryUfuncInfo

    name = op.name
    if name.startswith(("linalg.", "cholesky", "lu", "qr", "svd", "triangular", "ormqr", "geqrf")):
        return "linalg"
    if name.startswith("fft."):
        return "fft"
    if name.startswith("special."):
        return "special"
    if any(k in name for k in ("scatter", "index", "gather", "take", "put", "masked_select", "nonzero")):
        return "indexing"
    if name.startswith(("cum", "logcumsumexp")) or "cummax" in name or "cummin" in name:
        return "scan"
    if name.startswith("nn.functional."):
        return "nn"
    if isinstance(op, (UnaryUfuncInfo, BinaryUfuncInfo)):
        return "pointwise"
    if isinstance(op, ReductionOpInfo):
        return "reduction"
    if any(
        k in name
        for k in (
            "view",
            "reshape",
            "permute",
            "transpose",
            "squeeze",
            "expand",
            "flatten",
            "narrow",
            "select",
            "split",
            "chunk",
            "unbind",
            "movedim",
            "swap",
            "diagonal",
            "as_strided",
            "unfold",
            "slice",
            "t",
            "T",
            "mT",
            "mH",
            "H",
        )
    ):
        return "view"
    return "other"


@dataclasses.dataclass
class Outcome:
    op: str
    family: str
    kind: str  # kernel | extern | eager | wrong | crash | none (no sample eager accepts)
    samples: int
    detail: str = ""
    seconds: float = 0.0
    inductor: str = ""  # kernel | no kernel | error (torch.compile failed) | "" (not measured)


def _compare(got: Any, want: Any, reference: Any) -> str | None:
    from helpers import assert_same

    size_as_tuple = lambda v: tuple(v) if isinstance(v, torch.Size) else v  # noqa: E731
    got_leaves, got_spec = pytree.tree_flatten(pytree.tree_map(size_as_tuple, got))
    want_leaves, want_spec = pytree.tree_flatten(pytree.tree_map(size_as_tuple, want))
    if got_spec != want_spec:
        return f"output structure {got_spec} != eager {want_spec}"
    refs = pytree.tree_leaves(reference) if reference is not None else [None] * len(want_leaves)
    if len(refs) != len(want_leaves):
        refs = [None] * len(want_leaves)
    for a, e, r in zip(got_leaves, want_leaves, refs):
        try:
            if isinstance(e, torch.Tensor) and e.layout != torch.strided:  # sparse results: as dense
                a, e = a.to_dense(), e.to_dense()
                r = r.to_dense() if isinstance(r, torch.Tensor) else None
            if isinstance(e, torch.Tensor) and e.dtype == torch.complex32:  # no comparison kernels
                a, e = a.to(torch.complex64), e.to(torch.complex64)
            if isinstance(e, torch.Tensor):
                assert_same(a, e, r if isinstance(r, torch.Tensor) else None)
            elif a != e and not (isinstance(e, float) and a != a and e != e):
                return f"{a!r} != eager {e!r}"
        except AssertionError as err:
            return str(err).splitlines()[0]
    return None


def run_sample(op, sample, dtype: torch.dtype) -> tuple[str, str]:
    def call(*args, **kwargs):
        return op(*args, **kwargs)

    args, kwargs = (sample.input, *sample.args), dict(sample.kwargs)
    with torch.no_grad():
        try:
            torch.manual_seed(0)
            want = call(*args, **kwargs)
        except Exception:  # noqa: BLE001 - a sample eager rejects is not gjit's to run
            return "none", ""
        reference = None
        wide = torch.float64 in op.supported_dtypes("cpu")
        if dtype in (torch.float32, torch.float16, torch.bfloat16) and wide:
            up = pytree.tree_map(
                lambda t: t.double() if isinstance(t, torch.Tensor) and t.dtype == dtype else t,
                (args, kwargs),
            )
            try:
                torch.manual_seed(0)
                reference = call(*up[0], **up[1])
            except Exception:  # noqa: BLE001 - no reference: compare with eager's tolerance
                reference = None
        gjit.reset()
        cm = gjit.compile(call)
        try:
            with gjit.config.scope(interpret=True, debug=True), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.manual_seed(0)
                got = cm(*args, **kwargs)
                if gjit.stats()["eager_runs"]:
                    kind = "eager"
                else:
                    kind = "kernel" if gjit.explain(cm, *args, **kwargs).kernels else "extern"
        except Exception as e:  # noqa: BLE001 - the outcome the sweep exists to find
            return "crash", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    if _random(call, args, kwargs) or op.name in UNDEFINED_VALUES:  # compare shapes and dtypes only
        got, want, reference = _metadata(got), _metadata(want), None
    wrong = _compare(got, want, reference)
    return ("wrong", wrong) if wrong else (kind, cm.eager_reason or "")


def inductor_sample(op, sample) -> str:
    """Whether torch.compile (CPU Inductor) generates a kernel for this sample."""
    import torch._dynamo
    from torch._inductor import metrics

    def call(*args, **kwargs):
        return op(*args, **kwargs)

    args, kwargs = (sample.input, *sample.args), dict(sample.kwargs)
    with torch.no_grad():
        try:
            torch.manual_seed(0)
            call(*args, **kwargs)
        except Exception:  # noqa: BLE001 - a sample eager rejects is not counted
            return "none"
        torch._dynamo.reset()
        metrics.reset()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.manual_seed(0)
                torch.compile(call, backend="inductor")(*args, **kwargs)
        except Exception:  # noqa: BLE001 - torch.compile's failure is its outcome here
            return "error"
    return "kernel" if metrics.generated_kernel_count else "no kernel"


def inductor_op(op, dtype: torch.dtype, max_samples: int = 3) -> str:
    if dtype not in op.supported_dtypes("cpu"):
        return "none"
    try:
        samples = list(op.sample_inputs("cpu", dtype, requires_grad=False))[:max_samples]
    except Exception:  # noqa: BLE001 - OpInfo's own sample generator failed
        return "none"
    kinds = [inductor_sample(op, sample) for sample in samples]
    for kind in ("kernel", "no kernel", "error"):
        if kind in kinds:
            return kind
    return "none"


def _random(call, args: tuple, kwargs: dict) -> bool:
    """Whether the call draws from (or reseeds) the global generator: dropout in training,
    bernoulli, and OpInfo's random ops, which reseed inside the call (a compiled program does not
    replay a manual_seed made while tracing)."""
    torch.manual_seed(0)
    before = torch.get_rng_state()
    with torch.no_grad():
        call(*args, **kwargs)
    return not torch.equal(before, torch.get_rng_state())


def _metadata(tree: Any) -> Any:
    return pytree.tree_map(
        lambda t: (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t).__name__, tree
    )


def run_op(op, dtype: torch.dtype, max_samples: int = 3, verbose: bool = False) -> Outcome:
    start = time.perf_counter()
    name = op_name(op)
    if dtype not in op.supported_dtypes("cpu"):
        return Outcome(name, family(op), "none", 0, f"no {dtype} on cpu")
    try:
        samples = list(op.sample_inputs("cpu", dtype, requires_grad=False))[:max_samples]
    except Exception as e:  # noqa: BLE001 - OpInfo's own sample generator failed
        return Outcome(name, family(op), "none", 0, f"sample_inputs failed: {e}")
    kinds = []
    details = []
    for sample in samples:
        kind, detail = run_sample(op, sample, dtype)
        if verbose:
            print(f"  {name} {dtype}: {kind} {detail}")
        if kind != "none":
            kinds.append(kind)
            details.append(detail)
    seconds = time.perf_counter() - start
    if not kinds:
        return Outcome(name, family(op), "none", 0, "no sample eager accepts", seconds)
    kind = min(kinds, key=ORDER.index)
    return Outcome(name, family(op), kind, len(kinds), details[kinds.index(kind)], seconds)


def run(
    names: list[str] | None,
    every: int,
    dtypes: list[torch.dtype],
    verbose: bool = False,
    inductor: str | None = None,
    gjit_too: bool = True,
) -> list[Outcome]:
    ops = op_db()
    if names:
        ops = [op for op in ops if op.name in names or op_name(op) in names]
    ops = ops[::every]
    known: dict[str, str] = {}
    if inductor and os.path.exists(inductor):
        with open(inductor) as f:
            known = json.load(f)
    outcomes = []
    for op in ops:
        for dtype in dtypes:
            try:
                if gjit_too:
                    outcomes.append(run_op(op, dtype, verbose=verbose))
                else:
                    outcomes.append(Outcome(op_name(op), family(op), "none", 0, "not run"))
            except Exception:  # noqa: BLE001 - the harness itself must not stop the sweep
                outcomes.append(Outcome(op_name(op), family(op), "crash", 0, traceback.format_exc(limit=2)))
            o = outcomes[-1]
            if inductor:
                key = f"{o.op} {dtype}"
                if key not in known:
                    known[key] = inductor_op(op, dtype)
                    with open(inductor, "w") as f:
                        json.dump(known, f, indent=0, sort_keys=True)
                o.inductor = known[key]
            if verbose:
                print(f"{o.op} [{dtype}]: {o.kind} {o.detail} ({o.seconds:.1f} s) {o.inductor}", flush=True)
    return outcomes


def table(outcomes: list[Outcome]) -> str:
    """Per family: ops with samples, and how many got a kernel, ran as externs, ran eagerly, were
    wrong or crashed; the kernel rate is kernel ops over ops with samples. Where torch.compile was
    measured: the ops it made a kernel for, and the share of those gjit made a kernel for too."""
    measured = any(o.inductor for o in outcomes)
    by_family: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for o in outcomes:
        if o.kind != "none":
            c = by_family[o.family]
            c[o.kind] += 1
            if o.inductor == "kernel":
                c["tc"] += 1
                c["both"] += o.kind == "kernel"
    head = "| family | ops | kernel | extern | eager | wrong | crash | kernel rate |"
    if measured:
        head += " torch.compile kernel | gjit kernel where torch.compile has one |"
    lines = [head, "|---" + "|---:" * (head.count("|") - 2) + "|"]

    def row(name: str, c: collections.Counter) -> str:
        n = sum(c[k] for k in ORDER)
        line = (
            f"| {name} | {n} | {c['kernel']} | {c['extern']} | {c['eager']} | {c['wrong']} | "
            f"{c['crash']} | {c['kernel'] / n:.0%} |"
        )
        if measured:
            share = f"{c['both']} ({c['both'] / c['tc']:.0%})" if c["tc"] else "-"
            line += f" {c['tc']} ({c['tc'] / n:.0%}) | {share} |"
        return line

    total: collections.Counter = collections.Counter()
    for name in sorted(by_family):
        total.update(by_family[name])
        lines.append(row(name, by_family[name]))
    if by_family:
        lines.append(row("all", total))
    return "\n".join(lines)


def missing(outcomes: list[Outcome]) -> str:
    """The ops torch.compile made a kernel for and gjit did not, with what gjit did instead."""
    rows = [o for o in outcomes if o.inductor == "kernel" and o.kind in ("extern", "eager")]
    return "\n".join(f"- {o.op} ({o.kind}{': ' + o.detail if o.detail else ''})" for o in rows)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ops", nargs="*", help="op names (default: all of op_db)")
    parser.add_argument("--every", type=int, default=1, help="every n-th op of op_db, sorted by name")
    parser.add_argument("--dtypes", nargs="*", default=["float32"])
    parser.add_argument("--report", help="write the table and the externs-only ops (markdown) here")
    parser.add_argument("--inductor", help="also torch.compile each sample; its outcomes kept in this JSON")
    parser.add_argument("--inductor-only", action="store_true", help="fill the --inductor JSON, run no gjit")
    parser.add_argument("-v", "--verbose", action="store_true")
    opts = parser.parse_args()
    dtypes = [getattr(torch, d) for d in opts.dtypes]
    start = time.perf_counter()
    outcomes = run(opts.ops, opts.every, dtypes, opts.verbose, opts.inductor, not opts.inductor_only)
    text = table(outcomes)
    bad = [o for o in outcomes if o.kind in ("wrong", "crash")]
    text += f"\n\n{len(outcomes)} op/dtype pairs in {time.perf_counter() - start:.0f} s"
    for o in bad:
        text += f"\n- {o.kind}: {o.op}: {o.detail}"
    print(text)
    if opts.report:
        externs = sorted(o.op for o in outcomes if o.kind == "extern")
        with open(opts.report, "w") as f:
            f.write(
                text
                + "\n\nOps gjit compiles with every op as an ATen extern:\n\n"
                + ", ".join(externs)
                + "\n"
            )
            if opts.inductor:
                f.write(
                    "\nOps torch.compile makes a kernel for and gjit does not:\n\n" + missing(outcomes) + "\n"
                )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    sys.exit(main())
