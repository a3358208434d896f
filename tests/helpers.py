"""The one test helper per layer: compile, run kernels in Triton's interpreter with poisoned
buffers, compare with eager (float64 reference for low precision), count kernels."""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

import gjit

LOW_PRECISION = (torch.float16, torch.bfloat16)


def tolerances(dtype: torch.dtype) -> tuple[float, float]:
    if dtype == torch.float16:
        return 2e-3, 2e-3
    if dtype == torch.bfloat16:
        return 1.6e-2, 1.6e-2
    if dtype == torch.float64:
        return 1e-10, 1e-10
    return 1.3e-6, 1e-5


def upcast(tree: Any) -> Any:
    return pytree.tree_map(
        lambda t: (
            t.double() if isinstance(t, torch.Tensor) and t.dtype in LOW_PRECISION + (torch.float32,) else t
        ),
        tree,
    )


def assert_same(actual: torch.Tensor, expected: torch.Tensor, reference: torch.Tensor | None = None) -> None:
    """Equal dtype/shape; values close (NaN where eager has NaN). Given a float64 `reference`,
    a float32 or lower-precision result may differ from eager only if it is at least about as
    close to the reference (eager's float32 trigamma, say, is good to 1e-6 only)."""
    assert isinstance(actual, torch.Tensor), f"expected a tensor, got {type(actual)}"
    assert actual.dtype == expected.dtype, f"dtype {actual.dtype} != eager {expected.dtype}"
    assert actual.shape == expected.shape, f"shape {tuple(actual.shape)} != eager {tuple(expected.shape)}"
    if not expected.dtype.is_floating_point:
        assert torch.equal(actual, expected), f"values differ:\n{actual}\n{expected}"
        return
    rtol, atol = tolerances(expected.dtype)
    if reference is not None and expected.dtype in (*LOW_PRECISION, torch.float32):
        ref = reference.to(torch.float64)
        err_gjit = (actual.double() - ref).abs().nan_to_num(0)
        err_eager = (expected.double() - ref).abs().nan_to_num(0)
        bound = 2 * err_eager + atol + rtol * ref.abs().nan_to_num(0)
        bad = err_gjit > bound
        assert not bad.any(), f"gjit is farther from the float64 reference than eager at {bad.sum()} elements"
        assert torch.equal(actual.isnan(), expected.isnan()), "NaN positions differ from eager"
        return
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, equal_nan=True)


def run_compiled(
    fn: Any, *args: Any, expect_eager: bool | None = False, **kwargs: Any
) -> tuple[Any, gjit.CompiledFunction]:
    """One call through the generated kernels (Triton's interpreter, poisoned buffers).

    `expect_eager=False`: the call must run compiled; True: it must run eagerly (capture failed,
    the recompile limit, autograd); None: either (the test checks what it expects itself)."""
    cm = fn if isinstance(fn, gjit.CompiledFunction) else gjit.compile(fn)
    eager_before = gjit.stats()["eager_runs"]
    with gjit.config.scope(interpret=True, debug=True):
        out = cm(*args, **kwargs)
    ran_eagerly = gjit.stats()["eager_runs"] > eager_before
    if expect_eager is True:
        assert ran_eagerly, "expected gjit to run this call eagerly, but it ran compiled"
    elif expect_eager is False:
        assert not ran_eagerly, (
            f"gjit ran this call eagerly, not compiled: {cm.eager_reason or 'see GJIT_LOGS=recompiles'}"
        )
    return out, cm


def check(
    fn: Any, *args: Any, kernels: int | None = None, expect_eager: bool = False, **kwargs: Any
) -> gjit.CompiledFunction:
    """Compile `fn`, run it through the generated kernels, compare every output with eager.

    The compiled path must have run: a call that gjit ran eagerly instead (capture failed, the
    recompile limit) fails the check, unless the test says so with `expect_eager=True`, and then
    it fails when the call did not run eagerly."""
    model = fn.model if isinstance(fn, gjit.CompiledFunction) else fn
    expected = model(*args, **kwargs)
    out, cm = run_compiled(fn, *args, expect_eager=expect_eager, **kwargs)
    reference = None
    if any(
        isinstance(t, torch.Tensor) and t.dtype in LOW_PRECISION for t in pytree.tree_leaves((args, kwargs))
    ):
        reference = model(*upcast(args), **upcast(kwargs))
    out_leaves, out_spec = pytree.tree_flatten(out)
    exp_leaves, exp_spec = pytree.tree_flatten(expected)
    assert out_spec == exp_spec, f"output structure {out_spec} != eager {exp_spec}"
    ref_leaves = pytree.tree_leaves(reference) if reference is not None else [None] * len(exp_leaves)
    for a, e, r in zip(out_leaves, exp_leaves, ref_leaves):
        if isinstance(e, torch.Tensor):
            assert_same(a, e, r)
        else:
            assert a == e
    if kernels is not None:
        assert kernel_count(cm, *args, **kwargs) == kernels, gjit.explain(cm, *args, **kwargs)
    return cm


def check_against_float64(fn: Any, *args: Any, reference_fn: Any = None) -> tuple[gjit.CompiledFunction, Any]:
    """Run `fn` compiled (it must run compiled), compare each output with eager and with `fn` (or
    `reference_fn`, for a module: it in float64) on the arguments in float64; the compiled
    function and its explain report."""
    expected = fn(*args)
    out, cm = run_compiled(fn, *args)
    reference = (reference_fn or fn)(*upcast(args))
    outs = out if isinstance(out, tuple) else (out,)
    exps = expected if isinstance(expected, tuple) else (expected,)
    refs = reference if isinstance(reference, tuple) else (reference,)
    for a, e, r in zip(outs, exps, refs):
        assert_same(a, e, r)
    return cm, gjit.explain(cm, *args)


def kernel_count(cm: gjit.CompiledFunction, *args: Any, **kwargs: Any) -> int:
    return len(gjit.explain(cm, *args, **kwargs).kernels)


# -- a first call's kernel launches, through Triton's launcher (gjit/runtime/prebuild.py) ------------


def first_graph_call(model: Any, *args: Any) -> tuple:
    """A first call of `model` compiled (kernels in Triton's interpreter), compared with eager:
    (the callable gjit.compile made, its entry's graph, the graph's inputs and sizes at that call).
    Fails when the compiled path did not run."""
    from unittest import mock

    from gjit.runtime.graph import CompiledGraph

    seen = []
    run = CompiledGraph.run

    def spy(self: CompiledGraph, inputs: list, sizes: tuple) -> list:
        seen.append((self, list(inputs), sizes))
        return run(self, inputs, sizes)

    with mock.patch.object(CompiledGraph, "run", spy), gjit.config.scope(interpret=True), torch.no_grad():
        compiled = gjit.compile(model)
        out = compiled(*args)
        expected = model(*args)
    for a, b in zip(pytree.tree_leaves(out), pytree.tree_leaves(expected)):
        torch.testing.assert_close(a, b)
    assert seen, "the compiled path did not run"
    return (compiled, *seen[0])


def kernel_launches(graph: Any, inputs: list, sizes: tuple) -> list[tuple]:
    """The Triton kernel launches of a real call of `graph` (run in the interpreter), in order:
    (the kernel's name in the wrapper, grid, args, kwargs)."""
    from gjit import tuning

    launches = []

    def record(name: str, kernel: Any) -> Any:
        class Recorder:
            def __getitem__(self, grid: Any) -> Any:
                def launch(*args: Any, **kwargs: Any) -> Any:
                    launches.append((name, grid, args, kwargs))
                    return kernel[grid](*args, **kwargs)

                return launch

        return Recorder()

    with gjit.config.scope(interpret=True), tuning.kernels_wrapped(graph, record), torch.no_grad():
        graph.run(inputs, sizes)
    return launches


def through_tritons_launcher(namespace: dict, launches: list[tuple]) -> list[bool]:
    """Each launch through Triton's launcher, `run(warmup=True)`: the launch's own specialization,
    compile and on-disk cache, nothing launched (an Awaiting waits for its build first and binds
    the kernel). Whether each found its binary in Triton's cache (True) or compiled it (False)."""
    import triton

    hits: list[bool] = []
    previous = triton.knobs.compilation.listener
    triton.knobs.compilation.listener = lambda **kw: hits.append(kw["cache_hit"])
    try:
        for name, grid, args, kwargs in launches:
            namespace[name][grid]  # an Awaiting waits here, then the name is the kernel itself
            namespace[name].run(*args, grid=grid, warmup=True, **kwargs)
    finally:
        triton.knobs.compilation.listener = previous
    return hits
