"""GJIT_CHECK: every kernel checked against the eager fallback on the inputs it actually read.

With `gjit.compile(model, check=True)` (or GJIT_CHECK=1) the wrapper calls `check_region` after
each kernel launch. The checker recomputes each value the kernel stored by running the kernel's
ATen nodes eagerly, starting from the tensors the wrapper holds at that point (graph inputs,
extern results, earlier kernels' outputs), so an error is attributed to the kernel that made it,
not to everything downstream. After the call, one table lists every kernel's max abs/rel error
and names the first kernel past its dtype's tolerance.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
import torch.utils._pytree as pytree

from gjit import logs
from gjit.lowering.attention_library import ANY_LAYOUT
from gjit.runtime import attention_masks

log = logs.logger("check")

# (rtol, atol) per dtype, loose enough for reassociated reductions, tight enough for a wrong index
TOLERANCE = {
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
    torch.float32: (1.3e-5, 1e-5),
    torch.float64: (1e-10, 1e-10),
}


@dataclasses.dataclass
class Row:
    kernel: str
    value: str
    dtype: torch.dtype
    max_abs: float
    max_rel: float
    ok: bool


class RegionChecker:
    def __init__(
        self,
        gm: torch.fx.GraphModule,
        members: dict[str, list[str]],
        stores: dict[str, list[tuple[str, str]]],
    ):
        self.gm = gm
        self.nodes = {n.name: n for n in gm.graph.nodes}
        self.members = members  # kernel -> FX node names it computes (stored, fused or inlined)
        self.stores = stores  # kernel -> (FX node name, wrapper variable) of each value it stores
        self.rows: list[Row] = []

    def check_region(self, kernel: str, env: dict[str, Any]) -> None:
        inside = set(self.members.get(kernel, ()))
        memo: dict[str, Any] = {}

        def value(node: torch.fx.Node) -> Any:
            if node.name in memo:
                return memo[node.name]
            # a multi-output node's wrapper variable holds one element, never the tuple: recompute it
            single = not isinstance(node.meta.get("val"), (tuple, list))
            if single and node.name not in inside and node.name in env:
                result = env[node.name]
            elif node.op == "placeholder":
                result = env[node.name]
            else:
                args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), value)
                target = node.target
                if isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable:
                    # an in-place op (index_put_): replayed on copies, never on the kernels' buffers
                    args, kwargs = pytree.tree_map_only(torch.Tensor, torch.clone, (args, kwargs))
                if node.meta.get(ANY_LAYOUT):  # the wrapper's call: its value's layout, eager's rows
                    result = attention_masks.interpreted(node, args, kwargs)
                elif target is operator.getitem:
                    result = args[0][args[1]]
                else:
                    result = target(*args, **kwargs)
            memo[node.name] = result
            return result

        for name, held in self.stores.get(kernel, ()):
            if name not in self.nodes or held not in env:
                continue
            if not isinstance(self.nodes[name].meta.get("val"), torch.Tensor):
                continue  # a tuple-valued node: its elements are checked at their getitem nodes
            expected = value(self.nodes[name])
            self.rows.append(compare(kernel, name, env[held], expected))

    def report(self, title: str) -> str:
        lines = [f"GJIT_CHECK {title}: each kernel vs the eager fallback on the same inputs"]
        lines.append(f"  {'kernel':<44} {'value':<20} {'dtype':<9} {'max abs':>10} {'max rel':>10}")
        for r in self.rows:
            dtype = str(r.dtype).removeprefix("torch.")
            mark = "" if r.ok else "   <-- exceeds tolerance"
            lines.append(
                f"  {r.kernel:<44} {r.value:<20} {dtype:<9} {r.max_abs:10.3e} {r.max_rel:10.3e}{mark}"
            )
        bad = next((r for r in self.rows if not r.ok), None)
        if bad is None:
            lines.append(f"  all {len(self.rows)} checked values within tolerance")
        else:
            rtol, atol = TOLERANCE.get(bad.dtype, (0, 0))
            lines.append(
                f"  first kernel past tolerance: {bad.kernel} "
                f"(value {bad.value}, rtol {rtol:g}, atol {atol:g})"
            )
        return "\n".join(lines)

    def finish(self, title: str) -> list[Row]:
        rows, text = self.rows, self.report(title)
        self.rows = []
        if all(r.ok for r in rows):
            log.info("%s", text)
        else:
            log.warning("%s", text)
        return rows


def compare(kernel: str, name: str, actual: Any, expected: Any) -> Row:
    if not isinstance(actual, torch.Tensor) or not isinstance(expected, torch.Tensor):
        same = actual == expected
        return Row(kernel, name, torch.float64, 0.0 if same else float("inf"), 0.0, bool(same))
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        return Row(kernel, name, expected.dtype, float("inf"), float("inf"), False)
    if actual.numel() == 0:
        return Row(kernel, name, expected.dtype, 0.0, 0.0, True)
    a, e = actual.double(), expected.double()
    both_nan = a.isnan() & e.isnan()
    same_inf = (a == e) & a.isinf()
    diff = (a - e).abs().masked_fill(both_nan | same_inf, 0.0)
    rel = diff / e.abs().clamp_min(1e-30)
    rtol, atol = TOLERANCE.get(expected.dtype, (0.0, 0.0))
    ok = bool(torch.allclose(actual.double(), expected.double(), rtol=rtol, atol=atol, equal_nan=True))
    return Row(kernel, name, expected.dtype, float(diff.max()), float(rel.max()), ok)
