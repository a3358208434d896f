"""mode="reduce-overhead": CUDA graphs per set of sizes (gjit/runtime/cuda_graphs.py).

The bookkeeping (which inputs are copied into the recording's buffers, which are read where they
are, a graph per size up to the bound, outputs the caller holds, invalidation, threads, generate())
runs on CPU with tests/cuda_graph_fake.py standing in for torch's CUDA graph API, the kernels in
Triton's interpreter; every result is compared with eager. The `gpu` tests at the end record real
CUDA graphs.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

import gjit
from cuda_graph_fake import FakeGraphs
from gjit.runtime import cuda_graphs
from helpers import assert_same

transformers = pytest.importorskip("transformers")


class Scale(torch.nn.Module):
    """A parameter and a buffer (read where they are) and the call's tensor (copied)."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(width))
        self.register_buffer("shift", torch.randn(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.weight).sin() + self.shift


def write_step(cache: torch.Tensor, pos: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """A static cache's decode step: the new row written in place, then read."""
    cache.index_copy_(0, pos, value)
    return (cache * 2).sum(1)


def counter(name: str) -> int:
    return gjit.stats().get(name, 0)


def skipped() -> dict[str, int]:
    prefix = "cuda_graph_skipped:"
    return {k.removeprefix(prefix): v for k, v in gjit.stats().items() if k.startswith(prefix)}


@pytest.fixture
def fake():
    graphs = FakeGraphs()
    with cuda_graphs.graph_api(graphs), gjit.config.scope(interpret=True, debug=True), torch.no_grad():
        yield graphs


def graphs_of(cm: gjit.CompiledFunction, index: int = 0) -> cuda_graphs.CudaGraphs:
    return cm.entries[index].graphs


# ------------------------------------------------------------------------------------------------
# recording, replay, buffers


@pytest.mark.cpu
def test_second_call_records_later_calls_replay(fake):
    model = Scale()
    cm = gjit.compile(model, mode="reduce-overhead")
    for _ in range(5):
        x = torch.randn(4, 8)
        assert_same(cm(x), model(x))  # the output is dropped before the next call
    assert counter("cuda_graphs_recorded") == 1 and fake.captures == 1
    assert counter("cuda_graph_replays") == 3 == fake.replays
    assert skipped() == {cuda_graphs.FIRST_CALL: 1}
    # the call's tensor moved every time (copied into the recording's buffer); the parameter and
    # the buffer are where they were recorded (no copy)
    assert counter("cuda_graph_input_copies") == 3
    report = str(gjit.explain(cm, torch.randn(4, 8)))
    assert "CUDA graphs: 1 graph(s) held (sizes (4,); at most 8), 3 replay(s)" in report


@pytest.mark.cpu
def test_an_input_at_its_recorded_address_is_not_copied(fake):
    cache, pos = torch.zeros(6, 4), torch.tensor([0])
    want_cache = torch.zeros(6, 4)
    cm = gjit.compile(write_step, mode="reduce-overhead")
    for i in range(5):
        pos.fill_(i)  # the same tensor every call: copied into the buffer anyway, being owned
        value = torch.randn(1, 4)
        out = cm(cache, pos, value)
        assert_same(out, write_step(want_cache, pos, value))
        assert torch.equal(cache, want_cache), "the write landed in the caller's cache"
        del out
    assert counter("cuda_graph_replays") == 3
    # per replay pos and value are copied, the cache (written in place) never
    assert counter("cuda_graph_input_copies") == 2 * 3
    assert graphs_of(cm).in_place == {0}


@pytest.mark.cpu
def test_an_input_written_in_place_at_a_new_address_records_anew(fake):
    cm = gjit.compile(write_step, mode="reduce-overhead")
    cm(torch.zeros(6, 4), torch.tensor([0]), torch.randn(1, 4))  # compiled (export keeps its inputs)
    first, want_first = torch.zeros(6, 4), torch.zeros(6, 4)
    for i in range(3):
        value = torch.randn(1, 4)
        assert_same(cm(first, torch.tensor([i]), value), write_step(want_first, torch.tensor([i]), value))
    assert counter("cuda_graph_replays") == 2
    # a new cache: replaying the recording would write into the first one
    second, want_second = torch.ones(6, 4), torch.ones(6, 4)
    for i in range(3):
        value = torch.randn(1, 4)
        out = cm(second, torch.tensor([i]), value)
        assert_same(out, write_step(want_second, torch.tensor([i]), value))
        del out
    assert torch.equal(first, want_first), "the first cache changed"
    assert torch.equal(second, want_second)
    assert counter("cuda_graphs_recorded") == 2 and counter("cuda_graph_replays") == 4
    # the first cache gone, its recording is stale: dropped when the next one is recorded
    third, want_third = torch.zeros(6, 4), torch.zeros(6, 4)  # (not in the first one's memory)
    del first
    with gjit.config.scope(cuda_graph_limit=2):
        value = torch.randn(1, 4)
        assert_same(cm(third, torch.tensor([1]), value), write_step(want_third, torch.tensor([1]), value))
    assert counter("cuda_graphs_recorded") == 3 and len(graphs_of(cm).recordings) == 2
    assert torch.equal(third, want_third)


@pytest.mark.cpu
def test_a_graph_per_size_up_to_the_limit(fake):
    model = Scale()
    cm = gjit.compile(model, mode="reduce-overhead")
    with gjit.config.scope(cuda_graph_limit=2):
        for rows in (3, 4, 5, 3, 4, 5, 3, 4, 5):
            x = torch.randn(rows, 8)
            assert_same(cm(x), model(x))
    assert len(cm.entries) == 1, "one entry with a dynamic dim"
    assert sorted(r.key[0] for r in graphs_of(cm).recordings) == [(3,), (4,)]
    assert counter("cuda_graph_replays") == 2
    assert skipped() == {cuda_graphs.FIRST_CALL: 3, cuda_graphs.AT_LIMIT: 2}


@pytest.mark.cpu
def test_an_output_the_caller_holds_is_not_overwritten(fake):
    model = Scale()
    cm = gjit.compile(model, mode="reduce-overhead")
    for _ in range(2):
        cm(torch.randn(4, 8))  # warm-up, then the recording
    x1, x2, x3, x4 = (torch.randn(4, 8) for _ in range(4))
    held = cm(x1)
    assert counter("cuda_graph_replays") == 1
    cm(torch.randn(4, 8))  # the recording's outputs are held: another recording
    assert_same(held, model(x1))
    assert counter("cuda_graphs_recorded") == 2
    row = cm(x2)[1]  # the second recording's replay; a view of its output holds its memory too
    assert counter("cuda_graph_replays") == 2
    held_both = f"the caller still holds the outputs of its last replay, and {cuda_graphs.AT_LIMIT}"
    with gjit.config.scope(cuda_graph_limit=2):
        third = cm(x3)  # both recordings' outputs held, no room for a third: no graph
        assert skipped().get(held_both) == 1
        del held
        fourth = cm(x4)  # the first recording's outputs are free again
    assert counter("cuda_graph_replays") == 3
    assert_same(row, model(x2)[1])
    assert_same(third, model(x3))
    assert_same(fourth, model(x4))


@pytest.mark.cpu
def test_an_output_viewing_an_input(fake):
    def flat_and_sum(x):
        return x.view(-1), x.sum()

    cm = gjit.compile(flat_and_sum, mode="reduce-overhead")
    kept = []
    for _ in range(5):
        x = torch.randn(3, 4)
        kept.append((cm(x), x.clone()))
    for (flat, total), x in kept:  # a view of the recording's buffer held: no new input copied in
        assert_same(flat, x.view(-1))
        assert_same(total, x.sum())
    assert counter("cuda_graph_replays") >= 1

    # the cache the step writes into comes back as the caller's own tensor
    def write_and_return(cache, pos, value):
        cache.index_copy_(0, pos, value)
        return cache

    cm = gjit.compile(write_and_return, mode="reduce-overhead")
    cache = torch.zeros(5, 2)
    for i in range(4):
        assert cm(cache, torch.tensor([i]), torch.randn(1, 2)) is cache
    assert counter("cuda_graph_replays") >= 2


# ------------------------------------------------------------------------------------------------
# what is not recorded


@pytest.mark.cpu
@pytest.mark.parametrize(
    "fn, why",
    [
        (lambda x: (x * 2)[x > 0], "a host sync"),
        (lambda x: x + torch.rand_like(x), "draws random numbers"),
        (
            lambda x: torch.cond(x.sum() > 0, lambda y: y + 1, lambda y: y - 1, (x,)),
            "picks its branch on a tensor's value",
        ),
    ],
    ids=["data-dependent", "random", "cond-on-data"],
)
def test_what_cannot_be_recorded_runs_without_a_graph(fake, fn, why, caplog):
    cm = gjit.compile(fn, mode="reduce-overhead")
    with caplog.at_level(logging.INFO, logger="gjit.cudagraphs"):
        for _ in range(3):
            x = torch.randn(6)
            torch.manual_seed(1)
            want = fn(x)
            torch.manual_seed(1)
            assert_same(cm(x), want)
    assert gjit.stats()["eager_runs"] == 0
    assert fake.captures == 0 and counter("cuda_graph_replays") == 0
    (reason,) = skipped()
    assert why in reason and skipped()[reason] == 3
    assert sum(why in r.message for r in caplog.records) == 1, "logged once"
    assert why in str(gjit.explain(cm, torch.randn(6)))


@pytest.mark.cpu
@pytest.mark.parametrize(
    "options, why",
    [(dict(backend="cupy"), "the cupy backend"), (dict(check=True), "GJIT_CHECK")],
    ids=["cupy", "check"],
)
def test_what_the_options_keep_from_recording(fake, options, why):
    model = Scale()
    cm = gjit.compile(model, mode="reduce-overhead", **options)
    for _ in range(3):
        x = torch.randn(4, 8)
        assert_same(cm(x), model(x))
    (reason,) = skipped()
    assert why in reason and fake.captures == 0


@pytest.mark.cpu
def test_integer_indexing_is_recorded(fake):
    def gather(table, index):
        return table[index] * 2

    cm = gjit.compile(gather, mode="reduce-overhead")
    table = torch.randn(10, 4)
    for _ in range(4):
        index = torch.randint(0, 10, (3,))
        assert_same(cm(table, index), gather(table, index))
    assert counter("cuda_graph_replays") == 2


@pytest.mark.cpu
def test_cpu_tensors_with_torchs_graphs_run_without_a_graph():
    model = Scale().cpu()
    cm = gjit.compile(model, mode="reduce-overhead")
    with gjit.config.scope(interpret=True), torch.no_grad():
        for _ in range(3):
            x = torch.randn(4, 8, device="cpu")
            assert_same(cm(x), model(x))
    assert skipped() == {"the program runs on CPU tensors": 3}


@pytest.mark.cpu
def test_a_failed_capture_falls_back_once(caplog):
    model = Scale()
    failing = FakeGraphs(fail=RuntimeError("operation not permitted when stream is capturing"))
    with cuda_graphs.graph_api(failing), gjit.config.scope(interpret=True), torch.no_grad():
        cm = gjit.compile(model, mode="reduce-overhead")
        with caplog.at_level(logging.WARNING, logger="gjit.cudagraphs"):
            for _ in range(4):
                x = torch.randn(4, 8)
                assert_same(cm(x), model(x))
    warnings = [r for r in caplog.records if "could not be recorded" in r.message]
    assert len(warnings) == 1 and "operation not permitted" in warnings[0].message
    assert counter("cuda_graphs_recorded") == 0
    assert sum(skipped().values()) == 3  # the recording call returned its warm-up's outputs


# ------------------------------------------------------------------------------------------------
# invalidation, threads


@pytest.mark.cpu
def test_reset_and_a_new_entry_drop_the_graphs(fake):
    model = Scale()
    cm = gjit.compile(model, mode="reduce-overhead", dynamic=False)
    for _ in range(3):
        cm(torch.randn(4, 8))
    graphs = graphs_of(cm)
    assert len(graphs.recordings) == 1
    x = torch.randn(5, 8)
    assert_same(cm(x), model(x))  # another shape: a new entry
    assert len(cm.entries) == 2 and graphs.recordings == [] and not graphs.seen
    for _ in range(2):
        cm(torch.randn(5, 8))
    assert len(graphs_of(cm, 1).recordings) == 1
    newest = graphs_of(cm, 1)
    gjit.reset()
    assert newest.recordings == [] and cm.entries == []
    x = torch.randn(4, 8)
    assert_same(cm(x), model(x))
    assert skipped() == {cuda_graphs.FIRST_CALL: 1}, "after reset, sizes are new again"


class SlowReplay(FakeGraphs):
    """Replays that take a while: another thread's call lands in the middle of one."""

    def replay(self, handle, inputs):
        time.sleep(0.002)
        super().replay(handle, inputs)


@pytest.mark.cpu
def test_threads_replaying_one_entry():
    model = Scale(64)
    # the eager fallback runs the graph: Triton's interpreter swaps module globals per call
    with cuda_graphs.graph_api(SlowReplay()), torch.no_grad():
        cm = gjit.compile(model, mode="reduce-overhead")
        cm(torch.randn(16, 64))  # compiled here, not in the threads
    errors = []

    def calls(seed: int):
        gen = torch.Generator().manual_seed(seed)
        try:
            with torch.no_grad():  # grad mode is per thread
                for _ in range(12):
                    x = torch.randn(16, 64, generator=gen)
                    out = cm(x)
                    time.sleep(0.001)  # the output held while the other threads call
                    torch.testing.assert_close(out, model(x))
        except Exception as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=calls, args=(seed,)) for seed in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert counter("cuda_graph_replays") >= 12


# ------------------------------------------------------------------------------------------------
# modes


@pytest.mark.cpu
def test_modes():
    with pytest.raises(ValueError, match="'reduce-overhead', 'max-autotune'"):
        gjit.compile(Scale(), mode="fast")
    fn = lambda x: x + 1  # noqa: E731
    x = torch.randn(3)
    for mode, records in [
        ("default", False),
        ("reduce-overhead", True),
        ("max-autotune", True),
        ("max-autotune-no-cudagraphs", False),
    ]:
        cm = gjit.compile(fn, mode=mode)
        cm(x)
        assert (cm.entries[0].graphs is not None) == records, mode
    with gjit.config.scope(mode="reduce-overhead"):
        cm = gjit.compile(fn)
    cm(x)
    assert cm.entries[0].graphs is not None, "GJIT_MODE"


@pytest.mark.cpu
def test_torch_compile_passes_the_mode(fake):
    model = Scale()
    compiled = torch.compile(model, backend="gjit", mode="reduce-overhead")
    for _ in range(3):
        x = torch.randn(4, 8)
        assert_same(compiled(x), model(x))
    assert counter("cuda_graph_replays") == 1
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="gjit", options={"mode": "reduce-overhead"})
    for _ in range(3):
        x = torch.randn(4, 8)
        assert_same(compiled(x), model(x))
    assert counter("cuda_graph_replays") == 2
    torch._dynamo.reset()
    with pytest.raises(Exception, match="unknown options"):
        torch.compile(model, backend="gjit", options={"cudagraphs": True})(torch.randn(4, 8))
    torch._dynamo.reset()


# ------------------------------------------------------------------------------------------------
# generate()


def tiny(name: str) -> torch.nn.Module:
    from test_llm import build

    return build(name)


def generate(model, ids, tokens, **kwargs):
    from test_llm import generate as run

    return run(model, ids, tokens, **kwargs)


@pytest.mark.cpu
@pytest.mark.slow  # CI's sweep step: 54 s of the default run, which stays in its 15 minutes
def test_generate_with_a_static_cache_replays_one_graph_per_decode_step():
    from test_llm import prompt

    model = tiny("llama")
    ids = prompt(2, 5, seed=4)
    want = generate(model, ids, 6, cache_implementation="static")
    model.forward = gjit.compile(model.forward, mode="reduce-overhead")
    with cuda_graphs.graph_api(FakeGraphs()), gjit.config.scope(interpret=True):
        got = generate(model, ids, 6, cache_implementation="static")
        assert torch.equal(got, want)
        decode = graphs_of(model.forward, 1)
        # 5 decode steps: the warm-up, the recording, then 3 replays of the one graph
        assert len(decode.recordings) == 1 and decode.replays == 3
        skipped_before = dict(decode.skipped)
        # a new cache: at the first step the graph replays (the cache is where the last one was)
        # or another is recorded; every later step replays
        again = generate(model, ids, 6, cache_implementation="static")
    assert torch.equal(again, want)
    assert decode.skipped == skipped_before and decode.replays >= 3 + 4
    assert len(decode.recordings) <= 2
    assert gjit.stats()["compiles"] == 2 and gjit.stats()["eager_runs"] == 0


@pytest.mark.cpu
@pytest.mark.slow  # CI's sweep step: half a minute
def test_generate_with_the_dynamic_cache_records_a_bounded_set():
    from test_llm import prompt

    model = tiny("gpt2")
    ids = prompt(1, 4, seed=2)
    want = generate(model, ids, 5)
    model.forward = gjit.compile(model.forward, mode="reduce-overhead")
    with cuda_graphs.graph_api(FakeGraphs()), gjit.config.scope(interpret=True, cuda_graph_limit=2):
        runs = [generate(model, ids, 5) for _ in range(3)]
    assert all(torch.equal(got, want) for got in runs)
    decode = graphs_of(model.forward, 1)
    # 4 decode steps of growing cache length per generate(): the first generate() warms each
    # length up, the second records the first 2 lengths (the limit), the third replays them; the
    # cache's tensors are outputs the caller holds, of the step before's graph
    assert [r.key[0][0] for r in decode.recordings] == [4, 5]
    assert decode.replays == 2
    assert decode.skipped == {cuda_graphs.FIRST_CALL: 4, cuda_graphs.AT_LIMIT: 4}
    assert gjit.stats()["compiles"] == 2 and gjit.stats()["eager_runs"] == 0


# ------------------------------------------------------------------------------------------------
# on a GPU: torch's CUDA graphs


def _median_ms(fn, repeat: int = 50) -> float:
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1000)
    return sorted(times)[len(times) // 2]


@pytest.mark.gpu
def test_cuda_graphs_on_a_gpu():
    torch.manual_seed(0)
    layers = [m for _ in range(12) for m in (torch.nn.Linear(256, 256), torch.nn.GELU())]
    model = torch.nn.Sequential(*layers).cuda().eval()
    plain = gjit.compile(model)
    graphed = gjit.compile(model, mode="reduce-overhead")

    def same(x: torch.Tensor, out: torch.Tensor) -> None:
        # a replay runs the plain call's kernels on the same values: the same bits; both close to
        # eager (twelve float32 products, cuBLAS's against the template's sums)
        want = plain(x)
        assert torch.equal(out, want)
        torch.testing.assert_close(want, model(x), rtol=1e-4, atol=1e-4)

    with torch.no_grad():
        xs = [torch.randn(8, 256, device="cuda") for _ in range(4)]
        for x in xs:
            same(x, graphed(x))
        assert counter("cuda_graph_replays") == 2
        held = graphed(xs[0])
        other = graphed(xs[1])  # the first replay's outputs are held: another recording
        same(xs[0], held)
        same(xs[1], other)
        assert counter("cuda_graphs_recorded") == 2
        del held, other
        x = xs[2]
        ms_eager = _median_ms(lambda: model(x))
        ms_plain = _median_ms(lambda: plain(x))
        ms_graph = _median_ms(lambda: graphed(x))
    kernels = len(gjit.explain(plain, x).kernels)
    times = f"eager {ms_eager:.3f} ms, gjit {ms_plain:.3f} ms, gjit's CUDA graph replayed {ms_graph:.3f} ms"
    print(f"\n{kernels} kernels a call: {times}")
    assert not [k for k in skipped() if k != cuda_graphs.FIRST_CALL], skipped()


@pytest.mark.gpu
def test_cuda_graphs_on_a_gpu_static_cache_generate():
    from test_llm import prompt

    model = tiny("llama").cuda()
    ids = prompt(1, 5, seed=4).cuda()
    static = dict(cache_implementation="static", disable_compile=True)  # no torch.compile around it
    want = generate(model, ids, 12, **static)
    model.forward = gjit.compile(model.forward, mode="reduce-overhead")
    got = generate(model, ids, 12, **static)
    assert torch.equal(got, want)
    decode = graphs_of(model.forward, 1)
    assert decode.replays == 9 and len(decode.recordings) == 1, decode.describe()
    start = time.perf_counter()
    again = generate(model, ids, 12, **static)
    seconds = time.perf_counter() - start
    assert torch.equal(again, want)
    print(f"\ngenerate(), static cache, CUDA graphs: {seconds * 1000 / 12:.2f} ms a token")
