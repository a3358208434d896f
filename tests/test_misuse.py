"""Bad input and misuse: every call a user can get wrong either gives eager's answer (through the
kernels, or eagerly with a logged reason) or raises eager's exception, never a gjit crash or a
silently different result.

Each item of the issue, and the tests that cover it (here unless a file is named):

- wrong arity or kwargs: test_api.py::test_wrong_arity_raises_like_the_model (too many
  positionals, unknown kwarg); test_bad_calls_raise_the_models_type_error (missing positional or
  keyword-only argument, unknown kwarg, an argument given twice),
  test_keyword_and_positional_calls_share_an_entry
- non-tensor where a tensor was exported:
  test_api.py::test_non_tensor_where_tensor_expected_raises_like_the_model;
  test_non_tensor_where_a_tensor_was_exported,
  test_an_input_export_rejects_does_not_disable_the_entries
- dtype/device/rank changes: test_api.py::test_new_shape_or_dtype_recompiles_and_stays_correct,
  test_dynamic.py::test_dtype_change_recompiles_and_device_change_fails_the_guard;
  test_rank_change_recompiles_and_is_correct, test_integer_input_after_float_recompiles_with_eager_promotion
- inputs violating a user range: test_dynamic.py::test_export_docs_derived_dim_with_a_range (above
  max: recompile), test_dynamic.py::test_error_on_recompile_raises_for_a_size_outside_the_range (above
  max: raise); test_size_below_a_user_min_recompiles_or_raises
- NaN/Inf inputs: test_reductions.py::test_nan_and_large_inputs, test_pointwise_ops.py (SPECIALS);
  test_nan_and_inf_through_fused_pointwise_and_reductions (fp32/fp16, persistent/looped)
- aliasing inputs (same tensor twice): test_dynamic.py::test_one_tensor_passed_twice_then_two_tensors,
  test_dynamic.py::test_aliased_inputs_of_a_mutating_program; test_same_tensor_twice_and_overlapping_views
- outputs that alias inputs: test_outputs_that_alias_an_input_alias_it_like_eager,
  test_a_mutated_input_that_is_returned_aliases_it
- in-place mutation of inputs by the model: test_api.py::test_input_mutation_is_applied;
  test_in_place_mutation_of_inputs_is_visible_to_the_caller
- no_grad vs requires_grad parameters: test_api.py::test_autograd_calls_run_eagerly_with_gradients,
  test_api.py::test_torch_compile_training_gets_eager_gradients;
  test_inference_mode_no_grad_and_frozen_parameters_use_the_kernels,
  test_a_call_needing_autograd_after_an_entry_exists_gets_eager_gradients
- a model whose forward raises: test_forward_that_raises_raises_its_exception_on_every_call,
  test_forward_that_fails_for_every_input
- sizes whose indices pass 2**31: test_dynamic.py::test_int32_offsets_are_an_assumption_the_guard_checks;
  test_a_huge_logical_size_gets_int64_offsets (and runs that kernel at small sizes),
  test_a_huge_call_after_a_small_entry_recompiles_with_int64_offsets
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import gjit
from helpers import check, run_compiled

# NaN/Inf inputs make the interpreter's numpy math warn (overflow, invalid value): intended here
pytestmark = [pytest.mark.cpu, pytest.mark.filterwarnings("ignore::RuntimeWarning")]


def stats(*keys: str) -> tuple:
    s = gjit.stats()
    return tuple(s[k] for k in keys)


# ----------------------------------------------------------------------------------------------
# Calls that do not fit the signature, and inputs of the wrong kind
# ----------------------------------------------------------------------------------------------


class Affine(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(5))

    def forward(self, x, y=None, *, shift):
        out = x * self.weight + shift
        return out if y is None else out * y


BAD_CALLS = {
    "missing_positional": ((), {"shift": 1.0}),
    "missing_keyword_only": ((torch.randn(3, 5),), {}),
    "unknown_kwarg": ((torch.randn(3, 5),), {"shift": 1.0, "bias": 2.0}),
    "given_twice": ((torch.randn(3, 5),), {"x": torch.randn(3, 5), "shift": 1.0}),
    "too_many_positionals": ((torch.randn(3, 5), torch.randn(3, 5), 1.0), {}),
}


@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_bad_calls_raise_the_models_type_error(name):
    model = Affine()
    cm = gjit.compile(model)
    args, kwargs = BAD_CALLS[name]
    with pytest.raises(TypeError) as theirs:
        model(*args, **kwargs)
    with pytest.raises(TypeError) as ours:
        run_compiled(cm, *args, **kwargs)
    assert "Affine.forward()" in str(ours.value)
    # the same argument is named (gjit's text is inspect.Signature.bind's, not the interpreter's)
    for word in ("'x'", "'shift'", "'bias'"):
        assert (word in str(ours.value)) == (word in str(theirs.value)), (str(ours.value), str(theirs.value))
    assert stats("compiles", "eager_runs") == (0, 0)  # rejected before export or the model ran


def test_keyword_and_positional_calls_share_an_entry():
    model = Affine()
    cm = gjit.compile(model)
    x, y = torch.randn(3, 5), torch.randn(3, 5)
    with torch.no_grad():
        check(cm, x, y, shift=0.5)
        check(cm, x, y=y, shift=0.5)
        check(cm, x=x, y=y, shift=0.5)
    assert stats("compiles", "cache_hits") == (1, 2)


def test_non_tensor_where_a_tensor_was_exported():
    def f(x, y):
        return x * y + 1

    cm = gjit.compile(f)
    x = torch.randn(4)
    check(cm, x, torch.randn(4))
    for bad in (None, "2", [1.0, 2.0, 3.0, 4.0]):  # eager raises a TypeError for each
        with pytest.raises(TypeError) as theirs:
            f(x, bad)
        with pytest.raises(type(theirs.value)):
            run_compiled(cm, x, bad)
    check(cm, x, 2.5)  # a Python float works eagerly: it gets an entry of its own
    check(cm, x, torch.randn(4))
    assert stats("compiles", "cache_hits") == (2, 1)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # numpy 2's __array_wrap__ notice
def test_an_input_export_rejects_does_not_disable_the_entries():
    np = pytest.importorskip("numpy")

    def f(x, y):
        return x * y + 1

    cm = gjit.compile(f)
    x = torch.randn(4)
    check(cm, x, torch.randn(4))
    ndarray = np.full(4, 2.0, dtype=np.float32)
    out, _ = run_compiled(cm, x, ndarray, expect_eager=True)  # export rejects it, eager accepts it
    torch.testing.assert_close(out, x * 2 + 1)
    check(cm, x, torch.randn(4))
    assert gjit.stats()["cache_hits"] == 1


def test_rank_change_recompiles_and_is_correct():
    cm = gjit.compile(lambda x: (x * 2).sum(-1) + x.mean())
    for shape in [(4, 5), (6, 3), (4, 5, 3), (7,), (2, 3, 4), (9,)]:
        check(cm, torch.randn(shape))
    assert stats("compiles", "cache_hits") == (3, 3)  # one entry per rank
    assert "x.dim() == 2, got 3" in cm.entries[0].guards.failures([torch.randn(4, 5, 3)])


def test_integer_input_after_float_recompiles_with_eager_promotion():
    cm = gjit.compile(lambda x: x / 2 + x.sum(0))
    check(cm, torch.randn(4, 3))
    check(cm, torch.randint(-50, 50, (4, 3)))  # true division of int64 gives float32, as eager
    check(cm, torch.randint(-50, 50, (4, 3), dtype=torch.int32))
    assert gjit.stats()["compiles"] == 3


def test_size_below_a_user_min_recompiles_or_raises():
    cm = gjit.compile(lambda x: torch.softmax(x, -1) * 3)
    x = torch.randn(6, 5)
    gjit.mark_dynamic(x, 0, min=4, max=16)
    check(cm, x)
    for n in (4, 16, 9):
        check(cm, torch.randn(n, 5))
    assert stats("compiles", "cache_hits") == (1, 3)
    assert ">= 4" in cm.entries[0].guards.format()
    with gjit.config.scope(error_on_recompile=True):
        with pytest.raises(gjit.RecompileError, match=r">= 4"):
            run_compiled(cm, torch.randn(3, 5))
    check(cm, torch.randn(3, 5))  # below min: a new entry, the right answer
    assert gjit.stats()["compiles"] == 2


# ----------------------------------------------------------------------------------------------
# NaN and infinities
# ----------------------------------------------------------------------------------------------

NAN_FNS = {
    "pointwise_chain": lambda x: (x * 2 + 1).exp().tanh() + x.sigmoid() * x,
    "amax": lambda x: x.amax(-1),
    "amin_first": lambda x: x.amin(0),
    "sum_of_pointwise": lambda x: (x * 0.5 - 1).sum(-1),
    "softmax": lambda x: torch.softmax(x, -1),
    "log_softmax": lambda x: torch.log_softmax(x, -1),
    "minus_amax": lambda x: x - x.amax(-1, keepdim=True),
    "layer_norm": lambda x: F.layer_norm(x, (x.shape[-1],)),
    "argmax": lambda x: x.argmax(-1),
    "maximum_clamp": lambda x: torch.maximum(x, x.flip(0)).clamp(-2, 2),
    "finite_sum": lambda x: torch.where(x.isfinite(), x, 0).sum(0),
}


def special_values(dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(7, 37) * 3
    x[0, 3] = math.nan
    x[1, 36] = math.inf  # the last column: the tail of a looped reduction
    x[2, 0] = -math.inf
    x[3, :] = math.nan
    x[4, :] = -math.inf  # softmax of a row of -inf is NaN
    x[5, 10], x[5, 11] = math.inf, -math.inf  # inf - inf = NaN in a sum
    x[6, 20] = math.inf
    return x.to(dtype)


@pytest.mark.parametrize("mode", ["persistent", "looped"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
def test_nan_and_inf_through_fused_pointwise_and_reductions(mode, dtype):
    x = special_values(dtype)
    with gjit.config.scope(reduction=mode, rblock=8):
        for name, fn in NAN_FNS.items():
            if name not in ("argmax", "finite_sum"):  # the specials reach the output
                assert not fn(x).isfinite().all(), name
            check(fn, x)  # values, and NaN exactly where eager has NaN


# ----------------------------------------------------------------------------------------------
# Aliasing: inputs that share memory, outputs that are views of inputs, in-place mutation
# ----------------------------------------------------------------------------------------------


def test_same_tensor_twice_and_overlapping_views():
    def f(x, y):
        return (x * 2 - y).relu() + y.sum(0)

    cm = gjit.compile(f)
    base = torch.randn(6, 6)
    for x, y in ((base, base), (base, base.t()), (base[:-1], base[1:]), (base, torch.randn(6, 6))):
        check(cm, x, y)


ALIAS_OUTPUTS = {
    "identity": lambda x: x,
    "view": lambda x: x.view(-1),
    "slice": lambda x: x[1:],
    "transpose": lambda x: x.t(),
    "select": lambda x: x[0],
    "expand": lambda x: x[:1].expand(5, -1),
    "view_and_kernel": lambda x: (x[1:], x.sin()),
}


@pytest.mark.parametrize("name", list(ALIAS_OUTPUTS))
def test_outputs_that_alias_an_input_alias_it_like_eager(name):
    fn = ALIAS_OUTPUTS[name]
    x = torch.randn(4, 4)
    out, cm = run_compiled(fn, x)
    expected = fn(x)
    view, expected_view = (out[0], expected[0]) if isinstance(out, tuple) else (out, expected)
    assert view.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    assert (view.stride(), view.storage_offset()) == (expected_view.stride(), expected_view.storage_offset())
    x.add_(torch.randn(4, 4))  # a write to the input shows through the output, as in eager
    torch.testing.assert_close(view, expected_view)
    if name in ("identity", "view", "slice", "transpose", "select"):
        view.mul_(-3)  # and a write to the output shows in the input
        torch.testing.assert_close(expected_view, view)


def test_a_mutated_input_that_is_returned_aliases_it():
    def f(x):
        x.add_(1)
        return x

    x = torch.randn(4, 4)
    expected_x = x.clone()
    f(expected_x)
    out, _ = run_compiled(f, x)
    torch.testing.assert_close(out, expected_x)
    torch.testing.assert_close(x, expected_x)
    assert out is x  # as in eager

    def g(x):
        x.mul_(2)
        return x[1:]

    x = torch.randn(4, 4)
    out, _ = run_compiled(g, x)
    torch.testing.assert_close(out, x[1:])
    out[0, 0] = 123.0  # a view of the input, as in eager: the write shows in x
    assert x[1, 0] == 123.0


def add_then_use(x, y):
    x.add_(1)
    return x * y


def set_a_row(x, y):
    x[0] = 0
    return x.sum(0) + y[0]


def mul_on_a_view(x, y):
    x[:, 1].mul_(2)
    return x + y


def add_through_a_transpose(x, y):
    x.t().add_(y)
    return x.cos()


def mutate_both(x, y):
    x.add_(y)
    y.mul_(2)
    return x - y


def relu_in_place(x, y):
    torch.relu_(x)
    return x + y


MUTATIONS = [add_then_use, set_a_row, mul_on_a_view, add_through_a_transpose, mutate_both, relu_in_place]


@pytest.mark.parametrize("fn", MUTATIONS, ids=[f.__name__ for f in MUTATIONS])
def test_in_place_mutation_of_inputs_is_visible_to_the_caller(fn):
    cm = gjit.compile(fn)
    for _ in range(2):  # the compiling call, then a cache hit
        x, y = torch.randn(4, 4), torch.randn(4, 4)
        ex, ey = x.clone(), y.clone()
        expected = fn(ex, ey)
        out, _ = run_compiled(cm, x, y)
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(x, ex)
        torch.testing.assert_close(y, ey)
    assert stats("compiles", "cache_hits", "eager_runs") == (1, 1, 0)


# ----------------------------------------------------------------------------------------------
# Grad mode
# ----------------------------------------------------------------------------------------------


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.LayerNorm(8))


def test_inference_mode_no_grad_and_frozen_parameters_use_the_kernels():
    model = small_model()
    cm = gjit.compile(model)
    x = torch.randn(3, 6)
    with torch.inference_mode():
        out, _ = run_compiled(cm, x)
        torch.testing.assert_close(out, model(x))
    with torch.no_grad():
        out, _ = run_compiled(cm, x)
    assert not out.requires_grad
    model.requires_grad_(False)
    out, _ = run_compiled(cm, x)  # grad mode on, but nothing requires grad: kernels, like eager no grad_fn
    torch.testing.assert_close(out, model(x))
    assert not out.requires_grad
    assert stats("compiles", "cache_hits", "eager_runs") == (1, 2, 0)


def test_a_call_needing_autograd_after_an_entry_exists_gets_eager_gradients(caplog):
    model = small_model()
    cm = gjit.compile(model)
    x = torch.randn(3, 6)
    with torch.no_grad():
        check(cm, x)
    assert gjit.stats()["compiles"] == 1
    xr = x.clone().requires_grad_()
    xe = x.clone().requires_grad_()
    with caplog.at_level(logging.WARNING, logger="gjit"):
        out, _ = run_compiled(cm, xr, expect_eager=True)  # grad mode on, trainable parameters: eager
    assert "runs eagerly" in caplog.text and out.grad_fn is not None
    out.square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(xe).square().sum().backward()
    torch.testing.assert_close(xr.grad, xe.grad)
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(g, p.grad)
    assert stats("compiles", "eager_runs") == (1, 1)


# ----------------------------------------------------------------------------------------------
# A forward that raises
# ----------------------------------------------------------------------------------------------


class ModelError(ValueError):
    pass


class RaisesOnLargeBatch(nn.Module):
    def forward(self, x):
        if x.shape[0] > 4:
            raise ModelError("batch too large")
        return x.relu() * 2


def test_forward_that_raises_raises_its_exception_on_every_call(caplog):
    cm = gjit.compile(RaisesOnLargeBatch())
    for _ in range(2):  # the first call, and a later one: the model's error, not a gjit crash
        with pytest.raises(ModelError, match="batch too large"):
            run_compiled(cm, torch.randn(6, 3))
    # nor a warning that gjit "could not capture" a model that simply raised
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("gjit")]
    assert cm.eager_reason is None and gjit.stats()["compiles"] == 0
    check(cm, torch.randn(3, 3))  # a call that works still compiles
    with pytest.raises(ModelError):  # misses the entry (x.size(0) <= 4), raises again
        run_compiled(cm, torch.randn(8, 3))
    check(cm, torch.randn(2, 3))
    assert stats("compiles", "cache_hits") == (1, 1)


def test_forward_that_fails_for_every_input():
    def f(x):
        return x @ x  # not square: eager's RuntimeError

    cm = gjit.compile(f)
    for _ in range(3):
        with pytest.raises(RuntimeError) as ours:
            run_compiled(cm, torch.randn(3, 4))
        with pytest.raises(RuntimeError) as theirs:
            f(torch.randn(3, 4))
        assert str(theirs.value) in str(ours.value)
    assert cm.eager_reason is None
    check(cm, torch.randn(4, 4))  # a square input compiles
    assert gjit.stats()["compiles"] == 1


# ----------------------------------------------------------------------------------------------
# Offsets past 2**31: int64 indexing, checked without allocating the memory
# ----------------------------------------------------------------------------------------------

HUGE = 2**16  # a HUGE x HUGE broadcast has 2**32 elements in a few hundred KiB


def broadcast_sum(x, y):
    return (x * y).sum(-1) + 1


def broadcast_add(x, y):
    return x + y


@pytest.mark.parametrize("fn", [broadcast_sum, broadcast_add], ids=["reduction", "pointwise"])
def test_a_huge_logical_size_gets_int64_offsets(fn):
    cm = gjit.compile(fn)
    x, y = torch.randn(HUGE, 1), torch.randn(1, HUGE)
    gjit.explain(cm, x.expand(HUGE, HUGE), y.expand(HUGE, HUGE))  # compiles, runs nothing
    (kernel,) = cm.entries[0].program.kernels
    assert kernel.index_dtype == "int64"
    assert "tl.program_id(0).to(tl.int64)" in kernel.source
    assert kernel.signature["xnumel"] == "i64" and not kernel.assumptions
    assert not any("int32" in g.description for g in cm.entries[0].guards.guards)
    # the entry is dynamic: a small call with the same stride pattern runs this int64 kernel
    check(cm, torch.randn(6, 1).expand(6, 9), torch.randn(1, 9).expand(6, 9))
    assert stats("compiles", "cache_hits") == (1, 1)


def test_a_huge_call_after_a_small_entry_recompiles_with_int64_offsets():
    cm = gjit.compile(broadcast_sum)
    check(cm, torch.randn(6, 1).expand(6, 9), torch.randn(1, 9).expand(6, 9))
    assert cm.entries[0].program.kernels[0].index_dtype == "int32"
    x, y = torch.randn(HUGE, 1), torch.randn(1, HUGE)
    gjit.explain(cm, x.expand(HUGE, HUGE), y.expand(HUGE, HUGE))
    assert gjit.stats()["compiles"] == 2  # the int32 assumption failed: a new entry
    assert cm.entries[1].program.kernels[0].index_dtype == "int64"
