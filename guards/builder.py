"""Guards of a compiled entry: which calls it may serve.

The guard set is a list of readable checks over the flattened user inputs, compiled into
ONE generated Python function for the hot path; `failures(...)` re-evaluates them one by
one to explain a miss. This first version specializes exactly: type, dtype, device, shape,
strides of every tensor input, and the value of every non-tensor input export baked in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch


@dataclasses.dataclass
class Guard:
    source: str  # a Python boolean expression over `inputs`
    description: str  # what a user reads when it fails
    actual: str  # expression whose value explains a failure


@dataclasses.dataclass
class GuardSet:
    guards: list[Guard]
    source: str
    check: Callable[[list[Any]], bool]

    def failures(self, flat_inputs: list[Any]) -> list[str]:
        """Every failing guard with expected and actual values (the slow, explaining path)."""
        env = {"inputs": flat_inputs, "torch": torch}
        out = []
        for g in self.guards:
            try:
                ok = eval(g.source, env)  # noqa: S307 - our own generated guard text
            except (
                Exception
            ) as e:  # a failed earlier guard (wrong type, too few inputs) can make later ones raise
                ok, actual = False, f"<{type(e).__name__}>"
            else:
                actual = repr(eval(g.actual, env)) if not ok else ""
            if not ok:
                out.append(f"{g.description}, got {actual}")
        return out

    def format(self) -> str:
        return "\n".join(f"{g.source}    # {g.description}" for g in self.guards)


def _tensor_guards(i: int, t: torch.Tensor, name: str) -> list[Guard]:
    v = f"inputs[{i}]"
    return [
        Guard(f"isinstance({v}, torch.Tensor)", f"{name} must be a Tensor", f"type({v}).__name__"),
        Guard(f"{v}.dtype == {t.dtype}", f"{name}.dtype == {t.dtype}", f"{v}.dtype"),
        Guard(
            f"{v}.device == torch.device({str(t.device)!r})", f"{name}.device == {t.device}", f"{v}.device"
        ),
        Guard(f"{v}.shape == {tuple(t.shape)}", f"{name}.shape == {tuple(t.shape)}", f"tuple({v}.shape)"),
        Guard(f"{v}.stride() == {t.stride()}", f"{name}.stride() == {t.stride()}", f"{v}.stride()"),
    ]


def build_guards(flat_inputs: list[Any], names: list[str]) -> GuardSet:
    guards: list[Guard] = [
        Guard(f"len(inputs) == {len(flat_inputs)}", f"{len(flat_inputs)} flattened inputs", "len(inputs)")
    ]
    for i, (value, name) in enumerate(zip(flat_inputs, names)):
        if isinstance(value, torch.Tensor):
            guards += _tensor_guards(i, value, name)
        elif value is None:
            guards.append(Guard(f"inputs[{i}] is None", f"{name} is None", f"inputs[{i}]"))
        else:
            guards.append(
                Guard(
                    f"type(inputs[{i}]) is {type(value).__name__}",
                    f"{name} is a {type(value).__name__}",
                    f"type(inputs[{i}]).__name__",
                )
            )
            guards.append(
                Guard(f"inputs[{i}] == {value!r}", f"{name} == {value!r} (specialized)", f"inputs[{i}]")
            )
    body = " and\n        ".join(g.source for g in guards)
    source = f"def guard(inputs):\n    return (\n        {body}\n    )\n"
    namespace: dict[str, Any] = {"torch": torch}
    exec(compile(source, "<gjit-guard>", "exec"), namespace)  # noqa: S102 - generated guard source
    return GuardSet(guards, source, namespace["guard"])
