"""The torch and Triton internals gjit reaches whose names moved between the versions it runs under.

gjit declares torch >= 2.6. CI tests it under the pinned torch 2.13, and runs the runtime's tests under
the GPU lease image's torch 2.11 and Triton 3.6 too (.ci/gpu_image.txt). Each name here is the newer
spelling, with the older one where a version lacks it; nothing else in gjit imports either directly.
"""

from __future__ import annotations

import torch
from torch.fx.experimental import symbolic_shapes

if hasattr(symbolic_shapes, "optimization_hint"):  # torch >= 2.12
    optimization_hint = symbolic_shapes.optimization_hint
else:

    def optimization_hint(a: torch.SymInt | int, fallback: int | None = None) -> int:
        """A size's example value, for choices that must not add a guard (older torch: size_hint)."""
        return symbolic_shapes.size_hint(a, fallback)
