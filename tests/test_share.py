"""Regions whose kernels are the same code but for names and comments launch one kernel
(codegen/share.py): a stack of layers builds as many kernels as one layer, whatever its depth."""

from __future__ import annotations

import copy
import dataclasses
import inspect

import pytest
import torch
import torch.nn.functional as F

import gjit
from gjit.codegen.share import code_key
from helpers import check, check_against_float64

pytestmark = pytest.mark.cpu


class Layer(torch.nn.Module):
    """A pre-norm MLP block with a residual: a norm, two matmul templates and their epilogues."""

    def __init__(self, width: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width, dtype=dtype)
        self.up = torch.nn.Linear(width, 2 * width, dtype=dtype)
        self.down = torch.nn.Linear(2 * width, width, dtype=dtype)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


def stack(*widths: int, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(len(widths))
    return torch.nn.Sequential(*(Layer(w, dtype) for w in widths)).eval()


def compiled(model: torch.nn.Module, x: torch.Tensor, **scope) -> gjit.CompiledFunction:
    """`model` compiled and checked against eager (and, in 16 bits, a float64 copy of it)."""
    with torch.no_grad(), gjit.config.scope(**scope):
        if x.dtype in (torch.float16, torch.bfloat16):
            return check_against_float64(model, x, reference_fn=copy.deepcopy(model).double())[0]
        return check(model, x)


def kernels(cm: gjit.CompiledFunction) -> list:
    return cm.entries[0].program.kernels


def distinct(cm: gjit.CompiledFunction) -> list[str]:
    return [k.name for k in kernels(cm) if k.code_of is None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deeper_stacks_launch_more_kernels_but_build_no_more(dtype):
    x = torch.randn(3, 7, 32, dtype=dtype)
    two, five = compiled(stack(32, 32, dtype=dtype), x), compiled(stack(32, 32, 32, 32, 32, dtype=dtype), x)
    assert len(kernels(five)) > len(kernels(two))
    assert len(distinct(five)) == len(distinct(two)) < len(kernels(two))
    names = {k.name for k in kernels(five)}
    for k in kernels(five):
        if k.code_of is not None:  # an earlier kernel's code, which is its own
            assert (
                k.code_of in names and next(o for o in kernels(five) if o.name == k.code_of).code_of is None
            )


def test_a_later_region_launches_the_first_kernels_function_and_says_so():
    x = torch.randn(4, 32)
    cm = compiled(stack(32, 32, 32), x)
    graph = cm.entries[0].program.graph
    launched = inspect.unwrap(graph.call_fn(interpret=True)).__globals__  # what the wrapper calls
    for k in kernels(cm):
        assert f"    {k.name}[" in graph.wrapper_source  # each region launches under its own name
        if k.code_of is None:
            continue
        assert launched[k.name] is launched[k.code_of], "one function object: one build"
        assert k.source.splitlines()[1] == (
            f"# runs as {k.code_of}: the same code but for its name and comments"
        )
        assert graph.kernel_paths[k.name] == graph.kernel_paths[k.code_of]
    with torch.no_grad():
        report = gjit.explain(cm, x)
    text = str(report)
    assert f"{len(kernels(cm))} kernel(s) ({len(distinct(cm))} distinct)" in text
    assert "(runs as gjit_" in text


def test_layers_that_differ_keep_their_own_kernels():
    x = torch.randn(4, 32)
    # a different width: other constants in the code
    widths = stack(32, 32)
    widths[1] = torch.nn.Sequential(torch.nn.Linear(32, 48), Layer(48), torch.nn.Linear(48, 32))
    cm = compiled(widths.eval(), x)
    assert [k.name for k in kernels(cm) if k.code_of] == [], "no two layers compute alike"

    # the same code over another dtype: another signature
    class Mixed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = Layer(32, torch.float16), Layer(32, torch.bfloat16)

        def forward(self, x):
            return self.b(self.a(x).to(self.b.up.weight.dtype)).to(x.dtype)

    cm = compiled(Mixed().eval(), x.half())
    assert all(k.code_of is None for k in kernels(cm))


def test_layers_with_sizes_of_their_own_share_and_run_at_their_own_sizes():
    class Siamese(torch.nn.Module):  # x and y have rows of their own: size parameters of their own
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(16, 24)

        def forward(self, x, y):
            return torch.relu(self.proj(x)), torch.relu(self.proj(y))

    model, x, y = Siamese().eval(), torch.randn(5, 16), torch.randn(9, 16)
    with torch.no_grad():
        cm = check(model, x, y)
    first, second = kernels(cm)
    assert first.size_args != second.size_args and second.code_of == first.name


def test_the_code_key_ignores_names_and_comments_only():
    x = torch.randn(4, 32)
    cm = compiled(stack(32, 32), x)
    k = next(k for k in kernels(cm) if k.code_of is None and k.name.startswith("gjit_mm_"))
    renamed = dataclasses.replace(k, name="gjit_other_9", source=k.source.replace(k.name, "gjit_other_9"))
    commented = dataclasses.replace(k, source=k.source.replace("\n    acc = ", "\n    # a note\n    acc = "))
    assert code_key(renamed) == code_key(commented) == code_key(k)
    changed = dataclasses.replace(k, source=k.source.replace("tl.float32", "tl.float16", 1))
    wider = dataclasses.replace(k, signature={**k.signature, "in_ptr0": "*fp16"})
    warps = dataclasses.replace(k, num_warps=k.num_warps * 2)
    assert len({code_key(k), code_key(changed), code_key(wider), code_key(warps)}) == 4


def test_cuda_c_kernels_share_too():
    x = torch.randn(4, 32)
    cm = compiled(stack(32, 32, 32), x, backend="cupy")
    assert len(distinct(cm)) < len(kernels(cm))
    k = next(k for k in kernels(cm) if k.code_of is not None)
    assert k.source.splitlines()[1].startswith(f"// runs as {k.code_of}:")
    trailing = dataclasses.replace(k, source=k.source.replace(";\n", "; // note\n", 1))
    assert code_key(trailing) != code_key(k), "only whole-line comments are dropped in CUDA C"


def test_a_warm_start_from_disk_runs_the_shared_kernels(tmp_path):
    x = torch.randn(2, 5, 32)
    model = stack(32, 32, 32)
    cold = compiled(model, x, cache=True, cache_dir=str(tmp_path))
    hits = gjit.stats().get("disk_cache_hits", 0)
    warm = compiled(model, x, cache=True, cache_dir=str(tmp_path))
    assert gjit.stats().get("disk_cache_hits", 0) == hits + 1
    assert [k.code_of for k in kernels(warm)] == [k.code_of for k in kernels(cold)]
    assert any(k.code_of for k in kernels(warm))


@pytest.mark.compile_only
def test_aot_builds_each_distinct_kernel_once(tmp_path):
    x = torch.randn(2, 5, 32)
    cm = compiled(stack(32, 32, 32), x)
    with torch.no_grad():
        report = gjit.aot(cm, x, out_dir=str(tmp_path), workers=1)
    assert [k.name for k in report.kernels] == distinct(cm)
