"""Kernels built while codegen still writes the program (gjit/runtime/early_builds.py), checked
without a GPU: compiles on CPU tensors are told they are for a GPU (the one seam: `wanted`), and
Triton's launcher, on a driver that names an H100 (sm_90) and launches nothing, must find each
kernel of the real first call in Triton's on-disk cache, where the workers put it."""

import multiprocessing
import sys
import threading
import time

import pytest
import torch
import triton
from test_prebuild import INPUTS, MlpNorm, jit_first_launches

import gjit
from gjit import driver, progress
from gjit.runtime import early_builds, interpret, prebuild
from gjit.runtime import graph as graph_module
from helpers import first_graph_call

pytestmark = pytest.mark.compile_only

_GATE = None  # set to an event before a compile: its build workers (forked after) wait for it
_build_one = prebuild.build_one


def gated_build(*args):
    """A worker's build held until the test opens the gate (picklable: workers look it up here)."""
    _GATE.wait(30)
    return _build_one(*args)


@pytest.fixture
def gate(monkeypatch):
    """The early builds started from now on wait in their workers until `gate.set()`."""
    opened = multiprocessing.get_context("fork").Event()
    monkeypatch.setattr(sys.modules[__name__], "_GATE", opened)
    monkeypatch.setattr(prebuild, "build_one", gated_build)
    yield opened
    opened.set()
    ended(list(prebuild._pending))  # none ends in the next test, whose Triton cache is another folder


def ended(futures) -> None:
    """Until `futures` are done and their callbacks (in the pool's thread) have run."""
    for f in futures:
        f.exception(timeout=60)
    deadline = time.monotonic() + 30
    while any(f in prebuild._pending or f in prebuild._building.values() for f in futures):
        assert time.monotonic() < deadline
        time.sleep(0.01)


class Layers(torch.nn.Module):
    """Three alike layers, a product between each two: their kernels are one code (codegen/share.py)."""

    def __init__(self):
        super().__init__()
        self.fcs = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(3))
        self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(32) for _ in range(3))

    def forward(self, x):
        for fc, norm in zip(self.fcs, self.norms):
            x = torch.tanh(norm(fc(x))) + x
        return x


@pytest.fixture
def early(sm90, monkeypatch):
    """Compiles of CPU graphs start early builds as on a GPU; the EarlyBuilds each one made, and
    for each kernel codegen generated, the builds started before it."""
    monkeypatch.setattr(early_builds, "wanted", lambda graph: True)
    made, started = [], []
    start, generate = early_builds.start, driver.generate_kernel

    def spy_start(graph, hints, kernels):
        made.append(start(graph, hints, kernels))
        return made[-1]

    def spy_generate(*args, **kwargs):
        started.append(gjit.stats().get("kernels_built_early", 0))
        return generate(*args, **kwargs)

    monkeypatch.setattr(early_builds, "start", spy_start)
    monkeypatch.setattr(driver, "generate_kernel", spy_generate)
    return made, started


def first_launches(graph, args, sizes) -> list[bool]:
    """Each kernel launch of the real call through Triton's launcher: found in Triton's cache (True)
    or compiled at the launch (False)."""
    return jit_first_launches(graph, args, sizes, graph.call_fn(interpret=False).__globals__)


@pytest.mark.parametrize("inputs", list(INPUTS))
def test_each_kernel_builds_while_the_later_ones_are_generated(early, inputs):
    made, started = early
    before = gjit.stats().get("kernels_built_early", 0)
    _, graph, args, sizes = first_graph_call(MlpNorm().eval(), INPUTS[inputs]())
    assert len(made) == 1 and made[0] is not None
    assert [n - before for n in started] == [0, 1, 2]  # kernel k's build started before kernel k + 1
    made[0].wait()
    assert gjit.stats()["kernels_built_early"] - before == 3
    # the real first call's launches find every binary: the foreseen launches were the real ones
    assert first_launches(graph, args, sizes) == [True] * 3


def test_the_first_calls_prebuild_waits_for_early_builds_and_starts_none_again(early):
    made, _ = early
    _, graph, args, sizes = first_graph_call(MlpNorm().eval(), INPUTS["contiguous"]())
    before = gjit.stats().get("kernels_prebuilt", 0)
    built = graph.prebuild(graph.call_fn(interpret=False), args, sizes)  # builds may still run
    assert gjit.stats().get("kernels_prebuilt", 0) == before
    assert len(built.builds) == 3
    joined = [f for futures in built.futures.values() for f in futures]
    assert set(joined) <= set(made[0].futures)
    assert sum(b.cached for b in built.builds) + len(joined) == 3
    built.wait()
    made[0].wait()
    assert first_launches(graph, args, sizes) == [True] * 3


def test_alike_layers_build_their_one_kernel_once(early):
    made, _ = early
    before = gjit.stats().get("kernels_built_early", 0)
    with gjit.config.scope(matmul="aten"):  # the products between the layers' kernels
        _, graph, args, sizes = first_graph_call(Layers().eval(), torch.randn(4, 8, 32))
    shared = [k for k in graph.kernels if k.code_of is not None]
    assert len(graph.kernels) == 3 and len(shared) == 2
    made[0].wait()
    assert gjit.stats()["kernels_built_early"] - before == 1
    # three launches of one function: its binary loaded once, from Triton's cache (none compiled)
    assert first_launches(graph, args, sizes) == [True]


def test_a_launch_foreseen_wrong_is_built_by_the_first_calls_prebuild(early, monkeypatch):
    """The prediction decides nothing: early builds of another alignment than the call's leave the
    real specializations to the first call's prebuild."""
    made, _ = early
    monkeypatch.setattr(early_builds.EarlyBuilds, "offset", lambda self, name: 4)
    _, graph, args, sizes = first_graph_call(MlpNorm().eval(), INPUTS["contiguous"]())
    made[0].wait()
    before = gjit.stats().get("kernels_prebuilt", 0)
    built = graph.prebuild(graph.call_fn(interpret=False), args, sizes)
    assert gjit.stats()["kernels_prebuilt"] - before == 3 and not any(b.cached for b in built.builds)
    built.wait()
    assert first_launches(graph, args, sizes) == [True] * 3


def test_a_graph_on_the_cpu_starts_no_early_build(sm90):
    before = gjit.stats().get("kernels_built_early", 0)
    first_graph_call(MlpNorm().eval(), INPUTS["contiguous"]())
    assert gjit.stats().get("kernels_built_early", 0) == before


def test_one_worker_and_no_remote_cache_start_no_early_build(early):
    made, _ = early
    with gjit.config.scope(compile_workers=1):
        first_graph_call(MlpNorm().eval(), INPUTS["contiguous"]())
    assert made == [None]


def test_a_graph_of_few_kernels_forks_no_more_workers_than_it_has_kernels(early):
    made, _ = early
    with gjit.config.scope(compile_workers=8):
        first_graph_call(MlpNorm().eval(), INPUTS["contiguous"]())
    made[0].wait()
    assert made[0].workers == 3 and made[0].pool._max_workers == 3


def test_an_early_build_that_fails_leaves_the_compile_alone(early, monkeypatch):
    made, _ = early

    def broken(*args, **kwargs):
        raise RuntimeError("no specialization")

    monkeypatch.setattr(prebuild, "specializations", broken)
    first_graph_call(MlpNorm().eval(), INPUTS["contiguous"]())  # compiled, and matches eager
    assert "no specialization" in made[0].failed and not made[0].futures


def test_a_build_ending_while_the_first_call_looks_is_waited_for_not_started_again(early, gate, monkeypatch):
    """The pool's thread takes a build out of the builds in flight when it ends; the first call's
    prebuild, which looked at Triton's cache before that, must still wait for it, not build it again."""
    made, _ = early
    _, graph, args, sizes = first_graph_call(MlpNorm().eval(), INPUTS["contiguous"]())
    assert len(made[0].futures) == 3 and not any(f.done() for f in made[0].futures)
    specializations = prebuild.specializations

    def then_the_builds_end(launches, kernels):
        builds = specializations(launches, kernels)  # Triton's cache looked at: none there yet
        gate.set()
        ended(made[0].futures)
        return builds

    monkeypatch.setattr(prebuild, "specializations", then_the_builds_end)
    before = gjit.stats().get("kernels_prebuilt", 0)
    built = graph.prebuild(graph.call_fn(interpret=False), args, sizes)
    assert not any(b.cached for b in built.builds)
    assert gjit.stats().get("kernels_prebuilt", 0) == before, "an early build was started again"
    assert {f for futures in built.futures.values() for f in futures} == set(made[0].futures)
    built.wait()
    assert first_launches(graph, args, sizes) == [True] * 3


def test_the_next_compiles_progress_line_counts_none_of_the_last_ones_builds(early, gate, monkeypatch):
    """Builds that outlive their compile (a torch.cond branch not taken, a choice tuning dropped, a
    launch foreseen wrong) are not the next compile's: its line must not say "built 3/0"."""
    made, _ = early
    first_graph_call(MlpNorm().eval(), INPUTS["contiguous"]())  # its three builds held in the workers
    counts = []
    generate = driver.generate_kernel

    def at_the_first_kernel(*args, **kwargs):
        if not counts:
            gate.set()
            ended(made[0].futures)  # the last compile's builds end during this one
            counts.append((progress._LINE.built, progress._LINE.builds))
        return generate(*args, **kwargs)

    monkeypatch.setattr(driver, "generate_kernel", at_the_first_kernel)
    first_graph_call(
        torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.Softmax(-1)).eval(), torch.randn(8, 32)
    )
    assert counts == [(0, 0)]


def test_workers_forked_while_another_thread_interprets_kernels_still_build(early):
    """A thread running kernels in Triton's interpreter has `tl`'s helpers (tl.sum, ...) swapped
    for interpreted ones; build workers forked meanwhile must build with Triton's own."""
    made, _ = early
    inside = threading.Event()

    def interpreting():  # until the compile below has handed its three builds to forked workers
        with interpret.stdlib_interpreted():
            inside.set()
            deadline = time.monotonic() + 30
            while not (made and made[0] and len(made[0].futures) == 3) and time.monotonic() < deadline:
                time.sleep(0.01)

    other = threading.Thread(target=interpreting)
    other.start()
    inside.wait(30)
    _, graph, args, sizes = first_graph_call(MlpNorm().eval(), INPUTS["contiguous"]())
    other.join()
    made[0].wait()
    assert [f.exception() for f in made[0].futures] == [None] * 3
    assert first_launches(graph, args, sizes) == [True] * 3


def test_workers_forked_while_another_thread_loads_an_interpreted_kernel_still_build(early, monkeypatch):
    """An interpreted load sets Triton's process-wide `runtime.interpret` while it imports (holding
    LOAD_LOCK, which the compile does not hold when it forks): the workers must build GPU kernels."""
    made, _ = early
    loading = threading.Event()
    specializations = prebuild.specializations

    def load_interpreted():
        with graph_module.LOAD_LOCK, triton.knobs.runtime.scope():
            triton.knobs.runtime.interpret = True
            loading.set()
            time.sleep(1.0)

    def then_another_thread_loads(launches, kernels):
        builds = specializations(launches, kernels)
        if not loading.is_set():  # before the first build's workers fork
            threading.Thread(target=load_interpreted).start()
            loading.wait(30)
        return builds

    monkeypatch.setattr(prebuild, "specializations", then_another_thread_loads)
    _, graph, args, sizes = first_graph_call(MlpNorm().eval(), INPUTS["contiguous"]())
    made[0].wait()
    assert [f.exception() for f in made[0].futures] == [None] * 3
    assert first_launches(graph, args, sizes) == [True] * 3


def test_the_first_call_of_a_graph_with_one_kernel_waits_for_its_early_build(early, gate):
    """One kernel file (here three layers of one code) builds nothing in parallel at the first call,
    but its early build, still running, is waited for rather than compiled again at the launch."""
    made, _ = early
    with gjit.config.scope(matmul="aten"):
        _, graph, args, sizes = first_graph_call(Layers().eval(), torch.randn(4, 8, 32))
    assert len(made[0].futures) == 1 and not made[0].futures[0].done()
    built = graph.prebuild(graph.call_fn(interpret=False), args, sizes)
    assert built is not None and [f for fs in built.futures.values() for f in fs] == made[0].futures
    gate.set()
    built.wait()
    assert first_launches(graph, args, sizes) == [True]
