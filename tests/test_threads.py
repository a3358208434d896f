"""Threads that call one compiled callable at once, as a server's workers do: every call answered
as eagerly, each size compiled once, cached calls never waiting for a compile, errors kept to the
thread that hit them (gjit/locks.py, gjit/capture/module_copy.py).

The first calls of every test meet at a barrier, so they really collide. Kernels run in Triton's
interpreter (one thread at a time: its state is process-wide); the compile lock, the entry list,
the counters, the kernel loads and the exports are what the threads share.
"""

from __future__ import annotations

import functools
import logging
import os
import random
import threading
import time
from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest
import torch

import gjit
from gjit import api
from gjit.capture.module_copy import private_tree
from gjit.runtime import graph as runtime_graph
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


def scaled_softmax(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x * y.sigmoid() + 1, dim=-1) * 2 - x.mean(0)


SIZES = (2, 3, 5)
DTYPES = (torch.float32, torch.bfloat16)
THREADS, CALLS = 8, 25


def test_threads_call_modules_and_functions_at_once():
    """8 threads x 25 calls over a module and a function, each compiled with dynamic=None and
    dynamic=False, mixed sizes and dtypes: every result equal to eager's, nothing raised, nothing
    run eagerly, and exactly the entries a single thread would compile (each compiled once)."""
    model = Mlp().eval()
    callables = {
        "module": (model, gjit.compile(model)),
        "module, dynamic=False": (model, gjit.compile(model, dynamic=False)),
        "function": (scaled_softmax, gjit.compile(scaled_softmax)),
        "function, dynamic=False": (scaled_softmax, gjit.compile(scaled_softmax, dynamic=False)),
    }
    names = list(callables)
    plans = []  # per thread: its calls (callable, size, dtype), seeded; the first is the same for all
    for i in range(THREADS):
        rng = random.Random(i)
        plans.append([(names[0], 3, torch.float32)])
        plans[-1] += [(rng.choice(names), rng.choice(SIZES), rng.choice(DTYPES)) for _ in range(CALLS - 1)]
    distinct = {(name, size, dtype) for plan in plans for name, size, dtype in plan}
    # dynamic=None: one entry per dtype serves every size (all at least 2); dynamic=False: one per shape
    expected = {
        name: len({(s if "False" in name else 0, d) for n, s, d in distinct if n == name}) for name in names
    }
    barrier = threading.Barrier(THREADS)

    def work(i: int) -> int:
        gen = torch.Generator().manual_seed(i)
        barrier.wait()
        for name, size, dtype in plans[i]:
            eager, compiled = callables[name]
            args = (torch.randn(size, 16, generator=gen).to(dtype),)
            if name.startswith("function"):
                args += (torch.randn(16, generator=gen).to(dtype),)
            got = compiled(*args)
            want = eager(*args)  # the model eagerly, maybe while another thread exports it
            assert_same(got, want)
        return len(plans[i])

    with gjit.config.scope(interpret=True, debug=True):
        results = run_threads(THREADS, work)
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[0]
    stats = gjit.stats()
    entries = {name: len(cm.entries) for name, (_, cm) in callables.items()}
    assert entries == expected, "each callable compiled exactly the entries its calls need"
    assert stats["compiles"] == sum(expected.values())
    assert stats["eager_runs"] == 0
    assert stats["cache_hits"] == THREADS * CALLS - stats["compiles"], "every counted call (no lost count)"


def _paused_compile(event: threading.Event, started: threading.Event):
    """Patch the driver's compile so that the compiling thread waits for `event` after export."""
    compile_program = api.compile_program

    def paused(*args: Any, **kwargs: Any) -> Any:
        started.set()
        assert event.wait(120), "the test never released the compile"
        return compile_program(*args, **kwargs)

    return mock.patch.object(api, "compile_program", paused)


def test_a_size_several_threads_need_first_compiles_once_and_they_wait_for_that_entry():
    """One thread compiles (held inside the compile); three more make the same call meanwhile: they
    wait for that entry and hit it, nobody compiles it again."""
    model = Mlp().eval()
    cm = gjit.compile(model)
    x = torch.randn(4, 16)
    release, started = threading.Event(), threading.Event()

    def work(i: int) -> torch.Tensor | None:
        if i == 4:  # lets the compile go on once the others are waiting for it
            assert started.wait(120)
            time.sleep(0.5)
            release.set()
            return None
        if i > 0:
            assert started.wait(120)
        return cm(x)

    with _paused_compile(release, started), gjit.config.scope(interpret=True), torch.no_grad():
        results = run_threads(5, work)
        want = model(x)
    for r in results[:4]:
        assert not isinstance(r, BaseException), r
        assert_same(r, want)
    assert (gjit.stats()["compiles"], gjit.stats()["cache_hits"]) == (1, 3)


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


class Picky(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 3:
            raise ValueError(f"Picky refuses {x.shape[0]} rows")
        return self.lin(x).relu()


def test_each_thread_gets_its_own_error():
    """A call the model itself refuses raises in its own thread only (as a single thread would see
    it: the export fails, the eager run raises the model's error); the others are answered."""
    model = Picky().eval()
    cm = gjit.compile(model, dynamic=False)
    barrier = threading.Barrier(6)

    def work(i: int) -> torch.Tensor:
        x = torch.randn(3 if i % 2 else 2 + i, 8)
        barrier.wait()
        return cm(x)

    with gjit.config.scope(interpret=True):
        results = run_threads(6, work)
    for i, r in enumerate(results):
        if i % 2:
            assert isinstance(r, ValueError) and str(r) == "Picky refuses 3 rows", r
        else:
            assert isinstance(r, torch.Tensor), r
            assert r.shape == (2 + i, 8)
    assert gjit.stats()["compiles"] == 3  # sizes 2, 4, 6


def test_an_interrupted_compile_leaves_nothing_behind():
    """A compile interrupted (KeyboardInterrupt) in one thread: that thread gets the interrupt, no
    entry is left, the lock is free, and the next call compiles and answers."""
    model = Mlp().eval()
    cm = gjit.compile(model)
    x = torch.randn(4, 16)
    compile_program = api.compile_program
    calls = []

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        calls.append(threading.current_thread().name)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return compile_program(*args, **kwargs)

    with mock.patch.object(api, "compile_program", interrupted), gjit.config.scope(interpret=True):
        (first,) = run_threads(1, lambda i: cm(x))
        assert isinstance(first, KeyboardInterrupt)
        assert cm.entries == [] and gjit.stats()["compiles"] == 0
        (second,) = run_threads(1, lambda i: cm(x))
    with torch.no_grad():
        assert_same(second, model(x))
    assert len(cm.entries) == 1 and gjit.stats()["compiles"] == 1


def test_threads_load_a_graph_once():
    """The first calls of an entry in several threads at once load its kernels and its wrapper once
    (two loads would be two JITFunctions, each built on a GPU)."""
    model = Mlp().eval()
    cm = gjit.compile(model)
    x = torch.randn(4, 16)
    with gjit.config.scope(interpret=True), torch.no_grad():
        cm(x)
        graph = cm.entries[0].program.graph
        graph._calls.clear()  # as a fresh process's first call finds it
        loads = []
        load_module = runtime_graph.load_module

        def counted(path: str, *args: Any, **kwargs: Any) -> Any:
            loads.append(path)
            time.sleep(0.05)  # an import takes a while: the others arrive meanwhile
            return load_module(path, *args, **kwargs)

        barrier = threading.Barrier(6)

        def work(i: int) -> torch.Tensor:
            barrier.wait()
            return cm(x)

        with (
            mock.patch.object(runtime_graph, "_KERNELS", {}),
            mock.patch.object(runtime_graph, "load_module", counted),
        ):
            results = run_threads(6, work)
    for r in results:
        assert not isinstance(r, BaseException), r
        assert_same(r, model(x))
    own = [k for k in graph.kernels if k.code_of is None]
    assert sorted(loads) == sorted([graph.kernel_paths[k.name] for k in own] + [graph.wrapper_path])


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


@pytest.mark.parametrize("how", ["method", "torch.compile"])
def test_methods_and_torch_compile_from_threads(how):
    """`model.forward = gjit.compile(model.forward)` and torch.compile(backend="gjit") from threads."""
    model = Mlp().eval()
    if how == "method":
        method = model.forward = gjit.compile(model.forward)
        call = model
    else:
        torch._dynamo.reset()
        call = torch.compile(model, backend="gjit")
    barrier = threading.Barrier(4)

    def work(i: int) -> list:
        gen = torch.Generator().manual_seed(i)
        barrier.wait()
        out = []
        for k in range(4):
            x = torch.randn(2 + (i + k) % 3, 16, generator=gen)
            out.append((x, call(x)))
        return out

    with gjit.config.scope(interpret=True):
        results = run_threads(4, work)
    if how == "method":
        del model.forward
    for r in results:
        assert not isinstance(r, BaseException), r
        for x, got in r:
            with torch.no_grad():
                assert_same(got, model(x))
    assert gjit.stats()["eager_runs"] == 0
    compiled = [cm for cm in list(api.LIVE) if cm.entries]
    assert gjit.stats()["compiles"] == sum(len(cm.entries) for cm in compiled) > 0
    if how == "method":
        assert gjit.stats()["compiles"] == len(method.entries) == 1  # sizes 2, 3, 4: one dynamic entry


@pytest.mark.slow  # CI's sweep step: 43 s of the default run, which stays in its 15 minutes
def test_generate_from_four_threads_matches_eager():
    """generate() of one tiny GPT-2 from 4 threads at once, prompts of other lengths: each thread's
    tokens equal eager's, and the two entries (prefill, decode) are compiled once each."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=500)
    model = transformers.GPT2LMHeadModel(config).eval()
    prompts = [
        torch.randint(3, 500, (2, 5 + i), generator=torch.Generator().manual_seed(i)) for i in range(4)
    ]

    def generate(ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            mask = torch.ones_like(ids)
            return model.generate(
                ids, attention_mask=mask, max_new_tokens=5, min_new_tokens=5, pad_token_id=0
            )

    want = [generate(p) for p in prompts]
    model.forward = gjit.compile(model.forward)
    barrier = threading.Barrier(4)

    def work(i: int) -> torch.Tensor:
        barrier.wait()
        return generate(prompts[i])

    with gjit.config.scope(interpret=True, debug=True):
        got = run_threads(4, work)
    for g, w in zip(got, want):
        assert not isinstance(g, BaseException), g
        assert torch.equal(g, w), f"tokens differ from eager\n{g}\n{w}"
    stats = gjit.stats()
    assert (stats["compiles"], stats["eager_runs"]) == (2, 0), "prefill and decode, each once"
    assert stats["cache_hits"] == 4 * 5 - 2


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


@pytest.mark.gpu
def test_threads_launch_on_their_own_streams():
    """Each thread under its own CUDA stream: every kernel launch of its calls goes to that stream
    (Triton's launcher reads the current stream at each launch; gjit keeps none)."""
    import triton

    model = Mlp().cuda().eval()
    cm = gjit.compile(model)
    x = torch.randn(64, 16, device="cuda")
    with torch.no_grad():
        cm(x)  # compiled, prebuilt and launched once
        want = model(x)
    launches: list[tuple[str, int]] = []
    previous = triton.knobs.runtime.launch_enter_hook
    triton.knobs.runtime.launch_enter_hook = lambda meta: launches.append(
        (threading.current_thread().name, meta.get()["stream"])  # Triton's LazyDict of the launch
    )
    streams = [torch.cuda.Stream() for _ in range(4)]

    def work(i: int) -> list[torch.Tensor]:
        out = []
        with torch.cuda.stream(streams[i]):
            for _ in range(5):
                out.append(cm(x))
        streams[i].synchronize()
        return out

    try:
        results = run_threads(4, work)
    finally:
        triton.knobs.runtime.launch_enter_hook = previous
    for r in results:
        assert not isinstance(r, BaseException), r
        for got in r:
            assert_same(got, want)
    assert launches, "no kernel launch was seen"
    for name, stream in launches:
        assert stream == streams[int(name.split("-")[1])].cuda_stream, (name, stream)


SOAK_SECONDS = float(os.environ.get("GJIT_TEST_SOAK_SECONDS", "60"))


@pytest.mark.soak  # GJIT_TEST_SOAK=1 runs it (tests/conftest.py), CI's sweep step does
@pytest.mark.filterwarnings("ignore")  # generated programs hit ops that warn by design (as in test_fuzz)
def test_soak_random_programs_from_32_threads():
    """32 threads for GJIT_TEST_SOAK_SECONDS (60) over random programs from the fuzzer, each
    compiled once and called by whichever thread draws it, at either of its two sizes: counts of
    calls, compiles, errors (0) and mismatches (0), printed; and no entry compiled twice (each
    entry admits a call that no entry before it admits)."""
    import fuzz

    programs = [fuzz.generate(seed) for seed in range(24)]
    cases = []
    for program in programs:
        fn = program.function()
        rounded = fuzz.evaluate(program)
        precisions = [rounded[o] for o in program.outputs] if rounded else [None] * len(program.outputs)
        calls = [program.args(k) for k in range(len(program.sizes))]
        references = [fuzz._reference(fn, a) for a in calls]  # float64, for the outputs eager rounds
        cases.append((gjit.compile(fn), calls, [fn(*a) for a in calls], references, precisions))
    counts = {"calls": 0, "errors": 0, "mismatches": 0}
    failures: list[str] = []
    lock = threading.Lock()
    deadline = time.monotonic() + SOAK_SECONDS
    barrier = threading.Barrier(32)

    def work(i: int) -> None:
        rng = random.Random(i)
        barrier.wait()
        while time.monotonic() < deadline:
            k = rng.randrange(len(cases))
            compiled, calls, expected, references, precisions = cases[k]
            c = rng.randrange(len(calls))
            outcome = "calls"
            try:
                actual = compiled(*calls[c])
                for n, (a, e, p) in enumerate(zip(actual, expected[c], precisions)):
                    try:  # as fuzz.check compares
                        fuzz.compare(a, e, None, p)
                    except AssertionError:
                        fuzz.compare(a, e, references[c][n] if references[c] else None, p)
            except AssertionError as e:
                outcome = "mismatches"
                failures.append(f"program {k} call {c}: {e}")
            except Exception as e:  # noqa: BLE001 - counted and reported
                outcome = "errors"
                failures.append(f"program {k} call {c}: {type(e).__name__}: {e}")
            with lock:
                counts["calls"] += 1
                if outcome != "calls":
                    counts[outcome] += 1

    with gjit.config.scope(interpret=True, debug=True, recompile_limit=8), torch.no_grad():
        results = run_threads(32, work, timeout=SOAK_SECONDS + 600)
    stats = gjit.stats()
    counts |= {
        "compiles": stats["compiles"],
        "eager_runs": stats["eager_runs"],
        "cache_hits": stats["cache_hits"],
    }
    print(f"\nsoak, 32 threads, {SOAK_SECONDS:g} s, {len(cases)} programs: {counts}")
    assert not [r for r in results if isinstance(r, BaseException)]
    assert counts["errors"] == counts["mismatches"] == counts["eager_runs"] == 0, failures[:5]
    assert stats["compiles"] == sum(len(compiled.entries) for compiled, *_ in cases)
    assert stats["cache_hits"] + stats["compiles"] + stats["eager_runs"] >= counts["calls"]
    for k, (compiled, calls, *_) in enumerate(cases):
        flats = [list(a) for a in calls]
        for index, entry in enumerate(compiled.entries):
            admitted = {c for c, flat in enumerate(flats) if entry.guards.check(flat) is not None}
            earlier = {
                c
                for c, flat in enumerate(flats)
                for e in compiled.entries[:index]
                if e.guards.check(flat) is not None
            }
            assert admitted - earlier, (
                f"program {k}: entry {index} was compiled for a call an earlier entry admits"
            )
