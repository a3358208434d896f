"""`torch.compile(model, backend="gjit")`: Dynamo hands each graph it captures to gjit.

Registered through the standard `torch_dynamo_backends` entry point (pyproject.toml), so no
import of gjit is needed before torch.compile. Graph breaks are Dynamo's; each graph Dynamo
passes (a torch-level FX GraphModule) is compiled by gjit like any module: exported,
decomposed, fused, guarded. Dynamo's own guards decide when this backend sees a new graph.

Grad mode is the caller's: a call that needs autograd (grad mode on and a parameter or input
that requires grad) runs the graph eagerly with a logged warning, so training under
torch.compile gets its gradients; under torch.no_grad() / inference_mode the kernels run.
Int graph inputs are the sizes and ints Dynamo made symbolic (SymInts in `example_inputs`):
the graph is compiled with dynamic=True, which exports them as symbols the guard binds, so a
new batch size reuses the entry instead of recompiling.

torch.compile hands a custom backend its `mode` (or `options`) as keyword arguments:
`torch.compile(model, backend="gjit", mode="reduce-overhead")` (or `options={"mode": ...}`) compiles
each graph as `gjit.compile(..., mode=...)` does (CUDA graphs per set of sizes).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.fx._lazy_graph_module import _LazyGraphModule

OPTIONS = ("mode",)  # what torch.compile(..., backend="gjit", options={...}) may set


def gjit_backend(
    gm: torch.fx.GraphModule, example_inputs: list[Any], mode: str | None = None, options: dict | None = None
) -> Callable:
    from gjit.api import CompiledFunction

    unknown = sorted(set(options or {}) - set(OPTIONS))
    if unknown:
        raise ValueError(f"torch.compile(backend='gjit'): unknown options {unknown}; it takes {OPTIONS}")
    mode = (options or {}).get("mode", mode)
    # Dynamo's graphs generate their forward lazily; until then its signature is (*args, **kwargs)
    _LazyGraphModule.force_recompile(gm)
    symbolic = any(isinstance(x, torch.SymInt) for x in example_inputs)
    compiled = CompiledFunction(gm, dynamic=True if symbolic else None, mode=mode)

    def run(*args: Any) -> Any:
        return compiled(*args)

    run.gjit = compiled  # the entries, for explain / debugging
    return run
