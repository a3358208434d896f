"""A graph's kernels built in worker processes before their first launch on a GPU
(gjit/runtime/prebuild.py), checked without a GPU: Triton's launcher, on a driver that names an
H100 (sm_90) and launches nothing, must find every kernel of the real first call in Triton's
on-disk cache, where the workers put it."""

import base64
import concurrent.futures
import dataclasses
import json
import logging
import threading
import time

import pytest
import torch
import triton

import gjit
from gjit import tuning, wrapper
from gjit.choice.library import call_key
from gjit.runtime import graph as graph_module
from gjit.runtime import package, padded_mm, prebuild, triton_binaries
from helpers import first_graph_call, kernel_launches, through_tritons_launcher

pytestmark = pytest.mark.compile_only


class MlpNorm(torch.nn.Module):
    """Three kernels: a matmul with its epilogue, a row reduction, a column reduction."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(32, 64)
        self.norm = torch.nn.LayerNorm(64)

    def forward(self, x):
        h = torch.nn.functional.gelu(self.fc(x))
        return self.norm(h).softmax(-1), (h * 2).sum(0)


def first_call(model, *args):
    """The graph of `model`'s compiled entry, and its wrapper's inputs and sizes at the first call
    (run in the interpreter and compared with eager)."""
    return first_graph_call(model, *args)[1:]


def jit_first_launches(graph, inputs, sizes, namespace) -> list[bool]:
    """Each kernel launch of the real call, through Triton's launcher: whether it found its binary
    in Triton's cache (True) or compiled it (False)."""
    return through_tritons_launcher(namespace, kernel_launches(graph, inputs, sizes))


INPUTS = {
    "contiguous": lambda: torch.randn(3, 40, 32),
    "unaligned view": lambda: torch.randn(3, 40, 33)[..., 1:],  # 4 bytes past an aligned address
    "size-1 batch": lambda: torch.randn(1, 16, 32),  # sizes of 1 and multiples of 16
}


@pytest.mark.parametrize("inputs", list(INPUTS))
def test_every_first_launch_finds_its_binary_built_by_a_worker(sm90, inputs):
    graph, args, sizes = first_call(MlpNorm().eval(), INPUTS[inputs]())
    call = graph.call_fn(interpret=False)
    before = gjit.stats().get("kernels_prebuilt", 0)
    built = graph.prebuild(call, args, sizes)
    assert built is not None and built.stopped == ""
    assert len(built.launches) == 3 and len(built.builds) == 3 and not any(b.cached for b in built.builds)
    assert gjit.stats()["kernels_prebuilt"] - before == 3
    names = {k.name for k in graph.kernels}
    assert {n for n, v in call.__globals__.items() if isinstance(v, prebuild.Awaiting)} == names
    built.wait()
    assert jit_first_launches(graph, args, sizes, call.__globals__) == [True] * 3


def test_without_the_workers_the_first_launches_compile(sm90):
    """The check above can fail: the same launches on an empty cache compile, one by one."""
    graph, args, sizes = first_call(MlpNorm().eval(), INPUTS["contiguous"]())
    call = graph.call_fn(interpret=False)
    assert jit_first_launches(graph, args, sizes, call.__globals__) == [False] * 3


def test_kernels_in_tritons_cache_start_no_worker(sm90):
    graph, args, sizes = first_call(MlpNorm().eval(), INPUTS["contiguous"]())
    graph.prebuild(graph.call_fn(interpret=False), args, sizes).wait()
    graph._calls.clear()  # a new process's wrapper, say: Triton's cache has every kernel
    call = graph.call_fn(interpret=False)
    again = graph.prebuild(call, args, sizes)
    assert [b.cached for b in again.builds] == [True] * 3 and not again.futures
    assert not any(isinstance(v, prebuild.Awaiting) for v in call.__globals__.values())


def test_the_fake_run_stops_at_data_and_later_kernels_build_at_launch(sm90, caplog):
    def f(x):
        y = torch.sin(x) * 2 + 1
        picked = y[y > 1]  # nonzero: fake tensors have no data to size it
        return torch.cos(picked) + picked.sum()

    graph, args, sizes = first_call(f, torch.randn(64, 8))
    with caplog.at_level(logging.INFO, logger="gjit.cache"):
        built = graph.prebuild(graph.call_fn(interpret=False), args, sizes)
    assert built is not None and built.stopped, built
    first = built.launches and built.launches[0].name
    assert [launch.name for launch in built.launches] == [first]  # the kernel before the nonzero
    assert any("fake run stopped" in r.getMessage() for r in caplog.records)


class Linears(torch.nn.Module):
    """Two linears run by ATen between kernels: the wrapper views each weight with gjit_reinterpret."""

    def __init__(self):
        super().__init__()
        self.fc, self.out = torch.nn.Linear(32, 64), torch.nn.Linear(64, 16)

    def forward(self, x):
        return self.out(torch.nn.functional.gelu(self.fc(x))).softmax(-1)


def test_the_fake_run_goes_on_past_views_built_from_their_traced_layout(sm90):
    """A view the wrapper builds with gjit_reinterpret (a weight's transpose for ATen's addmm) is a
    fake tensor in the fake run too: the run reaches every kernel, none is left to build at launch."""
    with gjit.config.scope(matmul="aten"):
        graph, args, sizes = first_call(Linears(), torch.randn(3, 40, 32))
    assert "gjit_reinterpret(p_fc_weight," in graph.wrapper_source
    built = graph.prebuild(graph.call_fn(interpret=False), args, sizes)
    assert built is not None and not built.stopped, built
    built.wait()  # its builds end in this test's Triton cache (a later test's predicts entries)
    assert [launch.name for launch in built.launches] == [k.name for k in graph.kernels]


def test_a_padded_products_copy_out_is_prebuilt_with_the_graphs_kernels(sm90, monkeypatch):
    """A product padded for the tensor cores (gjit/runtime/padded_mm.py) hands its copy out to
    kernels/column_copy.py's kernel by name: the fake run records that launch, a worker builds it,
    and the real launch (its own tensors) finds the binary."""
    monkeypatch.setattr(wrapper, "PAD_DEVICES", {"cuda", "cpu"})
    model = torch.nn.Sequential(torch.nn.Linear(48, 300), torch.nn.GELU()).to(torch.bfloat16)
    rows = padded_mm.LEAST_ROWS + 5
    with gjit.config.scope(matmul="aten"):
        graph, args, sizes = first_call(model, torch.randn(rows, 48, dtype=torch.bfloat16))
    assert f"copy={wrapper.COLUMN_COPY})" in graph.wrapper_source
    call = graph.call_fn(interpret=False)
    built = graph.prebuild(call, args, sizes)
    assert built is not None and not built.stopped, built
    assert [launch.name for launch in built.launches] == [wrapper.COLUMN_COPY, graph.kernels[0].name]
    assert {b.name for b in built.builds} == {wrapper.COLUMN_COPY, graph.kernels[0].name}
    built.wait()
    padded, out = torch.empty(rows, 304, dtype=torch.bfloat16), torch.empty(rows, 300, dtype=torch.bfloat16)
    (grid, kwargs) = next((x.grid, x.kwargs) for x in built.launches if x.name == wrapper.COLUMN_COPY)
    launch = (wrapper.COLUMN_COPY, grid, (padded, out, out.numel()), kwargs)
    assert through_tritons_launcher(call.__globals__, [launch]) == [True]


class Kernel:
    """Stands in for a JITFunction: records the grids it is launched with."""

    def __init__(self):
        self.grids = []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return lambda *args, **kwargs: args


def test_a_launch_waits_for_its_own_build_only_then_binds_the_kernel():
    kernel, pending, done = Kernel(), concurrent.futures.Future(), concurrent.futures.Future()
    done.set_result(0.1)
    namespace = {}
    namespace["a"] = prebuild.Awaiting(kernel, [done], namespace, "a")
    namespace["b"] = prebuild.Awaiting(Kernel(), [pending], namespace, "b")
    assert namespace["a"][(4,)](1, 2) == (1, 2)  # b's build still running: a does not wait for it
    assert namespace["a"] is kernel and kernel.grids == [(4,)]
    threading.Timer(0.2, pending.set_result, (0.2,)).start()
    start = time.perf_counter()
    namespace["b"][(1,)]()
    assert time.perf_counter() - start >= 0.15 and isinstance(namespace["b"], Kernel)


def test_a_kernel_awaiting_its_build_is_described_as_the_kernel():
    """A padded product's `copy=` is the Awaiting at its first call and the kernel after: the
    choice's library side keys extern calls by their arguments (a kernel by its repr), and timed
    two such products of one shape as two calls."""
    kernel = Kernel()
    awaiting = prebuild.Awaiting(kernel, [], {}, "k")
    op, args = torch.ops.aten.mm.default, (torch.empty(2, 3), torch.empty(3, 4))
    assert call_key(op, args, {"copy": awaiting}) == call_key(op, args, {"copy": kernel})


def test_a_failed_build_is_logged_and_the_launch_builds_it(caplog, monkeypatch):
    monkeypatch.setattr(prebuild, "_warned", False)  # the first failure of a process is a warning
    kernel, failed = Kernel(), concurrent.futures.Future()
    failed.set_exception(RuntimeError("ptxas died"))
    namespace = {}
    namespace["k"] = prebuild.Awaiting(kernel, [failed], namespace, "k")
    with caplog.at_level(logging.WARNING, logger="gjit.cache"):
        namespace["k"][(2,)]()
    assert kernel.grids == [(2,)] and "ptxas died" in caplog.text


def test_one_worker_or_one_kernel_prebuilds_nothing(sm90):
    graph, args, sizes = first_call(MlpNorm().eval(), INPUTS["contiguous"]())
    call = graph.call_fn(interpret=False)
    with gjit.config.scope(compile_workers=1):
        assert graph.prebuild(call, args, sizes) is None
    graph, args, sizes = first_call(lambda x: torch.sin(x) + 1, torch.randn(8, 8))
    assert len(graph.kernels) == 1
    with gjit.config.scope(compile_workers=4):
        assert graph.prebuild(graph.call_fn(interpret=False), args, sizes) is None


WRAPPER = """
def call(args, sizes):
    x, = args
    buf = gjit_alloc((4, 8), (8, 1), torch.float32, torch.device("cpu"))
    k1[(1,)](x, buf, 32, XBLOCK=32)
    c1[(1,)](buf)
    view = aten.slice.Tensor(buf, 1, 1, 8)
    k2[(2,)](view, x[1:], 1, XBLOCK=16, num_warps=2)
    out = branch((buf,))
    k1[(3,)](x, out, 32, XBLOCK=32)
    return (out,)
"""


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_the_fake_run_records_each_launch_as_the_launcher_will_see_it(mode):
    namespace = {"torch": torch, "aten": torch.ops.aten, "k1": None, "k2": None, "c1": None, "branch": None}
    namespace["gjit_alloc"] = lambda *a: pytest.fail("the fake run allocates real memory")
    exec(WRAPPER, namespace)
    with getattr(torch, mode)():
        x = torch.randn(4, 8)
        launches, stopped = prebuild.record_launches(
            namespace["call"], ["k1", "k2"], ["c1"], ["branch"], [x], ()
        )
    at = x.data_ptr()
    assert [(launch.name, launch.grid) for launch in launches] == [("k1", (1,)), ("k2", (2,))]
    assert launches[0].args == [prebuild.Pointer(torch.float32, at), prebuild.Pointer(torch.float32, 0), 32]
    # a view of a buffer 4 bytes into it; a view of an input 32 bytes past the input's address
    assert launches[1].args == [
        prebuild.Pointer(torch.float32, 4),
        prebuild.Pointer(torch.float32, at + 32),
        1,
    ]
    assert launches[1].kwargs == {"XBLOCK": 16, "num_warps": 2}
    assert "torch.cond branch" in stopped  # the launch after the branch: not recorded


@pytest.mark.gpu
@pytest.mark.parametrize("tune", [False, True])
def test_on_a_gpu_the_first_call_launches_what_the_workers_built(tmp_path, monkeypatch, tune):
    """The real path: codegen starts each kernel's build (gjit/runtime/early_builds.py), the first
    call on CUDA prebuilds what is left (tuning's first run too), and without tuning every launch
    of this process loads a binary a worker built (Triton's launcher compiles nothing itself;
    tuning compiles its other configurations here)."""
    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path))
    monkeypatch.setattr(graph_module, "_KERNELS", {})
    hits = []
    monkeypatch.setattr(triton.knobs.compilation, "listener", lambda **kw: hits.append(kw["cache_hit"]))
    model, x = MlpNorm().cuda().eval(), torch.randn(3, 40, 32, device="cuda")
    built = ("kernels_built_early", "kernels_prebuilt")
    before = sum(gjit.stats().get(k, 0) for k in built)
    with gjit.config.scope(compile_workers=2, tune=tune), torch.no_grad():
        out = gjit.compile(model)(x)
        expected = model(x)
    assert sum(gjit.stats().get(k, 0) for k in built) - before >= 3
    assert gjit.stats().get("kernels_built_early", 0) > 0
    if not tune:
        assert hits == [True] * 3
    for a, b in zip(out, expected):
        torch.testing.assert_close(a, b)


def test_a_package_carries_the_binaries_its_first_calls_built(sm90, tmp_path, monkeypatch):
    model, x = MlpNorm().eval(), INPUTS["contiguous"]()
    compiled, graph, args, sizes = first_graph_call(model, x)
    graph.prebuild(graph.call_fn(interpret=False), args, sizes)  # what its first call on a GPU does
    gjit.save(compiled, str(tmp_path / "plain.gjit"))
    gjit.save(compiled, str(tmp_path / "m.gjit"), binaries=True)
    assert not [m for m in package.read(str(tmp_path / "plain.gjit"))[1] if m.startswith("binaries/")]
    # a new machine with the same GPU: an empty Triton cache, nothing compiled in memory
    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path / "new"))
    monkeypatch.setattr(graph_module, "_KERNELS", {})
    before = gjit.stats().get("package_binaries_installed", 0)
    loaded = gjit.load(str(tmp_path / "m.gjit"), model=model)
    assert gjit.stats()["package_binaries_installed"] - before == 3
    with gjit.config.scope(interpret=True), torch.no_grad():
        for a, b in zip(loaded(x), model(x)):
            torch.testing.assert_close(a, b)
    served = loaded.entries[0].program.graph
    namespace = served.call_fn(interpret=False).__globals__
    assert jit_first_launches(served, args, sizes, namespace) == [True] * 3
    gjit.load(str(tmp_path / "m.gjit"), model=model)  # already in Triton's cache: none installed again
    assert gjit.stats()["package_binaries_installed"] - before == 3


def test_a_package_whose_binary_is_another_kernels_is_refused(sm90, tmp_path):
    model, x = MlpNorm().eval(), INPUTS["contiguous"]()
    compiled, graph, args, sizes = first_graph_call(model, x)
    graph.prebuild(graph.call_fn(interpret=False), args, sizes)
    gjit.save(compiled, str(tmp_path / "m.gjit"), binaries=True)
    manifest, members = package.read(str(tmp_path / "m.gjit"))
    first, second = sorted(m for m in members if m.startswith("binaries/"))[:2]
    members[first] = members[second]  # consistent hashes: only gjit's own check can find it
    manifest = {k: v for k, v in manifest.items() if k not in ("format", "versions", "members")}
    package.write(str(tmp_path / "m.gjit"), manifest, members)
    with pytest.raises(gjit.PackageError, match="kernel binary .* is damaged: a value of entry"):
        gjit.load(str(tmp_path / "m.gjit"), model=model)


def test_a_prebuild_that_fails_is_logged_once_and_leaves_the_call_alone(sm90, caplog, monkeypatch):
    graph, args, sizes = first_call(MlpNorm().eval(), INPUTS["contiguous"]())
    monkeypatch.setattr(prebuild, "_warned", False)

    def broken(*a, **k):
        raise KeyError("compile")  # say, another Triton's jit_cache_hook arguments

    monkeypatch.setattr(prebuild, "specializations", broken)
    call = graph.call_fn(interpret=False)
    names = {k.name: call.__globals__[k.name] for k in graph.kernels}
    with caplog.at_level(logging.INFO, logger="gjit.cache"):
        assert graph.prebuild(call, args, sizes) is None
        assert graph.prebuild(call, args, sizes) is None
    failures = [r for r in caplog.records if "prebuilding the kernels failed" in r.getMessage()]
    assert [r.levelno for r in failures] == [logging.WARNING, logging.INFO]
    assert {k.name: call.__globals__[k.name] for k in graph.kernels} == names  # the kernels themselves


def test_a_prebuild_while_tunings_probes_wrap_the_kernels_still_builds_them(sm90):
    graph, args, sizes = first_call(MlpNorm().eval(), INPUTS["contiguous"]())

    class Probe:  # like gjit/tuning.py's: a launch through it, no Triton launcher of its own
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return self.kernel[grid]

    with tuning.kernels_wrapped(graph, lambda name, kernel: Probe(kernel)):
        built = graph.prebuild(graph.call_fn(interpret=False), args, sizes)
        built.wait()
    assert len(built.builds) == 3 and sum(map(len, built.futures.values())) == 3


def test_tritons_hook_is_restored_and_other_threads_launch_as_usual(sm90, monkeypatch):
    """While a prebuild holds Triton's jit_cache_hook, a launch in another thread compiles (the
    hook answers only for the prebuild's own thread), and the hook found before is put back."""
    graph, args, sizes = first_call(MlpNorm().eval(), INPUTS["contiguous"]())
    call = graph.call_fn(interpret=False)
    names = [k.name for k in graph.kernels]
    kernels = {n: call.__globals__[n].fn for n in names}  # the JITFunctions behind the launchers
    launches, _ = prebuild.record_launches(call, names, [], [], args, sizes)
    elsewhere = []

    class FromAnotherThread:  # a "kernel" whose specialization runs a real launch in another thread
        def run(self, *args, **kwargs):
            first = launches[0]
            thread = threading.Thread(
                target=lambda: elsewhere.append(
                    kernels[first.name].run(*first.args, grid=first.grid, warmup=True, **first.kwargs)
                )
            )
            thread.start()
            thread.join()

    seen = []
    user_hook = lambda **kw: seen.append(kw["fn"].jit_function) and None  # noqa: E731
    monkeypatch.setattr(triton.knobs.runtime, "jit_cache_hook", user_hook)
    builds = prebuild.specializations(
        [*launches, dataclasses.replace(launches[0], name="x")], kernels | {"x": FromAnotherThread()}
    )
    assert len(builds) == 3 and triton.knobs.runtime.jit_cache_hook is user_hook
    assert elsewhere and elsewhere[0] is not None  # compiled there, not skipped by the prebuild's hook
    assert seen == [kernels[launches[0].name]]  # the user's hook still saw that launch
    # two prebuilds at once, the first ending while the second is in its window: the second must
    # not have saved the first's hook as the one to put back
    inside, go_first, go_second = threading.Event(), threading.Event(), threading.Event()

    class Paused:  # a kernel whose specialization holds a prebuild in its hook's window
        def __init__(self, go):
            self.go = go

        def run(self, *args, **kwargs):
            inside.set()
            self.go.wait(10)

    def prebuild_with(go):
        launch = dataclasses.replace(launches[0], name="p")
        return threading.Thread(target=prebuild.specializations, args=([launch], {"p": Paused(go)}))

    first, second = prebuild_with(go_first), prebuild_with(go_second)
    first.start()
    inside.wait(10)
    second.start()
    time.sleep(0.3)  # the second is at the lock (without it: in its window, the first's hook saved)
    go_first.set()
    first.join()
    go_second.set()
    second.join()
    assert triton.knobs.runtime.jit_cache_hook is user_hook


def test_a_triton_whose_serialization_names_no_target_still_prebuilds(sm90, monkeypatch):
    """Triton 3.4-3.6 leave the target out of the specialization data: the parent's is used."""
    serialize = triton.runtime.jit.serialize_specialization_data

    def without_target(*args, **kwargs):
        data = json.loads(serialize(*args, **kwargs))
        data.pop("target", None)
        return json.dumps(data)

    monkeypatch.setattr(triton.runtime.jit, "serialize_specialization_data", without_target)
    graph, args, sizes = first_call(MlpNorm().eval(), INPUTS["contiguous"]())
    call = graph.call_fn(interpret=False)
    built = graph.prebuild(call, args, sizes)
    built.wait()
    assert sum(map(len, built.futures.values())) == 3
    assert jit_first_launches(graph, args, sizes, call.__globals__) == [True] * 3


EXIT_SCRIPT = """
import time, types
from gjit.runtime import prebuild

def slow(*args):
    time.sleep(3)

prebuild.build_one = slow
kernel = types.SimpleNamespace(fn=types.SimpleNamespace(__name__="k"), src="")
todo = [prebuild.Build("k", kernel, "", ("cuda", 90, 32), None, False) for _ in range(6)]
futures = prebuild._submit(todo, {"k": "k.py"}, 1, None)
time.sleep(0.5)  # the first build runs; five wait in the queue
print(sum(map(len, futures.values())), time.time(), flush=True)
"""


@pytest.mark.slow  # CI's sweep step: 14 s of a child process
def test_exit_does_not_wait_for_queued_builds():
    """A process that ends (a crash, Ctrl-C) during a first call's builds ends after the builds
    running or handed to a worker then (here two: at most 6 s), not after the whole queue (18 s)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", EXIT_SCRIPT], capture_output=True, text=True, timeout=60)
    ended = time.time()
    assert out.returncode == 0, out.stderr
    submitted, at = out.stdout.split()
    assert submitted == "6"
    # the running build's rest and one more (at most 6 s, and the interpreter's teardown, seconds on
    # a loaded machine), not five more (18 s)
    assert ended - float(at) < 13


def test_a_build_that_hangs_is_given_up_and_prebuilds_stop(monkeypatch, caplog):
    monkeypatch.setattr(prebuild, "WAIT_SECONDS", 0.2)
    monkeypatch.setattr(prebuild, "_off", "")
    kernel, hung = Kernel(), concurrent.futures.Future()  # a worker that never answers
    namespace = {}
    namespace["k"] = prebuild.Awaiting(kernel, [hung], namespace, "k")
    with caplog.at_level(logging.INFO, logger="gjit.cache"):
        namespace["k"][(1,)]()
    assert kernel.grids == [(1,)] and "took over" in prebuild._off  # launched: Triton builds it
    assert prebuild.start(None, {}, {}, [], [], [], ()) is None  # no more prebuilds in this process


def built_value(graph, args, sizes):
    """A real value of one built kernel (its Triton cache entry packed), and that entry."""
    built = graph.prebuild(graph.call_fn(interpret=False), args, sizes)
    built.wait()
    entry = built.builds[0].entry
    return triton_binaries.pack(*entry), entry


def edited(text, edit):
    value = json.loads(text)
    meta = json.loads(base64.b64decode(value["files"][value["metadata"]]))
    edit(value, meta)
    if value["metadata"] in value["files"]:
        value["files"][value["metadata"]] = base64.b64encode(json.dumps(meta).encode()).decode()
    return json.dumps(value)


def rename_binary(value, meta):
    binary = next(f for f in value["files"] if f != value["metadata"])
    value["files"][binary.rsplit(".", 1)[0] + ".ptx"] = value["files"].pop(binary)


EDITS = {
    "its metadata of another entry": lambda value, meta: meta.update(hash="0" * 64),
    "no target in its metadata": lambda value, meta: meta.pop("target"),
    "a binary of another kind": rename_binary,
    "a second metadata file": lambda value, meta: value["files"].update(
        {"x.json": value["files"][value["metadata"]]}
    ),
    "a name ending in a newline": lambda value, meta: value.update(metadata=value["metadata"] + "\n"),
}


@pytest.mark.parametrize("edit", list(EDITS))
def test_a_binary_value_is_exactly_one_entrys_metadata_and_binary(sm90, edit):
    graph, args, sizes = first_call(MlpNorm().eval(), INPUTS["contiguous"]())
    text, (name, metadata) = built_value(graph, args, sizes)
    binary = triton_binaries.unpack(text, name)
    assert binary.metadata == metadata and binary.target == ("cuda", 90, 32) and len(binary.files) == 2
    with pytest.raises(ValueError):
        triton_binaries.unpack(edited(text, EDITS[edit]), name)


def test_a_package_for_another_gpu_or_an_unwritable_triton_cache_installs_nothing(
    sm90, tmp_path, monkeypatch
):
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    model, x = MlpNorm().eval(), INPUTS["contiguous"]()
    compiled, graph, args, sizes = first_graph_call(model, x)
    graph.prebuild(graph.call_fn(interpret=False), args, sizes)
    gjit.save(compiled, str(tmp_path / "m.gjit"), binaries=True)
    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path / "new"))
    before = gjit.stats().get("package_binaries_installed", 0)
    monkeypatch.setattr(driver, "_active", prebuild.TargetDriver(GPUTarget("cuda", 80, 32)))  # an A100
    loaded = gjit.load(str(tmp_path / "m.gjit"), model=model)
    (tmp_path / "file").write_text("")
    monkeypatch.setattr(driver, "_active", prebuild.TargetDriver(GPUTarget("cuda", 90, 32)))
    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path / "file" / "triton"))  # cannot be made
    gjit.load(str(tmp_path / "m.gjit"), model=model)
    assert gjit.stats().get("package_binaries_installed", 0) == before
    with gjit.config.scope(interpret=True), torch.no_grad():
        for a, b in zip(loaded(x), model(x)):
            torch.testing.assert_close(a, b)


def test_the_progress_line_counts_the_workers_builds(sm90, monkeypatch):
    import io
    import sys

    from gjit import progress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    screen = Terminal()
    monkeypatch.setattr(sys, "stderr", screen)
    graph, args, sizes = first_call(MlpNorm().eval(), INPUTS["contiguous"]())
    call = graph.call_fn(interpret=False)
    with gjit.config.scope(progress_after=0.0), progress.compiling("MlpNorm"):
        graph.prebuild(call, args, sizes).wait()  # the workers' futures complete in the pool's thread
        time.sleep(3 * progress.TICK_SECONDS)
    assert "kernels built 3/3" in screen.getvalue().split("\r")[-3], screen.getvalue()[-300:]
