"""How the wrapper calls externs: the heavy ATen ops through torch's bindings of them
(`wrapper.BINDINGS`), and two GPU-only calls (gjit/runtime/padded_mm.py, attention_masks.py): a
16-bit product whose output rows would be misaligned for the tensor cores gets padded operands, and
an attention extern's boolean mask is handed over as an additive one. For those two the tests add
the CPU to their devices and run the calls through the interpreter against eager."""

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.utils._python_dispatch import TorchDispatchMode

import gjit
from gjit import tuning, wrapper
from gjit.runtime import attention_masks, padded_mm
from gjit.runtime.graph import LIBRARY_KERNELS, load_kernel
from helpers import assert_same, check, run_compiled

pytestmark = pytest.mark.cpu


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(wrapper, "PAD_DEVICES", {"cuda", "cpu"})
    monkeypatch.setattr(wrapper, "MASK_DEVICES", {"cuda", "cpu"})


def copy_kernel():
    """kernels/column_copy.py's kernel as a CPU graph loads it: interpreted."""
    return load_kernel(LIBRARY_KERNELS[wrapper.COLUMN_COPY], wrapper.COLUMN_COPY, interpret=True)


def wrapper_source(cm: gjit.CompiledFunction) -> str:
    return cm.entries[0].program.graph.wrapper_source


@pytest.mark.parametrize("rows", [padded_mm.LEAST_ROWS + 5, 3])
@pytest.mark.parametrize("bias", [True, False])
def test_misaligned_products_are_padded_and_match_eager(on_cpu, rows, bias):
    lin = torch.nn.Linear(48, 300, bias=bias).requires_grad_(False)  # 600-byte rows; weights static
    x = torch.randn(rows, 48)
    with gjit.config.scope(matmul="aten"):
        out, cm = run_compiled(lin.to(torch.bfloat16), x.bfloat16())
    assert_same(out, lin(x.bfloat16()), copy.deepcopy(lin).double()(x.double()))
    assert ("gjit_padded_addmm(" if bias else "gjit_padded_mm(") in wrapper_source(cm)


def test_a_row_major_right_operand_is_padded_along_its_columns():
    a = torch.randn(padded_mm.LEAST_ROWS, 24, dtype=torch.float16)
    b = torch.randn(24, 257, dtype=torch.float16)  # [K, N] as it is in memory
    bias = torch.randn(257, dtype=torch.float16)
    out = padded_mm.addmm(bias, a, b, beta=0.5, alpha=2.0, copy=copy_kernel())
    assert out.is_contiguous() and out.shape == (padded_mm.LEAST_ROWS, 257)
    torch.testing.assert_close(out, torch.addmm(bias, a, b, beta=0.5, alpha=2.0), rtol=2e-3, atol=2e-2)
    torch.testing.assert_close(padded_mm.mm(a, b, copy=copy_kernel()), a @ b, rtol=2e-3, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows, n, pitch", [(5, 257, 264), (1, 300, 304), (0, 257, 264), (3, 1030, 1040)])
def test_the_copy_out_takes_each_rows_first_columns_bit_for_bit(dtype, rows, n, pitch):
    """kernels/column_copy.py (interpreted here): NaN, infinities and signed zeros copied as they
    are; rows past a block boundary and a row shorter than a block; no rows at all."""
    padded = torch.randn(rows, pitch).to(dtype)
    if rows:
        padded[0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0])
    out = padded_mm.first_columns(padded, n, copy_kernel())
    assert out.is_contiguous() and out.shape == (rows, n)
    assert torch.equal(out.view(torch.int16), padded[:, :n].contiguous().view(torch.int16))


def test_a_copy_kernel_that_does_not_build_leaves_the_copy_to_aten(monkeypatch, caplog):
    """Never a failed call for an optimization: the first failure is logged once, and that call and
    every later one copy with ATen, the same values."""
    monkeypatch.setattr(padded_mm, "_FAILED", [])
    launches = []

    class Broken:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append(grid)
                raise RuntimeError("PassManager::run failed\n(details)")

            return launch

    padded = torch.randn(6, 264).to(torch.float16)
    with caplog.at_level(logging.WARNING, logger="gjit.output_code"):
        for _ in range(2):
            out = padded_mm.first_columns(padded, 257, Broken())
            assert torch.equal(out, padded[:, :257])
    assert len(launches) == 1 and padded_mm._FAILED == ["RuntimeError: PassManager::run failed"]
    assert sum("copy kernel failed" in r.getMessage() for r in caplog.records) == 1


def test_the_copy_out_with_int64_offsets_computes_the_same():
    """The branch for padded products of 2**31 elements or more, run on a small one."""
    padded = torch.randn(7, 72, dtype=torch.float16)
    out = torch.empty(7, 65, dtype=torch.float16)
    copy_kernel()[(1,)](padded, out, out.numel(), N=65, PITCH=72, BLOCK=padded_mm.COPY_BLOCK, WIDE=True)
    assert torch.equal(out, padded[:, :65])


def test_the_copy_out_takes_int64_offsets_where_the_padded_product_passes_2_31_elements():
    """The loads reach row * pitch, past the output's numel: GPT-2's 50257 columns on 42725 rows
    are under 2**31 elements, their padded product over it (int32 offsets would wrap)."""
    launches = []

    class Recorder:  # stands in for the kernel: a meta tensor has no memory to copy
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append(kwargs)

    rows, n = 42725, 50257
    pitch = wrapper.padded_columns(n, torch.float16)
    assert rows * n < 2**31 <= rows * pitch
    padded_mm.first_columns(torch.empty(rows, pitch, dtype=torch.float16, device="meta"), n, Recorder())
    assert launches[0]["WIDE"]
    padded_mm.first_columns(torch.empty(1000, pitch, dtype=torch.float16, device="meta"), n, Recorder())
    assert not launches[1]["WIDE"]


def test_what_is_padded():
    cuda = torch.device("cuda")
    dynamic = ShapeEnv().create_unbacked_symint()
    assert wrapper.pads_product(50257, torch.float16, cuda)
    assert not wrapper.pads_product(50264, torch.float16, cuda)  # aligned
    assert not wrapper.pads_product(50257, torch.float32, cuda)  # IEEE SGEMM: no tensor cores
    assert not wrapper.pads_product(100, torch.bfloat16, cuda)  # narrow: the copies cost more
    assert not wrapper.pads_product(dynamic, torch.bfloat16, cuda)  # a dynamic N
    assert not wrapper.pads_product(50257, torch.float16, torch.device("cpu"))
    assert wrapper.padded_columns(50257, torch.bfloat16) == 50264


def test_the_tuning_recorder_sees_padded_and_plain_products_in_order(on_cpu):
    """Tuning's library side pairs each product extern with its call by the order of the calls of
    its op: a padded call (another function name in the wrapper) must still be seen, in place."""
    sizes = ((48, 300), (300, 264), (264, 264))
    first, second, third = (torch.nn.Linear(i, o, bias=False).requires_grad_(False) for i, o in sizes)
    model = torch.nn.Sequential(first, torch.nn.ReLU(), second, torch.nn.ReLU(), third).to(torch.bfloat16)
    x = torch.randn(padded_mm.LEAST_ROWS, 48, dtype=torch.bfloat16)
    with gjit.config.scope(matmul="aten"):
        out, cm = run_compiled(model, x)
    graph = cm.entries[0].program.graph
    assert graph.wrapper_source.count("gjit_padded_mm(") == 1  # 300 columns; 264 are aligned
    seen = []
    calls = {torch.ops.aten.mm.default: lambda fn, args, kwargs: seen.append((fn, args[1].shape[1]))}
    with tuning.aten_calls_recorded(graph, calls), gjit.config.scope(interpret=True):
        again = cm(x)
    assert [(fn is padded_mm.mm, n) for fn, n in seen] == [(True, 300), (False, 264), (False, 264)]
    torch.testing.assert_close(again, out)


def sdpa(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_boolean_masks_go_in_additive_with_fully_masked_rows_zero(on_cpu, dtype):
    q, k, v = (torch.randn(2, 3, 8, 16, dtype=dtype) for _ in range(3))
    mask = (torch.arange(8) < 6).view(1, 1, 8, 1).expand(2, 1, 8, 8)  # export's layout; 2 dead rows
    with gjit.config.scope(matmul="aten"):
        cm = check(sdpa, q, k, v, mask)
    source = wrapper_source(cm)
    assert source.count("gjit_additive_mask(") == 1 and "gjit_traced_layout(" in source
    with gjit.config.scope(interpret=True):
        out = cm(q, k, v, mask)
    assert (out[:, :, 6:] == 0).all() and not out.isnan().any()


def test_one_conversion_per_mask_and_float32_keeps_eagers_call(on_cpu):
    q, k, v = (torch.randn(2, 2, 8, 16, dtype=torch.bfloat16) for _ in range(3))
    mask = torch.rand(2, 1, 8, 8) > 0.3

    def twice(q, k, v, mask):
        return sdpa(q, k, v, mask) + sdpa(k, q, v, mask)

    with gjit.config.scope(matmul="aten"):
        cm = check(twice, q, k, v, mask)
        assert wrapper_source(cm).count("gjit_additive_mask(") == 1
        cm32 = check(twice, *(t.float() for t in (q, k, v)), mask)
    assert "gjit_additive_mask(" not in wrapper_source(cm32)


def test_the_output_is_copied_into_the_traced_strides():
    out = torch.randn(2, 5, 3, 4).transpose(1, 2)  # [B, H, L, D] over [B, L, H, D] memory
    dead = torch.tensor([False, True, False, False, False]).view(1, 1, 5, 1)
    traced = torch.empty(2, 3, 5, 4).stride()
    got = attention_masks.traced_layout(out.clone(), dead, traced)
    assert got.stride() == traced
    torch.testing.assert_close(got, out.masked_fill(dead, 0))


def test_a_mask_shared_by_two_dtypes_is_converted_for_each(on_cpu):
    q, k, v = (torch.randn(1, 2, 8, 16, dtype=torch.float16) for _ in range(3))
    mask = torch.rand(1, 1, 8, 8) > 0.3

    def two(q, k, v, mask):
        low = sdpa(q, k, v, mask).float()
        return low + sdpa(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask).float()

    with gjit.config.scope(matmul="aten"):
        cm = check(two, q, k, v, mask)
    assert wrapper_source(cm).count("gjit_additive_mask(") == 2


def test_the_converted_mask_takes_no_name_of_the_program(on_cpu):
    q, k, v = (torch.randn(1, 2, 8, 16, dtype=torch.bfloat16) for _ in range(3))
    mask = torch.rand(1, 1, 8, 8) > 0.3
    mask_dead, mask_additive = torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)

    def named(q, k, v, mask, mask_dead, mask_additive):  # the names a converted mask could take
        return sdpa(q, k, v, mask) * mask_dead + mask_additive

    with gjit.config.scope(matmul="aten"):
        check(named, q, k, v, mask, mask_dead, mask_additive)


class _Dispatched(TorchDispatchMode):
    """The ATen ops a call reaches below autograd, with their arguments."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((func, args, kwargs or {}))
        return func(*args, **(kwargs or {}))


def _dispatched(fn, args, kwargs):
    with _Dispatched() as mode:
        out = fn(*args, **kwargs)
    return out, mode.calls


def _described(value):
    """A dispatched call's argument as the test compares it: a tensor by its shape, strides and dtype."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.stride(), value.dtype)
    if isinstance(value, (list, tuple)):
        return type(value)(map(_described, value))
    if isinstance(value, dict):
        return {k: _described(v) for k, v in value.items()}
    return (type(value), value)


aten = torch.ops.aten
t = torch.randn
BINDING_CALLS = [  # (op, args, kwargs) as export's nodes give them: the schema's positional args
    (aten.mm.default, (t(3, 4), t(4, 5)), {}),
    (aten.addmm.default, (t(5), t(3, 4), t(4, 5)), {}),
    (aten.addmm.default, (t(3, 5), t(3, 4), t(4, 5)), {"beta": 0.5, "alpha": 2}),
    (aten.bmm.default, (t(2, 3, 4), t(2, 4, 5)), {}),
    (aten.baddbmm.default, (t(2, 3, 5), t(2, 3, 4), t(2, 4, 5)), {"beta": 2, "alpha": 0.5}),
    (
        aten.convolution.default,
        (t(2, 3, 9, 9), t(4, 3, 3, 3), t(4), [2, 1], [1, 0], [1, 2], False, [0, 0], 1),
        {},
    ),
    (aten.convolution.default, (t(2, 4, 9), t(4, 2, 3), None, [1], [1], [1], True, [0], 2), {}),
    (aten.scaled_dot_product_attention.default, (t(2, 4, 5, 8), t(2, 4, 7, 8), t(2, 4, 7, 8)), {}),
    (
        aten.scaled_dot_product_attention.default,
        (t(2, 4, 5, 8), t(2, 2, 7, 8), t(2, 2, 7, 8), t(1, 1, 5, 7), 0.0, False),
        {"scale": 0.3, "enable_gqa": True},
    ),
    (aten.scaled_dot_product_attention.default, (*(t(1, 2, 6, 8) for _ in range(3)), None, 0.0, True), {}),
]


@pytest.mark.parametrize("op, args, kwargs", BINDING_CALLS, ids=lambda x: getattr(x, "__name__", ""))
def test_each_binding_reaches_its_overload_with_the_same_arguments(op, args, kwargs):
    """The wrapper's call through `wrapper.BINDINGS` and the overload's own call reach the same ATen
    ops, with the same arguments, in the same order (an op that decomposes above the dispatch modes,
    SDPA, reaches the ops it decomposes into), and return the same values."""
    assert op in wrapper.BINDINGS
    via_op, op_calls = _dispatched(op, args, kwargs)
    via_binding, binding_calls = _dispatched(wrapper.binding(op), args, kwargs)
    assert [c[0] for c in binding_calls] == [c[0] for c in op_calls], (binding_calls, op_calls)
    if not op.has_kernel_for_dispatch_key(torch._C.DispatchKey.CompositeImplicitAutograd):
        assert op_calls[0][0] is op, op_calls
    for (_, a1, k1), (_, a2, k2) in zip(op_calls, binding_calls):
        assert _described(a2) == _described(a1) and _described(k2) == _described(k1)
    assert torch.equal(via_binding, via_op)


def test_the_wrapper_calls_products_and_convolutions_through_the_bindings():
    conv = torch.nn.Conv2d(3, 4, 3, padding=1).requires_grad_(False)
    lin = torch.nn.Linear(4, 5).requires_grad_(False)

    def model(x, a, b):
        return lin(conv(x).mean((2, 3))) + torch.bmm(a, b).sum()

    x, a, b = t(2, 3, 8, 8), t(2, 3, 4), t(2, 4, 5)
    with gjit.config.scope(matmul="aten"):
        cm = check(model, x, a, b)
    source = wrapper_source(cm)
    for name in ("torch.convolution(", "torch.addmm(", "torch.bmm("):
        assert name in source, source
    assert "aten.convolution" not in source and "aten.addmm" not in source and "aten.bmm" not in source


def _causal(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _masked(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _written_out(q, k, v):
    return torch.softmax(q @ k.transpose(-1, -2) * 0.25, -1) @ v


@pytest.mark.parametrize(
    "fn, op, count",
    [
        (_causal, aten.scaled_dot_product_attention.default, 1),
        (_masked, aten.scaled_dot_product_attention.default, 1),
        (_written_out, aten.bmm.default, 2),  # on a CPU its products stay products
    ],
    ids=["plain", "boolean_mask", "written_out"],
)
def test_the_tuning_recorder_sees_each_library_call_once_through_the_binding(on_cpu, fn, op, count):
    """Tuning's library side hands each call of `op` the wrapper makes through torch's binding (SDPA
    on its own, after a boolean mask's conversion, or inside `written_out`; bmm) to the recorder
    once, and the wrapper's `torch` is torch again after."""
    q, k, v = (torch.randn(1, 2, 8, 16, dtype=torch.bfloat16) for _ in range(3))
    args = (q, k, v, torch.rand(1, 1, 8, 8) > 0.3) if fn is _masked else (q, k, v)
    with gjit.config.scope(matmul="aten"):
        cm = check(fn, *args)
    graph = cm.entries[0].program.graph
    assert wrapper.BINDINGS[op] in graph.wrapper_source
    seen = []
    with tuning.aten_calls_recorded(graph, {op: lambda f, a, kw: seen.append(a)}):
        with gjit.config.scope(interpret=True):
            again = cm(*args)
    assert len(seen) == count, seen
    assert all(any(isinstance(a, torch.Tensor) for a in call) for call in seen), seen
    torch.testing.assert_close(again, fn(*args), rtol=2e-2, atol=2e-2)
    assert tuning.inspect.unwrap(graph.call_fn(interpret=True)).__globals__["torch"] is torch
