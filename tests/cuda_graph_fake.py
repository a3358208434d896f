"""A stand-in for torch's CUDA graph API on CPU (gjit/runtime/cuda_graphs.py's `GraphAPI`).

"Capture" runs the wrapper on the recorded inputs and then puts back what it wrote into them (a
real capture executes nothing); "replay" runs it again on the call's inputs (the borrowed ones,
at their recorded addresses, and the recording's own buffers) and copies what it computed into
the recorded outputs, so outputs keep the recording's memory as on a GPU.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from typing import Any

import torch


@dataclasses.dataclass
class FakeGraph:
    run: Callable[[list], list]
    outputs: list  # a weak reference per recorded tensor output (the recording keeps them)


class FakeGraphs:
    def __init__(self, fail: Exception | None = None):
        self.fail = fail  # raised by capture: a capture error
        self.captures = 0
        self.replays = 0

    def refusal(self, graph: Any, inputs: list) -> str | None:
        return None

    def stream(self, device: torch.device) -> None:
        return None

    def wait(self, stream: Any, other: Any) -> None:
        raise AssertionError("one stream on CPU")

    def warm_up(self, run: Callable, inputs: list, device: torch.device) -> list:
        return run(inputs)

    def capture(self, run: Callable, inputs: list, device: torch.device) -> tuple[FakeGraph, list]:
        if self.fail is not None:
            raise self.fail
        saved = [(t, t.clone()) for t in inputs if isinstance(t, torch.Tensor)]
        out = run(inputs)
        with torch.inference_mode():
            for t, before in saved:
                t.copy_(before)
        self.captures += 1
        refs = [weakref.ref(t) if isinstance(t, torch.Tensor) else None for t in out]
        return FakeGraph(run, refs), out

    def replay(self, handle: FakeGraph, inputs: list) -> None:
        fresh = handle.run(inputs)
        with torch.inference_mode():
            for ref, new in zip(handle.outputs, fresh):
                static = ref() if ref is not None else None
                if static is not None and static.data_ptr() != new.data_ptr():
                    static.copy_(new)
        self.replays += 1

    def wait_idle(self) -> None:
        pass
