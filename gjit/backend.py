"""`torch.compile(model, backend="gjit")`: Dynamo hands each graph it captures to gjit.

Registered through the standard `torch_dynamo_backends` entry point (pyproject.toml), so no
import of gjit is needed before torch.compile. Graph breaks are Dynamo's; each graph Dynamo
passes (a torch-level FX GraphModule) is compiled by gjit like any module: exported,
decomposed, fused, guarded. Dynamo's own guards decide when this backend sees a new graph.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def gjit_backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable:
    from gjit.api import CompiledFunction

    compiled = CompiledFunction(gm)

    def run(*args: Any) -> Any:
        with torch.no_grad():  # gjit compiles inference graphs; Dynamo keeps autograd outside
            return compiled(*args)

    run.gjit = compiled  # the entries, for explain / debugging
    return run
