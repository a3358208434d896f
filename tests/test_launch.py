"""Pre-bound kernel launches (gjit/runtime/launch.py), checked without a GPU on Triton's own CUDA
driver over a libcuda that launches nothing (tests/null_cuda.py): the device wrapper of a real
compiled graph runs on CPU tensors, every launch goes through Triton's C launcher to a counted
cuLaunchKernelEx. A variant's first launch takes Triton's path (JITFunction.run), the later ones
call the compiled kernel it bound, with the same arguments Triton's path passes."""

import threading

import pytest
import torch
import triton
from triton.backends.nvidia.driver import CudaLauncher

import gjit
from gjit.runtime.launch import Launcher
from helpers import first_graph_call, kernel_launches
from null_cuda import launches as null_launches

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


class Recording(CudaLauncher):
    """Triton's launcher, recording what each launch passes it (grid and arguments)."""

    calls: list = []
    streams: list = []  # (the launching thread, the stream it launched on)

    def __call__(self, gridX, gridY, gridZ, stream, function, *rest):
        args = rest[5:]  # after the packed metadata, launch metadata, hooks
        Recording.calls.append((function, (gridX, gridY, gridZ), [_value(a) for a in args]))
        Recording.streams.append((threading.get_ident(), stream))
        return super().__call__(gridX, gridY, gridZ, stream, function, *rest)


def _value(a):
    return ("tensor", a.data_ptr(), a.dtype) if isinstance(a, torch.Tensor) else a


@pytest.fixture
def recording(null_cuda, monkeypatch):
    monkeypatch.setattr(null_cuda, "launcher_cls", Recording)
    Recording.calls, Recording.streams = [], []
    return Recording.calls


def launchers(call):
    return {n: v for n, v in call.__globals__.items() if isinstance(v, Launcher)}


def test_later_launches_are_prebound_and_pass_what_tritons_path_passes(recording):
    graph, inputs, sizes = first_graph_call(MlpNorm().eval(), torch.randn(3, 40, 32))[1:]
    call = graph.call_fn(interpret=False)
    bound = launchers(call)
    assert set(bound) == {k.name for k in graph.kernels}
    before = null_launches()
    call(inputs, sizes)
    first = list(recording)
    assert null_launches() - before == 3 and len(first) == 3
    assert all(launcher.triton_launches == 1 for launcher in bound.values())
    recording.clear()
    call(inputs, sizes)
    call(inputs, sizes)
    assert null_launches() - before == 9
    assert all(launcher.triton_launches == 1 for launcher in bound.values())  # none took Triton's path
    # the pre-bound launches pass Triton's launcher what Triton's path passed (buffers are fresh
    # allocations each call: compare the inputs' addresses and everything else but addresses)
    ins = {t.data_ptr() for t in inputs if isinstance(t, torch.Tensor)}

    def same(a):
        return [x if not isinstance(x, tuple) or x[1] in ins else ("tensor", x[2]) for x in a]

    for (f1, g1, a1), (f2, g2, a2) in zip(first, recording[:3]):
        assert (f1, g1, same(a1)) == (f2, g2, same(a2))


def test_a_launch_of_another_specialization_takes_tritons_path(recording):
    """A dynamic size no longer divisible by 16, an input 4 bytes past an aligned address: new
    variants, compiled by Triton's path; a size of the first variant again is pre-bound."""
    fn = lambda x: (x * 2 + 1).relu()  # noqa: E731
    compiled, graph, inputs, sizes = first_graph_call(fn, torch.randn(16, 5))
    call = graph.call_fn(interpret=False)
    (launcher,) = launchers(call).values()
    entry = compiled.entries[0]

    def launch(x):
        recording.clear()
        sizes = entry.guards.check([x])
        assert sizes is not None  # the one dynamic entry serves every call
        call(entry.program.captured.graph_inputs([x]), sizes)
        (record,) = recording
        return record

    by_16 = launch(torch.randn(16, 5))  # 80 elements
    assert launcher.triton_launches == 1
    odd = launch(torch.randn(17, 5))  # 85
    assert launcher.triton_launches == 2 and odd[0] == by_16[0]  # one module, and
    variants = [v.kernel for v in launcher.variants.values()]
    assert len(variants) == 2 and variants[0] is not variants[1]  # two compiled kernels
    launch(torch.randn(32, 5))  # 160: the first variant, bound
    assert launcher.triton_launches == 2
    unaligned = torch.randn(16 * 5 + 1)[1:].view(16, 5)
    launch(unaligned)
    assert launcher.triton_launches == 3
    kernel = [v.kernel for v in launcher.variants.values()][-1]
    assert kernel.src.attrs[(0,)] == []  # compiled without the alignment of its first pointer
    assert variants[0].src.attrs[(0,)] == [["tt.divisibility", 16]]


def test_the_knob_turns_prebound_launches_off(null_cuda):
    graph, inputs, sizes = first_graph_call(MlpNorm().eval(), torch.randn(3, 40, 32))[1:]
    with gjit.config.scope(prebound_launches=False):
        call = graph.call_fn(interpret=False)
    assert not launchers(call)
    assert all(isinstance(call.__globals__[k.name], triton.runtime.JITFunction) for k in graph.kernels)
    before = null_launches()
    call(inputs, sizes)
    assert null_launches() - before == 3


def test_a_launch_of_another_signature_or_kind_takes_tritons_path(null_cuda):
    """The key function is made for the first launch's signature and kinds (tensors, ints,
    keyword names); another count, an int where a tensor was, a float where an int was or another
    keyword raises inside it or keys another variant: the launch goes through Triton's path."""
    graph, inputs, sizes = first_graph_call(MlpNorm().eval(), torch.randn(3, 40, 32))[1:]
    call = graph.call_fn(interpret=False)
    call(inputs, sizes)
    name, _, args, kwargs = kernel_launches(graph, inputs, sizes)[0]  # its launch's arguments
    launcher = launchers(call)[name]
    ((device, *_),) = launcher.variants  # one variant, keyed on the device first
    assert launcher.key(device, args, kwargs) in launcher.variants
    tensor = next(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
    number = next(i for i, a in enumerate(args) if type(a) is int)
    changed = [
        (args[:-1], kwargs),
        (args[:tensor] + (7,) + args[tensor + 1 :], kwargs),
        (args[:number] + (1.5,) + args[number + 1 :], kwargs),
        (args, {**kwargs, "num_stages": 2}),
        (args, {"OTHER": 1, **{k: v for k, v in list(kwargs.items())[1:]}}),
    ]
    for other_args, other_kwargs in changed:  # the key function raises, or keys another variant
        try:
            assert launcher.key(device, other_args, other_kwargs) not in launcher.variants
        except (KeyError, AttributeError, TypeError, ValueError):
            pass


def test_a_new_driver_drops_the_bound_variants(null_cuda, monkeypatch):
    from triton.runtime.driver import driver

    graph, inputs, sizes = first_graph_call(MlpNorm().eval(), torch.randn(3, 40, 32))[1:]
    call = graph.call_fn(interpret=False)
    call(inputs, sizes)
    bound = launchers(call)
    other = type(null_cuda)()  # another driver object (a process that switched drivers)
    monkeypatch.setattr(driver, "_active", other)
    call(inputs, sizes)
    assert all(launcher.triton_launches == 2 and launcher.driver is other for launcher in bound.values())


def test_each_thread_launches_on_its_own_current_stream(recording, null_cuda, monkeypatch):
    """A pre-bound launch reads the calling thread's current stream at each launch (as Triton's
    path does): threads with streams of their own launch on them, also through variants another
    thread bound."""
    graph, inputs, sizes = first_graph_call(MlpNorm().eval(), torch.randn(3, 40, 32))[1:]
    call = graph.call_fn(interpret=False)
    current = threading.local()  # each thread's current stream, as torch.cuda.current_stream keeps it
    monkeypatch.setattr(null_cuda, "get_current_stream", lambda device=None: getattr(current, "stream", 0))
    call(inputs, sizes)  # the variants, bound on the default stream
    Recording.streams.clear()
    start = threading.Barrier(3)

    def serve(stream: int) -> None:
        current.stream = stream
        start.wait()
        for _ in range(5):
            call(inputs, sizes)

    threads = {threading.Thread(target=serve, args=(s,)): s for s in (11, 22, 33)}
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    by_thread = {t.ident: s for t, s in threads.items()}
    assert len(Recording.streams) == 3 * 5 * 3  # 3 threads, 5 calls, 3 kernels
    assert all(stream == by_thread[thread] for thread, stream in Recording.streams)
    assert all(launcher.triton_launches == 1 for launcher in launchers(call).values())  # all pre-bound
