"""Writes through indices as kernels (scatter, scatter_add, scatter_reduce, index_put and what
decomposes to it: index_add, index_copy, index_fill, put, setitem): a copy of the tensor written
into, then one kernel over the source that stores or combines with atomics. Duplicate indices,
every reduction with and without include_self, NaN/Inf, each atomic dtype and the ones without
atomics (externs), negative and broadcast indices, non-contiguous, empty and 0-d tensors, in place
into a fresh tensor, bounds checks."""

import math

import pytest
import torch

import gjit
from helpers import check, run_compiled

pytestmark = [pytest.mark.cpu]


def scatter_kernels(cm, *args) -> list:
    return [k for k in gjit.explain(cm, *args).kernels if k.name.startswith("gjit_scatter_")]


def unique_index(rows: int, cols: int, size: int) -> torch.Tensor:
    """An index into a dim of `size` with distinct entries down each column (plain scatter's
    result is unspecified for duplicates)."""
    return torch.stack([torch.randperm(size)[:rows] for _ in range(cols)], dim=1)


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_scatter_src_and_value(dim):
    x = torch.randn(6, 5)
    index = unique_index(4, 5, 6) if dim == 0 else unique_index(5, 6, 5).T[:, :4].contiguous()
    src = torch.randn(7, 7)
    cm = check(lambda x, i, s: (x.scatter(dim, i, s), x.scatter(dim, i, -2.5)), x, index, src)
    (kernel,) = scatter_kernels(cm, x, index, src)  # side by side: one kernel writes both copies
    assert kernel.source.count("'s memory: stores at") == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32, torch.int64])
def test_scatter_add_duplicates_every_atomic_dtype(dtype):
    x = (torch.randn(5, 4) * 10).to(dtype)
    index = torch.randint(0, 5, (9, 4))
    src = (torch.randn(9, 4) * 10).to(dtype)
    cm = check(lambda x, i, s: x.scatter_add(0, i, s), x, index, src, kernels=2)
    (kernel,) = scatter_kernels(cm, x, index, src)
    assert "adds (atomic)" in kernel.source  # the header says how it writes


@pytest.mark.parametrize("include_self", [True, False])
@pytest.mark.parametrize("reduce", ["sum", "amax", "amin", "mean"])
def test_scatter_reduce(reduce, include_self):
    x = torch.randn(4, 6)
    index = torch.randint(0, 6, (4, 8))  # duplicates, and elements nothing writes
    src = torch.randn(4, 8)
    check(lambda x, i, s: x.scatter_reduce(1, i, s, reduce, include_self=include_self), x, index, src)


@pytest.mark.parametrize("include_self", [True, False])
@pytest.mark.parametrize("reduce", ["sum", "amax", "amin", "mean"])
def test_scatter_reduce_integers(reduce, include_self):
    x = torch.randint(-20, 20, (4, 6))
    index = torch.randint(0, 6, (4, 8))
    src = torch.randint(-20, 20, (4, 8), dtype=torch.int32).long()
    check(lambda x, i, s: x.scatter_reduce(1, i, s, reduce, include_self=include_self), x, index, src)


@pytest.mark.parametrize("reduce", ["amax", "amin", "sum", "mean"])
def test_scatter_reduce_nan_and_inf_as_eager(reduce):
    nan, inf = math.nan, math.inf
    x = torch.tensor([1.0, 2.0, nan, -inf, 0.0, 3.0])
    index = torch.tensor([0, 0, 1, 1, 3, 3, 4, 4, 5, 1])
    src = torch.tensor([nan, 5.0, -1.0, 2.0, inf, -inf, 1.0, nan, -inf, 0.5])
    check(lambda x, i, s: x.scatter_reduce(0, i, s, reduce), x, index, src)
    check(lambda x, i, s: x.scatter_reduce(0, i, s, reduce, include_self=False), x, index, src)


def test_index_put_accumulate_negative_and_broadcast_indices():
    x = torch.randn(5, 6, 7)
    i = torch.tensor([[0, -1], [2, 2]])  # broadcast against j, negative counts from the end
    j = torch.tensor([1, -2])
    v = torch.randn(2, 2, 7)
    put = lambda x, i, j, v: torch.index_put(x, (i, j), v, accumulate=True)  # noqa: E731
    check(gjit.compile(put, dynamic=False), x, i, j, v, kernels=2)
    # dynamic: export does not relate the sizes of tensors index_put broadcasts (i's s48, j's s7):
    # the kernel assumes them equal, as they are in this call, and the entry guards that; a call
    # where they broadcast otherwise recompiles
    cm = check(put, x, i, j, v, kernels=2)
    assert "index tensors broadcast" in cm.entries[0].guards.format()
    check(cm, x, i + 1, j - 1, v * 2)  # same sizes: the entry serves it
    assert len(cm.entries) == 1
    check(cm, x, torch.tensor([[0, 1, 3]]), torch.tensor([[1], [2], [4]]), torch.randn(3, 3, 7))
    assert len(cm.entries) == 2  # broadcast the other way: a recompile, not a wrong read

    def add_at(x, j):
        y = x * 1
        y[:, j] += 3.0  # index, add, then an index_put_ with a None (full slice) index
        return y

    cm = check(add_at, x, j)
    assert scatter_kernels(cm, x, j)


def test_index_put_non_adjacent_indices_and_store():
    x = torch.randn(4, 5, 6)
    i = torch.tensor([0, 3, 1])
    k = torch.tensor([5, 0, 2])
    v = torch.randn(3, 5)

    def put(x, i, k, v):
        y = x * 1
        y[i, :, k] = v  # non-adjacent indices: the broadcast dim goes first
        return y

    check(gjit.compile(put, dynamic=False), x, i, k, v, kernels=2)


def test_ops_that_decompose_to_index_put():
    x = torch.randn(6, 5)
    index = torch.tensor([4, 0, 4, 2])
    src = torch.randn(4, 5)
    perm = torch.tensor([3, 0, 5, 1])
    fns = {
        "index_add": lambda x, s: x.index_add(0, index, s, alpha=2.0),
        "index_copy": lambda x, s: x.index_copy(0, perm, s),
        "index_fill": lambda x, s: x.index_fill(1, torch.tensor([0, 3]), -1.5),
        "put": lambda x, s: x.put(torch.tensor([0, 29, -1, 29]), s[0, :4], accumulate=True),
    }
    for fn in fns.values():
        cm = check(fn, x, src)
        assert scatter_kernels(cm, x, src), gjit.explain(cm, x, src)
        assert not gjit.explain(cm, x, src).externs


def test_setitem_on_a_fresh_tensor_writes_in_place():
    """y = x * 2; y[idx] = v: the scatter writes into the multiply's output (no copy kernel)."""

    def f(x, idx, v):
        y = x * 2
        y[idx] = v
        return y + 1

    x, idx, v = torch.randn(8, 3), torch.tensor([1, 6, 2]), torch.randn(3, 3)
    cm = check(f, x, idx, v, kernels=3)  # the multiply, the scatter into it, the add
    assert len(scatter_kernels(cm, x, idx, v)) == 1


def test_non_contiguous_empty_and_zero_d():
    x = torch.randn(7, 6).T  # non-contiguous, written into a copy with its strides
    index = torch.randint(0, 6, (4, 7))[:, ::2]
    src = torch.randn(9, 8)[::2, 1:]
    check(lambda x, i, s: x.scatter_add(0, i, s), x, index, src)
    check(lambda x, i, s: x.scatter(0, i[:0], s), x, index, src)  # nothing written: a copy
    z = torch.tensor(2.0)
    check(lambda z, s: z.scatter_add(0, torch.tensor(0), s), z, torch.tensor(5.0))


@pytest.mark.parametrize(
    "fn,reason",
    [
        (lambda x, i, s: x.half().scatter_add(0, i, s.half()), "no torch.float16 atomics"),
        (lambda x, i, s: x.scatter_reduce(0, i, s, "prod"), "'prod'"),
    ],
)
def test_combines_without_atomics_stay_externs(fn, reason):
    x, index, src = torch.randn(5, 4), torch.randint(0, 5, (6, 4)), torch.randn(6, 4)
    cm = check(fn, x, index, src)
    externs = gjit.explain(cm, x, index, src).externs
    assert any(reason in e.reason for e in externs), externs


def test_plain_stores_work_for_every_dtype():
    x = torch.rand(5, 4) > 0.5
    index = unique_index(3, 4, 5)
    cm = check(lambda x, i: x.scatter(0, i, True), x, index)
    assert scatter_kernels(cm, x, index)
    h = torch.randn(5, 4).half()
    check(lambda h, i: h.scatter(0, i, h[:3] * 2), h, index)


def test_out_of_bounds_index_is_an_error_in_debug_mode():
    x, src = torch.randn(5, 4), torch.randn(2, 4)
    index = torch.tensor([[0, 1, 2, 3], [4, 5, 0, 1]])  # 5 is out of bounds
    with pytest.raises(Exception, match="index out of bounds writing"):
        run_compiled(lambda x, i, s: x.scatter_add(0, i, s), x, index, src)


def test_dynamic_sizes():
    cm = gjit.compile(lambda x, i, s: x.scatter_add(1, i, s) * 2)
    for n, m in ((5, 7), (9, 3)):
        x, index, src = torch.randn(4, n), torch.randint(0, n, (4, m)), torch.randn(4, m)
        check(cm, x, index, src)
    assert len(cm.entries) == 1 if hasattr(cm, "entries") else True


def test_boolean_mask_put_of_one_value_is_a_where():
    """x[mask] = v with one value: no data-dependent size, one pointwise kernel; many values
    (one per masked element) stay an extern."""
    x, mask = torch.randn(4, 5), torch.rand(4, 5) > 0.5
    row = torch.rand(4) > 0.5

    def put(x, mask, row):
        y = torch.index_put(x, (mask,), torch.tensor(-1.0))
        return y, torch.index_put(x, (row,), torch.tensor([2.5]), accumulate=True)

    cm = check(put, x, mask, row, kernels=1)
    assert not gjit.explain(cm, x, mask, row).externs
    many = check(lambda x, m: torch.index_put(x, (m,), x[m] * 2), x, mask)
    assert any("data-dependent" in e.reason for e in gjit.explain(many, x, mask).externs)


def test_index_add_of_a_zero_d_tensor_and_bools():
    z = torch.tensor(1.5)
    check(lambda z: z.index_add(0, torch.tensor([0]), torch.tensor(2.0), alpha=3), z, kernels=2)
    b = torch.rand(5) > 0.5  # no bool atomics: index_add stays an ATen call, computed as eager does
    check(lambda b: b.index_add(0, torch.tensor([1, 1, 3]), torch.tensor([True, False, True])), b)


@pytest.mark.parametrize("reduce", ["amax", "amin"])
def test_nan_already_in_the_tensor_wins_as_in_eager(reduce):
    """Triton's float atomic max/min compare bit patterns: a NaN in memory would lose to numbers.
    x's own NaN (positive, and the negative NaN that 0/0 gives on x86) stays NaN."""
    z = torch.zeros(2)
    x = torch.cat([torch.tensor([math.nan, 2.0, 3.0]), z / z, torch.tensor([-1.0])])
    index = torch.tensor([0, 1, 3, 4, 0, 5])
    src = torch.tensor([1.0, 1.0, 5.0, -5.0, -7.0, math.nan])
    check(lambda x, i, s: x.scatter_reduce(0, i, s, reduce), x, index, src)
    check(lambda x, i, s: x.scatter_reduce(0, i, s, reduce, include_self=False), x, index, src)


def test_masked_put_of_bools_and_uint8_masks_as_eager():
    b, m = torch.tensor([True, False, False]), torch.tensor([True, True, False])
    check(lambda b, m: torch.index_put(b, (m,), torch.tensor(True), accumulate=True), b, m)
    x, u = torch.zeros(4), torch.tensor([1, 0, 1, 1], dtype=torch.uint8)  # uint8 indexes as a mask
    check(lambda x, u: torch.index_put(x, (u,), torch.tensor(5.0), accumulate=True), x, u)


def test_zero_d_target_is_bounds_checked():
    with pytest.raises(Exception, match="index out of bounds writing"):
        run_compiled(
            lambda z, i, s: z.scatter_add(0, i, s), torch.tensor(2.0), torch.tensor(3), torch.tensor(5.0)
        )


def test_deterministic_algorithms_recompile_without_float_atomics():
    """Float atomic sums vary in their last bits: an entry with them is guarded on torch's
    deterministic setting; turned on, the call recompiles and the sum is an extern."""
    cm = gjit.compile(lambda x, i, s: x.scatter_add(0, i, s))
    args = (torch.randn(5), torch.tensor([0, 0, 3]), torch.randn(3))
    check(cm, *args)
    assert "deterministic algorithms off" in cm.entries[0].guards.format()
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        check(cm, *args)
        assert len(cm.entries) == 2
        assert "deterministic" in gjit.explain(cm, *args).externs[0].reason
    finally:
        torch.use_deterministic_algorithms(before)


def test_gjit_check_replays_in_place_writes_on_copies(monkeypatch):
    """GJIT_CHECK recomputes y[i] = v.sin() on a copy of y: a planted bug in the scatter kernel is
    caught (replayed in place, the kernel's own buffer would be compared with itself)."""
    from gjit.codegen.triton.pointwise import TritonOverrides

    def f(x, i, v):
        y = x * 2
        y[i] = v.sin()
        return y

    x, i, v = torch.randn(4, 2), torch.tensor([1, 3]), torch.randn(2, 2)
    cm = gjit.compile(f, check=True)
    run_compiled(cm, x, i, v)
    rows = cm.entries[0].program.graph.last_check
    assert rows and all(r.ok for r in rows), rows
    monkeypatch.setitem(TritonOverrides, "sin", lambda a, t: f"tl.cos({a})")
    with gjit.config.scope(cache=False):
        cm = gjit.compile(f, check=True)
        run_compiled(cm, x, i, v)
    bad = [r for r in cm.entries[0].program.graph.last_check if not r.ok]
    assert [r.kernel.split("_")[1] for r in bad] == ["scatter"], bad


def test_a_one_element_index_writes_through_a_block_pointer():
    """An index of one element: the write's offset is one loaded (scalar) index, broadcast to the
    block (a fuzz find: Triton refused a block value through a scalar pointer)."""
    x, index = torch.randn(3), torch.tensor([1])
    check(lambda x, i: x.scatter_add(0, i, torch.gather(x, 0, i) * 1.5), x, index, kernels=2)
    check(lambda x, i: x.index_put((i,), torch.tensor(2.0), accumulate=True), x, index)


def test_the_deterministic_guard_covers_cond_branches_and_explain_either_way():
    def f(x, i, s):
        return torch.cond(s.sum() > 0, lambda x, i, s: x.index_add(0, i, s), lambda x, i, s: x + 1, (x, i, s))

    args = (torch.zeros(5), torch.tensor([0, 1, 1, 3]), torch.ones(4))
    cm = gjit.compile(f)
    check(cm, *args)
    assert "deterministic algorithms off" in cm.entries[0].guards.format()  # a branch's atomics
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        check(cm, *args)
        assert len(cm.entries) == 2
    finally:
        torch.use_deterministic_algorithms(before)
    # an entry compiled under the setting also serves calls without it; explain re-lowers it as it was
    g = gjit.compile(lambda x, i, s: x.index_add(0, i, s))
    torch.use_deterministic_algorithms(True)
    try:
        check(g, *args)
    finally:
        torch.use_deterministic_algorithms(before)
    check(g, *args)
    assert len(g.entries) == 1 and "deterministic" in gjit.explain(g, *args).externs[0].reason


def test_data_dependent_index_sizes_are_an_extern_that_says_so():
    def f(x, m, r):
        i = m.nonzero().squeeze(1)  # two data-dependent counts, nothing relates them
        j = (r > 0).nonzero().squeeze(1)
        return torch.index_put(x, (i, j), torch.ones(()), accumulate=True)

    m = torch.tensor([1, 0, 1, 1, 0, 1], dtype=torch.bool)
    args = (torch.zeros(6, 6), m, torch.tensor([1.0, -1, 2, 3, -2, 1]))
    cm = check(f, *args)
    reasons = [e.reason for e in gjit.explain(cm, *args).externs if e.op == "aten.index_put.default"]
    assert reasons and "data-dependent sizes" in reasons[0], reasons


# -- a static KV cache's write, into the caller's tensors ------------------------------------------


def _decode_step(q, k, v, keys, values, length):
    """A static cache's decode step, as transformers' StaticCache writes it: the position the
    counter holds, the counter advanced, the new keys and values written at the position, then
    attention over the cache (an SDPA call with no dropout draws nothing)."""
    position = length + torch.arange(k.shape[2])
    length.add_(k.shape[2])
    keys.index_copy_(2, position, k)
    values.index_copy_(2, position, v)
    return torch.nn.functional.scaled_dot_product_attention(q, keys, values)


@pytest.mark.parametrize("layout", ["contiguous", "heads_last"])
def test_a_static_cache_is_written_by_a_kernel_in_the_callers_memory(layout):
    """index_copy_ into the caller's cache buffers: a kernel stores the new rows into the inputs
    themselves (no ATen call, no copy of the cache, none back), before the kernel that advances the
    counter, which then stores into the counter in place. Three steps against eager's."""
    torch.manual_seed(0)
    shape = (2, 3, 10, 8)
    if layout == "contiguous":
        caches = [torch.randn(shape) for _ in range(4)]
    else:  # the buffers' memory in another order
        caches = [torch.randn(2, 10, 8, 3).permute(0, 3, 1, 2) for _ in range(4)]
    mine, eager = caches[:2], [c.clone() for c in caches[:2]]
    mine_length, eager_length = torch.tensor([4]), torch.tensor([4])
    cm = gjit.compile(_decode_step)
    for step in range(3):
        q, k, v = (torch.randn(2, 3, 1, 8) for _ in range(3))
        want = _decode_step(q, k, v, *eager, eager_length)
        got, cm = run_compiled(cm, q, k, v, *mine, mine_length)
        torch.testing.assert_close(got, want)
        for a, b in zip(mine, eager):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert mine_length.item() == eager_length.item() == 5 + step
    assert len(cm.entries) == 1
    if layout == "heads_last":  # export copies the written cache into its strides: not in place
        return
    wrapper = open(cm.entries[0].program.graph.wrapper_path).read()
    assert "index_put = keys\n" in wrapper and "index_put_1 = values\n" in wrapper, wrapper
    assert "aten.index_put" not in wrapper and "copy_" not in wrapper, wrapper
    counter = wrapper.index("= length  # stored into the input it updates")
    assert wrapper.index("index_put_1 = values") < counter, wrapper
    (kernel,) = scatter_kernels(cm, q, k, v, *mine, mine_length)  # the keys and values: one kernel
    assert kernel.source.count("'s memory: stores at") == 2, kernel.source


def test_a_static_cache_written_in_place_with_a_dynamic_length():
    """The same write with the new tokens' count and the batch dynamic: one entry for both calls."""
    torch.manual_seed(1)
    cm = gjit.compile(_decode_step, dynamic=True)
    for batch, new in ((2, 3), (3, 2)):
        caches = [torch.randn(batch, 2, 9, 4) for _ in range(2)]
        mine, eager = caches, [c.clone() for c in caches]
        mine_length, eager_length = torch.tensor([1]), torch.tensor([1])
        q, k, v = (torch.randn(batch, 2, new, 4) for _ in range(3))
        want = _decode_step(q, k, v, *eager, eager_length)
        got, cm = run_compiled(cm, q, k, v, *mine, mine_length)
        torch.testing.assert_close(got, want)
        for a, b in zip(mine, eager):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert mine_length.item() == eager_length.item()
    assert len(cm.entries) == 1


def _set_rows(x, i, v):
    x[i] = v
    return x * 2


@pytest.mark.parametrize("view", ["transposed", "sliced"])
def test_a_write_into_a_strided_input_as_eager(view):
    """x[i] = v into the caller's x, then read: in place by a kernel where the write's result is
    laid out as x is (transposed: dense); where it is not (a slice with an offset, whose result
    export traces contiguous) into a copy written back after the call. The slice's write ran in
    place in ATen and its kernel read x's memory in the traced layout: wrong values."""
    x = torch.randn(6, 5).T if view == "transposed" else torch.randn(4, 6, 5)[:, ::2, 1:]
    i, v = torch.tensor([2, 0]), torch.randn(2, *x.shape[1:])
    x_eager = x.clone()
    want = _set_rows(x_eager, i, v)
    got, cm = run_compiled(_set_rows, x, i, v)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(x, x_eager, rtol=0, atol=0)
    wrapper = open(cm.entries[0].program.graph.wrapper_path).read()
    assert ("index_put = x\n" in wrapper) == (view == "transposed"), wrapper
    assert "aten.index_put" not in wrapper, wrapper


def _two_writes(x, y, i, v, w):
    a, b = x * 2, y + 1
    a[i] = v
    b[i] = w
    return a, b


def _second_reads_first(x, y, i, v):
    a, b = x * 2, y + 1
    a[i] = v
    b[i] = a[i + 1]  # reads memory the first writes
    return a, b


def _same_memory(x, i, j, v, w):
    a = x * 2
    a[i] = v
    a[j] = w  # into what the first wrote
    return a


def test_writes_through_indices_side_by_side_share_a_kernel():
    """Two writes over the same elements into memory of their own are one kernel (each program
    stores its elements of both); one that reads what the other writes, or writes the same
    memory, stays a kernel of its own. Static sizes: the values' sizes, dynamic, are not known equal."""
    x, y, v, w = torch.randn(7, 5), torch.randn(7, 5), torch.randn(3, 5), torch.randn(3, 5)
    i, j = torch.tensor([4, 0, 2]), torch.tensor([1, 4, 6])
    cm = check(gjit.compile(_two_writes, dynamic=False), x, y, i, v, w)
    (kernel,) = scatter_kernels(cm, x, y, i, v, w)
    assert "writes into mul's memory" in kernel.source
    assert "writes into add's memory" in kernel.source
    cm = check(gjit.compile(_second_reads_first, dynamic=False), x, y, i, v)
    assert len(scatter_kernels(cm, x, y, i, v)) == 2
    cm = check(gjit.compile(_same_memory, dynamic=False), x, i, j, v, w)
    assert len(scatter_kernels(cm, x, i, j, v, w)) == 2


def _cache_step(k, keys, length):
    position = length + torch.arange(k.shape[0])
    keys.index_copy_(0, position, k)
    length.add_(k.shape[0])
    return keys.sum(0)


def test_a_write_past_the_callers_cache_fails_as_in_eager():
    """The kernel writing into the caller's tensor asserts its indices, out of debug mode too:
    a full cache fails, as eager's index_copy_ raises, rather than stay as it was."""
    cm = gjit.compile(_cache_step)
    keys, length = torch.zeros(4, 3), torch.tensor([2])
    with gjit.config.scope(interpret=True, debug=False):
        for step in range(2):
            cm(torch.full((1, 3), step + 1.0), keys, length)
        assert keys[:, 0].tolist() == [0.0, 0.0, 1.0, 2.0] and length.item() == 4
        with pytest.raises(Exception, match="index out of bounds"):
            cm(torch.full((1, 3), 3.0), keys, length)
    (kernel,) = scatter_kernels(cm, torch.ones(1, 3), torch.zeros(4, 3), torch.tensor([0]))
    assert ("GJIT_ASSERT(" if gjit.config.backend == "cupy" else "tl.device_assert(") in kernel.source


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.zeros(1, 5).expand(6, 5),
        lambda: torch.zeros(6, 1).expand(6, 5),
        lambda: torch.arange(20.0).as_strided((6, 5), (2, 1)),  # rows overlap
    ],
    ids=["expanded_rows", "expanded_columns", "overlapping_rows"],
)
def test_a_write_into_an_input_whose_elements_share_memory_runs_eagerly(make):
    """Kernels write each element on its own: into an input whose elements share memory, the
    program runs eagerly, saying why (its kernels read the write's result in another layout, and
    the write back into such memory failed or overwrote eager's values)."""
    x, i, v = make(), torch.tensor([2, 0]), -torch.ones(2, 5)
    x_eager = torch.empty(0).set_(x.untyped_storage().clone(), 0, x.shape, x.stride())
    want = _set_rows(x_eager, i, v)
    got, cm = run_compiled(_set_rows, x, i, v, expect_eager=True)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert x.untyped_storage().tolist() == x_eager.untyped_storage().tolist()
    assert "whose elements share memory" in cm.eager_reason


def _normal_between(n):
    old = n * 1  # reads n's old value, in the kernel with `old + b`
    n.normal_()  # n's new value: a random op, written back into n
    return old + torch.randn(4)


def test_a_value_written_back_never_moves_a_random_draw():
    """The schedule that runs an input's new value after its readers leaves a program with random
    ops in program order: the same draws as eager's for the same seed."""
    torch.manual_seed(0)
    n_eager = torch.zeros(4)
    want = _normal_between(n_eager)
    cm = gjit.compile(_normal_between)
    run_compiled(cm, torch.zeros(4))
    torch.manual_seed(0)
    n_gjit = torch.zeros(4)
    got, _ = run_compiled(cm, n_gjit)
    assert torch.equal(got, want) and torch.equal(n_gjit, n_eager)


def _draws_in_branches(n, y, p):
    old = n * 2
    n.add_(1)  # n's new value; `old` is read after the first branch, which needs the new n
    a = torch.cond(p, lambda m: m.expand(4, 3) + torch.randn(4, 3), lambda m: m - torch.randn(4, 3), (n,))
    b = torch.cond(p, lambda y: y * torch.randn(3), lambda y: y / torch.randn(3), (y,))
    return b, old[None] * a


def test_random_draws_in_branches_stay_in_program_order():
    """A random op inside a torch.cond branch keeps the program's order too (the second branch
    drew first: the counter's kernel waited for a reader that needs it)."""
    make = lambda: (torch.arange(3.0), torch.ones(3), torch.tensor(True))  # noqa: E731
    torch.manual_seed(0)
    want = _draws_in_branches(*make())
    torch.manual_seed(0)
    got, _ = run_compiled(_draws_in_branches, *make())
    assert all(torch.equal(g, w) for g, w in zip(got, want))


class _HeldMask(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("mask", torch.ones(32, 32, dtype=torch.bool).tril())
        self.qkv = torch.nn.Linear(16, 48)

    def forward(self, x):
        b, t, w = x.shape
        q, k, v = (y.view(b, t, 2, -1).transpose(1, 2) for y in self.qkv(x).split(w, -1))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=self.mask[:t, :t])


class _MaskEditor(torch.nn.Module):
    def __init__(self, owner):
        super().__init__()
        self.owner = owner

    def forward(self, rows, value):
        self.owner.mask[rows] = value  # a kernel writes the other module's buffer
        return rows + 1


def test_a_kernels_write_into_an_input_moves_its_version():
    """A write into the caller's tensor by a kernel moves the tensor's version, as eager's write
    does: a held mask's proof (is_causal, checked by version) sees the edit and compiles anew."""
    torch.manual_seed(0)
    model = _HeldMask().requires_grad_(False)
    forward, edit = gjit.compile(model), gjit.compile(_MaskEditor(model))
    x = torch.randn(3, 7, 16)
    with torch.no_grad():
        run_compiled(forward, x)
        before = model.mask._version
        run_compiled(edit, torch.tensor([5]), torch.ones(1, 32, dtype=torch.bool))  # row 5 sees every key
        assert model.mask._version > before
        got, _ = run_compiled(forward, x)
        torch.testing.assert_close(got, model(x))
    assert len(forward.entries) == 2


def test_a_dynamic_stride_written_into_is_guarded_apart():
    """With its row stride a symbol, an entry that writes x guards that x's rows stay apart: a
    call whose rows overlap runs eagerly (it was written through the entry and corrupted x)."""
    cm = gjit.compile(_set_rows, dynamic=True)
    i, v = torch.tensor([2, 0]), -torch.ones(2, 5)
    run_compiled(cm, torch.arange(60.0).view(6, 10)[:, :5], i, v)
    x = torch.arange(30.0).as_strided((6, 5), (3, 1))  # rows overlap
    x_eager = torch.arange(30.0).as_strided((6, 5), (3, 1))
    want = _set_rows(x_eager, i, v)
    got, _ = run_compiled(cm, x, i, v, expect_eager=None)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert x.untyped_storage().tolist() == x_eager.untyped_storage().tolist()
