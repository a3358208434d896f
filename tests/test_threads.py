"""Threads that use gjit at once, as a server's workers do.

The threads of every test meet at a barrier, so they really collide.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest
import torch

import gjit
from gjit.module_copy import private_tree
from helpers import assert_same

pytestmark = pytest.mark.cpu


def run_threads(count: int, work: Callable[[int], Any], timeout: float = 300.0) -> list[Any]:
    """Run work(0) ... work(count - 1) on their own threads, under torch.no_grad(); each thread's
    result or exception."""
    results: list[Any] = [None] * count

    def run(i: int) -> None:
        try:
            with torch.no_grad():  # grad mode is per thread
                results[i] = work(i)
        except BaseException as e:  # noqa: BLE001 - the test reads it
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,), name=f"worker-{i}") for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), f"{t.name} did not finish in {timeout} s"
    return results


class Mlp(torch.nn.Module):
    """Linear, GELU, LayerNorm, Linear in float32, for inputs of any float dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32), torch.nn.Linear(32, 8)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.float()).to(x.dtype)


def test_counters_from_threads_add_up():
    """gjit.stats() counts every count of every thread: a Counter shared by threads loses the ones
    whose key two threads create at once (Counter.__missing__ is Python, where a thread switches)."""
    import importlib
    import sys

    stats = importlib.import_module("gjit.stats")  # (`from gjit import stats` is gjit.stats())
    barrier = threading.Barrier(8)

    def work(i: int) -> None:
        barrier.wait()
        for k in range(5000):
            stats.count(f"recompile_reason:{k}")

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        results = run_threads(8, work)
    finally:
        sys.setswitchinterval(interval)
    assert results == [None] * 8, results
    counts = gjit.stats()
    assert sum(v for k, v in counts.items() if k.startswith("recompile_reason:")) == 8 * 5000


def test_cached_calls_and_eager_calls_run_while_another_thread_compiles():
    """While one thread is inside a compile (export done, the compile lock held), another calls a
    cached entry and the model eagerly: neither waits, and both see the real weights (export traced
    a copy of the module tree, so the model's own parameters were never torch.export's fakes)."""
    model = Mlp().eval()
    cm = gjit.compile(model, dynamic=False)
    small, big = torch.randn(2, 16), torch.randn(6, 16)
    release, exporting = threading.Event(), threading.Event()
    forward = Mlp.forward

    def slow_forward(self: Mlp, x: torch.Tensor) -> torch.Tensor:  # export's trace waits here
        if threading.current_thread().name == "worker-0" and torch.compiler.is_exporting():
            exporting.set()
            assert release.wait(120)
        return forward(self, x)

    with gjit.config.scope(interpret=True), torch.no_grad():
        cm(small)
        with mock.patch.object(Mlp, "forward", slow_forward):

            def work(i: int) -> Any:
                if i == 0:
                    return cm(big)  # compiles; its export waits for `release`
                assert exporting.wait(120)
                try:
                    return [cm(small) for _ in range(3)], model(small)
                finally:
                    release.set()

            compiled_big, (cached, eager) = run_threads(2, work)
    for r in (compiled_big, cached, eager):
        assert not isinstance(r, BaseException), r
    want = model(small)
    for r in [*cached, eager]:
        assert type(r) is torch.Tensor
        assert_same(r, want)
    assert_same(compiled_big, model(big))
    assert gjit.stats()["compiles"] == 2


class Tangled(torch.nn.Module):
    """Submodules reached other than through their registration: a plain list, a bound method, a
    functools.partial, a module registered twice; and (hidden) one in a list inside a dict."""

    def __init__(self, hidden: bool = False) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        self.again = self.a  # registered twice: one module
        self.listed = [self.b]
        self.method = self.b.forward
        self.partial = functools.partial(torch.nn.Linear.forward, self.a)
        self.hidden = {"deep": [self.b]} if hidden else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.listed[0](x) + self.method(x) + self.partial(x) + self.again(x)
        return y + self.hidden["deep"][0](x) if self.hidden else y


def test_export_traces_a_copy_of_the_module_tree():
    model = Tangled().eval()
    copy = private_tree(model)
    assert copy is not model and type(copy) is Tangled and copy.again is copy.a is not model.a
    assert copy.listed[0] is copy.b and copy.method.__self__ is copy.b and copy.partial.args[0] is copy.a
    for name, p in model.named_parameters():
        assert copy.get_parameter(name) is p  # the same tensors, in tables of the copy's own
    assert copy.a._parameters is not model.a._parameters
    assert copy.a._forward_hooks is not model.a._forward_hooks
    assert model.listed[0] is model.b and model.method.__self__ is model.b  # the user's tree unchanged
    cm = gjit.compile(model)
    x = torch.randn(3, 8)
    with torch.no_grad(), gjit.config.scope(interpret=True):
        assert_same(cm(x), model(x))
        model.b.weight = torch.nn.Parameter(torch.randn(8, 8))  # read from the user's tree at each call
        assert_same(cm(x), model(x))
    assert gjit.stats()["compiles"] == 1 and gjit.stats()["eager_runs"] == 0


def test_a_tree_the_copy_cannot_redirect_is_exported_itself(caplog):
    """A submodule hidden where the copy does not look: the copy's trace would lift its weights as
    constants, so the model itself is exported (as before the copy), and its weights stay live."""
    model = Tangled(hidden=True).eval()
    cm = gjit.compile(model)
    x = torch.randn(3, 8)
    with torch.no_grad(), gjit.config.scope(interpret=True), caplog.at_level(logging.INFO, "gjit.capture"):
        assert_same(cm(x), model(x))
        model.b.weight = torch.nn.Parameter(torch.randn(8, 8))  # not a constant of the program
        assert_same(cm(x), model(x))
    assert "exporting the model itself" in caplog.text
