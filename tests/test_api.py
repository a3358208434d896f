"""The public API: compile (module, function, decorator, ExportedProgram), pytree in/out,
live parameters, mutations, capture failure, bad calls, stats/reset, explain."""

import copy
import logging

import pytest
import torch
import torch.nn as nn

import gjit
from helpers import check, run_compiled

pytestmark = pytest.mark.cpu


class Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(6))
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x, *, shift=0.5):
        self.calls += 1
        return {"y": (x * self.weight + shift).tanh(), "parts": [x.relu(), x.sign()]}


def test_module_with_kwargs_and_pytree_outputs():
    model = Scale()
    with torch.no_grad():
        check(model, torch.randn(3, 6), shift=0.25)


def test_function_and_decorator_forms():
    @gjit.compile
    def f(x, y):
        return x * y + 1

    @gjit.compile(dynamic=False)
    def g(x):
        return x.exp()

    x, y = torch.randn(4, 4), torch.randn(4, 4)
    out, _ = run_compiled(f, x, y)
    torch.testing.assert_close(out, x * y + 1)
    out, _ = run_compiled(g, x)
    torch.testing.assert_close(out, x.exp())
    assert f.__name__ == "f" and isinstance(f, gjit.CompiledFunction)


def test_exported_program_input():
    ep = torch.export.export(Scale(), (torch.randn(2, 6),))
    x = torch.randn(2, 6)
    expected = ep.module()(x)
    out, _ = run_compiled(gjit.compile(ep), x)
    torch.testing.assert_close(out["y"], expected["y"])


def test_parameters_are_read_live():
    model = Scale()
    cm = gjit.compile(model)
    x = torch.randn(3, 6)
    with torch.no_grad():
        first, _ = run_compiled(cm, x)
        model.weight.copy_(torch.randn(6))
        second, _ = run_compiled(cm, x)
        torch.testing.assert_close(second["y"], model(x)["y"])
    assert not torch.allclose(first["y"], second["y"])
    assert gjit.stats()["compiles"] == 1


def test_buffer_mutation_is_applied():
    model = Scale()
    cm = gjit.compile(model)
    with torch.no_grad():
        for _ in range(3):
            run_compiled(cm, torch.randn(2, 6))
    assert int(model.calls) == 3


def test_input_mutation_is_applied():
    def f(x, y):
        x.mul_(2)
        return x + y

    x, y = torch.randn(5), torch.randn(5)
    x_eager = x.clone()
    expected = f(x_eager, y)
    out, _ = run_compiled(f, x, y)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(x, x_eager)


def test_capture_failure_runs_eagerly_and_logs_once(caplog):
    def data_dependent(x):
        if x.sum() > 0:  # export cannot trace a branch on data
            return x + 1
        return x - 1

    cm = gjit.compile(data_dependent)
    x = torch.randn(8)
    with caplog.at_level(logging.WARNING, logger="gjit"):
        for _ in range(3):
            out, _ = run_compiled(cm, x, expect_eager=True)
            torch.testing.assert_close(out, data_dependent(x))
    assert sum("could not capture" in r.message for r in caplog.records) == 1
    assert gjit.stats()["eager_runs"] == 3 and gjit.stats()["compiles"] == 0


def test_wrong_arity_raises_like_the_model():
    cm = gjit.compile(Scale())
    with pytest.raises(TypeError) as ours:
        cm(torch.randn(2, 6), torch.randn(2, 6))
    with pytest.raises(TypeError) as theirs:
        Scale()(torch.randn(2, 6), torch.randn(2, 6))
    assert "Scale.forward()" in str(ours.value) and "Scale.forward()" in str(theirs.value)
    assert "positional argument" in str(ours.value)
    with pytest.raises(TypeError):
        cm(torch.randn(2, 6), bogus=1)


def test_non_tensor_where_tensor_expected_raises_like_the_model():
    def f(x):
        return x.relu()

    cm = gjit.compile(f)
    run_compiled(cm, torch.randn(3))
    with pytest.raises(AttributeError):
        cm(3)


def test_new_shape_or_dtype_recompiles_and_stays_correct():
    def f(x):
        return x * 2 + 1

    cm = gjit.compile(f)
    for x in (torch.randn(4, 5), torch.randn(4, 5), torch.randn(7, 5), torch.randn(4, 5).double()):
        out, _ = run_compiled(cm, x)
        torch.testing.assert_close(out, f(x))
    s = gjit.stats()
    # the first entry is dynamic in both dims (export decides), so only the dtype change recompiles
    assert (s["compiles"], s["recompiles"], s["cache_hits"]) == (2, 1, 2)


def test_specialized_python_scalar_recompiles():
    def f(x, alpha):
        return x * alpha

    cm = gjit.compile(f)
    x = torch.randn(3)
    for alpha in (2.0, 2.0, 3.0):
        out, _ = run_compiled(cm, x, alpha)
        torch.testing.assert_close(out, x * alpha)
    assert gjit.stats()["compiles"] == 2


def test_dtype_device_and_memory_format_arguments_are_specialized():
    """torch.export has no input for a dtype (or memory format, layout, device): gjit passes it as
    a constant, the entry guards its value, and another value compiles another entry."""

    def fn(x, dtype, memory_format=torch.contiguous_format):
        return (
            torch.softmax(x, -1, dtype=dtype),
            torch.zeros(3, dtype=dtype),
            x.clone(memory_format=memory_format),
        )

    cm = gjit.compile(fn)
    x = torch.randn(4, 5)
    check(cm, x, torch.float16)
    check(cm, x * 2, torch.float16)
    check(cm, x, torch.float64, memory_format=torch.preserve_format)
    assert len(cm.entries) == 2 and gjit.stats()["eager_runs"] == 0
    guards = [g.description for g in cm.entries[0].guards.steps if hasattr(g, "description")]
    assert any("torch.float16" in g for g in guards), guards


def test_transposed_input_after_contiguous_first_call():
    def f(x):
        return x.sin() + 1

    cm = gjit.compile(f)
    base = torch.randn(6, 6)
    for x in (base, base.t(), base[:, ::2]):
        out, _ = run_compiled(cm, x)
        torch.testing.assert_close(out, f(x))


def test_stats_and_reset():
    cm = gjit.compile(lambda x: x + 1)
    run_compiled(cm, torch.randn(3))
    run_compiled(cm, torch.randn(3))
    s = gjit.stats()
    assert s["compiles"] == 1 and s["cache_hits"] == 1 and s["kernels"] == 1
    assert "lower" in s["compile_seconds"]
    gjit.reset()
    assert gjit.stats()["compiles"] == 0 and gjit.stats()["cache_hits"] == 0
    assert cm.entries == []
    run_compiled(cm, torch.randn(3))
    assert gjit.stats()["compiles"] == 1  # compiled again after reset


def test_explain_takes_a_model_or_a_compiled_callable():
    def f(x, w):
        return (x @ w).relu() * 2

    x, w = torch.randn(3, 4), torch.randn(4, 5)
    for target in (f, gjit.compile(f)):
        rep = gjit.explain(target, x, w)
        assert len(rep.kernels) == 1
        kernel = rep.kernels[0]
        assert kernel.name.startswith("gjit_mm_fused_mm_relu_mul")  # the matmul template, epilogue fused
        assert "@triton.jit" in kernel.source
        nodes = [n.split(": ")[1] for n in kernel.aten_nodes]
        assert nodes == ["aten.mm.default", "aten.relu.default", "aten.mul.Tensor"]
        assert rep.externs == []
        assert "gjit: 1 kernel(s), 0 extern(s)" in str(rep)
    with gjit.config.scope(matmul="aten"):  # the matmul as an extern, and why
        rep = gjit.explain(f, x, w)
    assert [k.name for k in rep.kernels] == ["gjit_poi_fused_relu_mul_0"]
    assert [(e.op, e.reason) for e in rep.externs] == [
        (
            "aten.mm.default",
            "lowering refused: matmul runs as an ATen extern "
            "(gjit.config.matmul is 'aten', or the backend is cupy)",
        )
    ]


def test_cpu_without_interpret_runs_the_fallback_interpreter():
    def f(x):
        return (x * 3).cos()

    cm = gjit.compile(f)
    x = torch.randn(10)
    with gjit.config.scope(interpret=False):
        torch.testing.assert_close(cm(x), f(x))
    assert gjit.stats()["compiles"] == 1


def test_zero_size_and_size_one_inputs():
    def f(x, y):
        return (x + y).exp()

    check(f, torch.randn(0, 5), torch.randn(5))
    check(f, torch.randn(1, 5), torch.randn(1, 1))


def test_autograd_calls_run_eagerly_with_gradients(caplog):
    model = Scale()
    cm = gjit.compile(model)
    x = torch.randn(2, 6)
    with caplog.at_level(logging.WARNING, logger="gjit"):
        out, _ = run_compiled(cm, x, expect_eager=True)
        run_compiled(cm, x, expect_eager=True)
    out["y"].sum().backward()
    assert model.weight.grad is not None
    assert sum("compiles inference graphs" in r.message for r in caplog.records) == 1
    assert gjit.stats()["eager_runs"] == 2 and gjit.stats()["compiles"] == 0
    with torch.no_grad():
        run_compiled(cm, x)
    assert gjit.stats()["compiles"] == 1


def test_saved_pt2_file(tmp_path):
    class M(torch.nn.Module):
        def forward(self, x):
            return (x * 3).tanh()

    x = torch.randn(4, 5)
    path = str(tmp_path / "model.pt2")
    torch.export.save(torch.export.export(M(), (x,)), path)
    for compiled in (gjit.compile(path), gjit.compile(torch.export.load(path))):
        out, _ = run_compiled(compiled, x)
        torch.testing.assert_close(out, M()(x))


def test_torch_compile_backend_entry_point():
    """torch.compile(backend="gjit") finds gjit through the torch_dynamo_backends entry point;
    each graph Dynamo captures (two here, around a graph break) is compiled by gjit."""

    def f(x, y):
        z = (x * y).relu()
        torch._dynamo.graph_break()
        return z.sum(-1) + 1

    torch._dynamo.reset()
    compiled = torch.compile(f, backend="gjit")
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    with gjit.config.scope(interpret=True, debug=True):
        torch.testing.assert_close(compiled(x, y), f(x, y))
    assert gjit.stats()["compiles"] == 2 and gjit.stats()["eager_runs"] == 0


def test_torch_compile_training_gets_eager_gradients(caplog):
    """The backend keeps the caller's grad mode: a training call runs the graph eagerly (logged)
    and backward gives eager's gradients; under no_grad the same model runs gjit's kernels."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4), nn.LayerNorm(4))
    reference = copy.deepcopy(model)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="gjit")
    x = torch.randn(5, 8)
    with gjit.config.scope(interpret=True, debug=True), caplog.at_level(logging.WARNING, logger="gjit"):
        out = compiled(x)
    out.square().mean().backward()
    reference(x).square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad)
    assert "compiles inference graphs" in caplog.text
    assert gjit.stats()["compiles"] == 0 and gjit.stats()["eager_runs"] == 1
    with torch.no_grad(), gjit.config.scope(interpret=True, debug=True):
        out = compiled(x)
        torch.testing.assert_close(out, reference(x))
    assert not out.requires_grad
    assert gjit.stats()["compiles"] == 1 and gjit.stats()["eager_runs"] == 1


@pytest.mark.parametrize("dynamic", [True, None], ids=["dynamic", "automatic_dynamic"])
def test_torch_compile_dynamic_sizes_reuse_one_gjit_entry(dynamic):
    """Dynamo passes the sizes it made symbolic as int graph inputs (SymInts in example_inputs);
    gjit binds them as symbols, so new batch sizes reuse the entry instead of recompiling."""

    def f(x):
        return (x.sin() * 2).reshape(x.shape[0], -1).sum(1) + x.shape[0]

    torch._dynamo.reset()
    compiled = torch.compile(f, backend="gjit", dynamic=dynamic)
    with torch.no_grad(), gjit.config.scope(interpret=True, debug=True):
        for batch in (3, 5, 7, 9, 11, 4, 30):
            x = torch.randn(batch, 4, 2)
            torch.testing.assert_close(compiled(x), f(x))
    # automatic dynamic: Dynamo's static graph for the first size, then its dynamic graph
    assert gjit.stats()["compiles"] == (1 if dynamic else 2), gjit.stats()
    assert gjit.stats()["eager_runs"] == 0


class _Scaled(nn.Module):
    """A forward taking options through **kwargs (as transformers' models do), with a forward hook."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.register_forward_hook(lambda module, args, out: out + 100)

    def forward(self, x, **kwargs):
        return self.linear(x).relu() * kwargs.get("scale", 1.0)


def test_kwargs_through_var_keyword_keep_the_modules_hooks():
    model = _Scaled().eval()
    x = torch.randn(3, 8)
    with torch.no_grad():
        check(model, x, scale=2.0)  # compared with eager, whose hook adds 100
        check(model, x)
