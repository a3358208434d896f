"""What node-by-node decomposition costs (gjit/capture/decompose.py, gjit/capture/traces.py), counted as work.

A program that writes in place into a value only it sees (T5's relative position buckets) is
decomposed node by node, not through run_decompositions() over the whole program (about 20 ms a
node: T5-small's 20 s). Traces are shared by nodes equal but for size symbols the shape
environment cannot tell apart (an encoder-decoder's two sequence lengths), so a model's traces
do not grow with its depth or with how many such symbols it has. Results are checked against
eager; the work is counted in traces, not timed.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import gjit
import model_zoo
from gjit.capture import decompose
from helpers import check

pytestmark = pytest.mark.cpu

AUTO = torch.export.Dim.AUTO


def export(fn, args, dynamic_shapes=None) -> torch.export.ExportedProgram:
    class Wrap(torch.nn.Module):
        def forward(self, *a):
            return fn(*a)

    with torch.no_grad():
        return torch.export.export(
            Wrap(), args, dynamic_shapes=dynamic_shapes and (dynamic_shapes,), strict=False
        )


def traces() -> tuple[int, int]:
    stats = gjit.stats()
    return stats.get("decomposition_traces", 0), stats.get("decomposition_traces_renamed", 0)


def in_place_ops(program: torch.export.ExportedProgram) -> list[str]:
    return [
        str(n.target)
        for n in program.graph.nodes
        if isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable
    ]


def private_writes(x, m):
    buckets = (x > 0).long() * 4  # T5's `relative_buckets += ...`, then more writes on the result
    buckets += torch.where(x.abs() < 1, 1, 2)
    buckets.mul_(3)
    half = x.half() * 2  # a write of a float32 value into a float16 tensor stays float16
    half.add_(x)
    filled = x * 1
    filled.masked_fill_(m, -1.0)
    return buckets, half, filled


def test_a_write_into_a_value_only_it_sees_is_decomposed_node_by_node():
    x, m = torch.randn(6, 5), torch.rand(6, 5) > 0.5
    program = export(private_writes, (x, m))
    assert len(in_place_ops(program)) == 4
    assert decompose.whole_program_reason(program) is None
    decomposed, how = decompose.decompose_program(program)
    assert how == "nodes" and not in_place_ops(decomposed)
    for got, want in zip(decomposed.module()(x, m), private_writes(x, m), strict=True):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want)
    check(private_writes, x, m)
    assert gjit.stats()["decompositions_by_node"] == 1


def seen_through_a_view(x):
    y = x * 2
    row = y[0]  # a view of y: it sees the write below
    y.add_(1)
    return row * 3, y


def test_a_write_a_view_may_see_is_decomposed_whole():
    x = torch.randn(6, 5)
    reason = decompose.whole_program_reason(export(seen_through_a_view, (x,)))
    assert "writes an argument in place" in reason and "may alias" in reason, reason
    check(seen_through_a_view, x)
    assert gjit.stats()["decompositions_whole"] == 1


def test_a_write_into_a_value_read_after_it_is_not_private():
    # export reads a written value through the write's own result; a graph that reads the value
    # itself after the write (built here by hand) would see the write there too
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    y = graph.call_function(torch.ops.aten.mul.Tensor, (x, 2))
    write = graph.call_function(torch.ops.aten.add_.Tensor, (y, 1))
    after = graph.call_function(torch.ops.aten.add.Tensor, (y, x))
    graph.output((write, after))
    position = {n: i for i, n in enumerate(graph.nodes)}
    assert f"which {after.name} reads after" in decompose.private_write_reason(write, position)
    graph.erase_node(graph.output_node())
    graph.erase_node(after)
    graph.output((write,))
    position = {n: i for i, n in enumerate(graph.nodes)}
    assert decompose.private_write_reason(write, position) is None


def test_a_write_into_an_input_is_decomposed_whole():
    def fn(x):
        x.add_(1)
        return x * 2

    reason = decompose.whole_program_reason(export(fn, (torch.randn(3),)))
    assert reason is not None and "writes" in reason


def two_sequences(a, b, w):
    # the same ops over two independent dynamic lengths, as an encoder's and a decoder's
    return F.linear(a, w).softmax(-1).reshape(-1), F.linear(b, w).softmax(-1).reshape(-1)


def test_a_trace_is_renamed_for_a_node_equal_but_for_its_size_symbols():
    w = torch.randn(16, 8)
    args = (torch.randn(2, 5, 8), torch.randn(2, 3, 8), w)
    program = export(two_sequences, args, ({0: AUTO, 1: AUTO}, {0: AUTO, 1: AUTO}, None))
    decomposed, how = decompose.decompose_program(program)
    made, renamed = traces()  # linear, softmax and reshape traced once, renamed once
    assert how == "nodes" and made == renamed == 3
    # each renamed node's value has the second sequence's symbols
    mms = [n for n in decomposed.graph.nodes if n.target is torch.ops.aten.mm.default]
    a_len, b_len = (args[i].shape[1] for i in range(2))
    hints = [n.meta["val"].shape[0].node.hint for n in mms]
    assert len(mms) == 2 and sorted(hints) == sorted([2 * a_len, 2 * b_len]), hints
    symbols = [n.meta["val"].shape[0].node.expr.free_symbols for n in mms]
    assert symbols[0] != symbols[1]
    for size in ((2, 5, 3), (3, 7, 2)):  # other lengths than the traced ones
        a, b = torch.randn(size[0], size[1], 8), torch.randn(size[0], size[2], 8)
        for got, want in zip(decomposed.module()(a, b, w), two_sequences(a, b, w), strict=True):
            torch.testing.assert_close(got, want)
    gjit.reset()
    check(gjit.compile(two_sequences, dynamic=True), *args)
    assert traces()[1] >= 1


def test_a_trace_is_not_renamed_between_symbols_the_shape_environment_tells_apart():
    w = torch.randn(16, 8)
    args = (torch.randn(2, 5, 8), torch.randn(2, 3, 8), w)
    short = torch.export.Dim("short", min=2, max=64)  # the second length's range is not the first's
    program = export(two_sequences, args, ({0: AUTO, 1: AUTO}, {0: AUTO, 1: short}, None))
    decomposed, _ = decompose.decompose_program(program)
    assert traces() == (6, 0)
    for got, want in zip(decomposed.module()(*args), two_sequences(*args), strict=True):
        torch.testing.assert_close(got, want)


def t5(layers: int):
    import transformers

    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=model_zoo.VOCAB,
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=layers,
        num_heads=4,
        use_cache=False,
    )
    ids = torch.randint(0, model_zoo.VOCAB, (2, 8))
    decoder_ids = torch.randint(0, model_zoo.VOCAB, (2, 5))
    return transformers.T5ForConditionalGeneration(config).eval(), (ids, None, decoder_ids)


@pytest.mark.slow  # CI's sweep step: two T5 compiles, 20 s
def test_t5_is_decomposed_node_by_node_in_traces_its_depth_does_not_change():
    made = {}
    for layers in (2, 4):
        gjit.reset()
        model, args = t5(layers)
        with torch.no_grad():
            check(model, *args)
        stats = gjit.stats()
        assert stats["decompositions_by_node"] == 1 and stats.get("decompositions_whole", 0) == 0
        made[layers] = traces()
    # the decoder's self-attention, norms and feed-forward take the encoder's traces renamed
    assert made[2] == made[4] and made[2][1] >= 8, made


WRITES = {  # a write in place into a fresh value: -> decomposed node by node
    "fill_": (lambda x: (x * 2).fill_(3.0) + x, True),
    "clamp_": (lambda x: (x * 2).clamp_(-0.5, 0.5) + x, True),
    "copy_ broadcast": (lambda x: torch.empty(4, 5).copy_(x[0]) + 1, True),
    "index_put_": (lambda x: (x * 1).index_put_((torch.tensor([0, 2]),), torch.tensor(9.0)) - x, True),
    "masked_scatter_": (lambda x: (x * 1).masked_scatter_(x > 0, x * 10) + 1, True),
    "floor div_ of int64": (lambda x: (x.long() * 3).div_(2, rounding_mode="floor") + 1, True),
    "a view after": (lambda x: (lambda y: (y.add_(1), y.view(-1))[1] * 2)(x * 2), True),
    # writes of a value's sizes or strides: functionalized alone they leave a write, so whole
    "unsqueeze_": (lambda x: (x * 2).unsqueeze_(0) + 1, False),
    "t_": (lambda x: (x * 2).t_() + 1, False),
    "resize_": (lambda x: (x * 2).resize_(20) + 1, False),
}


@pytest.mark.parametrize("name", list(WRITES))
def test_a_write_into_a_fresh_value_computes_what_eager_does(name):
    fn, by_node = WRITES[name]
    x = torch.randn(4, 5)
    decomposed, how = decompose.decompose_program(export(fn, (x,)))
    assert (how == "nodes") == by_node, how
    assert not in_place_ops(decomposed)
    got, want = decomposed.module()(x), fn(x)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want)
