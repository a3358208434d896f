"""An SDPA call whose output layout the compile chooses (gjit/lowering/attention_layout.py) takes the
one ATen's kernel returns, where the program only permutes the output: the wrapper's copy into the
traced layout and the program's clone back out of it are gone, and the results are eager's.

On a GPU export traces a masked call in the math path's contiguous layout; here export runs under
`sdpa_kernel(MATH)` for the same trace, and the calls after it run this CPU's flash kernel, which
returns the query's order ([B, L, H, E] in memory for a head split of a linear layer's output)."""

import copy
import re

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.attention import SDPBackend, sdpa_kernel

import gjit
from gjit.lowering.attention_layout import HEADS_INSIDE, returned_order
from helpers import assert_same, run_compiled

pytestmark = [pytest.mark.cpu]
SDPA = torch.ops.aten.scaled_dot_product_attention.default


def causal(length):
    """A causal mask built in the program, which gjit/lowering/proved_masks.py drops."""
    i = torch.arange(length)
    return i[None, :] <= i[:, None]


def out_transposed(o, b, s, w):
    return o.transpose(1, 2).reshape(b, s, w)


def out_contiguous(o, b, s, w):
    return o.transpose(1, 2).contiguous().view(b, s, w)


def out_added(o, b, s, w):  # a kernel reads the permuted output (and writes what the reshape reads)
    return (o.transpose(1, 2) * 2.0).reshape(b, s, w)


def out_heads_merged(o, b, s, w):  # a view that needs the traced layout ([B, H, L, E] contiguous)
    return o.reshape(-1, s, w // 2).transpose(0, 1).reshape(s, b, w).transpose(0, 1)


class Attention(torch.nn.Module):
    """One head-split attention layer as transformers writes it, its output read by `out`."""

    def __init__(self, out, width=32, heads=2, returns_attention=False):
        super().__init__()
        self.out_fn, self.heads, self.returns_attention = out, heads, returns_attention
        self.qkv, self.out = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)

    def forward(self, x):
        b, s, w = x.shape
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in self.qkv(x).split(w, -1))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=causal(s))
        y = self.out(self.out_fn(o, b, s, w))
        return (y, o) if self.returns_attention else y


def compiled_as_on_a_gpu(model, *args):
    """`model` compiled on a trace of the math path's layout, as on a GPU for a masked call: its
    first call (under sdpa_kernel(MATH)) compiles, and a call after it runs ATen's own choice."""
    cm = gjit.compile(model)
    with sdpa_kernel(SDPBackend.MATH):
        run_compiled(cm, *args)
    out, _ = run_compiled(cm, *args)
    return cm, out


def check(model, *args, matmul="auto"):
    """The wrapper's source of `model` compiled as on a GPU (`compiled_as_on_a_gpu`; the library's
    products and SDPA call, or under matmul="template" gjit's templates), its results checked."""
    model.requires_grad_(False)
    expected = model(*args)
    reference = copy.deepcopy(model).double()(*(a.double() for a in args))
    with gjit.config.scope(matmul=matmul):
        cm, out = compiled_as_on_a_gpu(model, *args)
    for a, e, r in zip(*(t if isinstance(t, tuple) else (t,) for t in (out, expected, reference))):
        assert_same(a, e, r)
    return cm.entries[-1].program.graph.wrapper_source


def written_out_strides(source):
    lines = [line for line in source.splitlines() if "gjit_written_out(" in line]
    assert len(lines) == 1, source
    return lines[0].split("scaled_dot_product_attention, (")[1].split(",)")[0]


@pytest.mark.parametrize("out", [out_transposed, out_contiguous], ids=["reshape", "contiguous"])
def test_the_output_takes_the_kernels_layout_and_the_copies_go(out):
    """The traced [B, H, L, E] contiguous: the wrapper would copy the flash kernel's [B, L, H, E]
    into it and a clone kernel copy it back for the reshape. Now neither runs."""
    torch.manual_seed(0)
    source = check(Attention(out), torch.randn(3, 7, 32))
    assert written_out_strides(source) == "32 * s27, 16, 32, 1", source
    assert "gjit_alloc" not in source and "[(" not in source, source  # no buffer, no kernel
    q = torch.randn(3, 7, 2, 16).transpose(1, 2)
    assert SDPA(q, q, q).stride() == (224, 16, 32, 1)  # what this CPU's kernel returns


def test_the_attention_template_writes_the_kernels_layout():
    """The template, where it takes the call, writes the layout chosen for it: the clone is gone too."""
    torch.manual_seed(0)
    source = check(Attention(out_transposed), torch.randn(3, 7, 32), matmul="template")
    assert (
        "scaled_dot_product_attention = gjit_alloc_poisoned((s77, 2, s27, 16), (32 * s27, 16, 32, 1)"
        in source
    )
    assert [line for line in source.splitlines() if "[(" in line and "gjit_attn_" in line], source
    assert "clone" not in source, source


def test_an_op_reading_the_permuted_output_keeps_the_traced_layout():
    """An op other than a clone lays out its output by its input's in eager (and in the fallback
    interpreter, which runs ATen): its traced value holds the traced layout, so the call keeps it."""
    torch.manual_seed(0)
    source = check(Attention(out_added), torch.randn(3, 7, 32))
    assert written_out_strides(source) == "32 * s27, 16 * s27, 16, 1", source


def sorted_rows(o, b, s, w):  # an extern (ATen's sort) and a kernel after it
    return out_transposed(o, b, s, w) + torch.sort(o, -1)[0].transpose(1, 2).reshape(b, s, w) * 2


@pytest.mark.parametrize(
    "model",
    [
        Attention(out_heads_merged),
        Attention(out_transposed, returns_attention=True),
        Attention(sorted_rows),
    ],
    ids=["a view of another kind", "returned", "an extern reads it"],
)
def test_an_output_viewed_otherwise_or_returned_keeps_the_traced_layout(model):
    """A view other than a permute needs the traced layout (export checked it may view it so); the
    program's output keeps eager's strides."""
    torch.manual_seed(0)
    source = check(model, torch.randn(3, 7, 32))
    assert written_out_strides(source) == "32 * s27, 16 * s27, 16, 1", source


def test_written_out_attention_as_one_sdpa_call_takes_the_kernels_layout(monkeypatch):
    """A written-out attention (its value the last product's, contiguous) made one SDPA call, as on
    a GPU: its output in [B, L, H, E], the clone of the transpose gone."""
    monkeypatch.setattr(gjit.driver, "attention_as_sdpa", lambda gm: True)

    class Written(torch.nn.Module):
        def forward(self, q, k, v):
            o = torch.matmul(torch.matmul(q, k.mT).mul(0.25).softmax(-1), v)
            return o.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1) + 1.0

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 7, 3, 16).transpose(1, 2) for _ in "qkv")
    source = check(Written(), q, k, v)
    assert written_out_strides(source) == "s0 * s25 * s3, s3, s25 * s3, 1", source  # [B, L, H, E]
    assert "clone" not in source and "[(" in source, source  # the add's kernel alone


def test_two_contiguous_copies_returned_stay_two_tensors():
    """Clones the program returns stay copies: two outputs must not be one tensor."""

    class Twice(Attention):
        def forward(self, x):
            b, s, w = x.shape
            q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in self.qkv(x).split(w, -1))
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=causal(s))
            return o.transpose(1, 2).contiguous(), o.transpose(1, 2).contiguous()

    torch.manual_seed(0)
    model, x = Twice(out_transposed), torch.randn(3, 7, 32)
    check(model, x)
    cm = gjit.compile(model)
    with sdpa_kernel(SDPBackend.MATH):
        run_compiled(cm, x)
    for interpret in (True, False):
        with gjit.config.scope(interpret=interpret):
            a, b = cm(x)
        assert a.data_ptr() != b.data_ptr()


def test_the_value_head_dim_of_its_own_takes_the_math_paths_layout_on_the_cpu():
    """On the CPU a value head dim other than the query's runs the math path ([B, H, L, Ev]
    contiguous): no layout is guessed for it, and a view the trace allowed holds (the fallback
    interpreter runs it as eager does)."""

    def attention(q, k, v):
        o = F.scaled_dot_product_attention(q, k, v)
        b, h, length, e = o.shape
        return o.transpose(1, 2).reshape(b, length, h * e), (o * 2).view(b, -1)

    torch.manual_seed(0)
    q, k = (torch.randn(3, 7, 2, 16).transpose(1, 2) for _ in "qk")
    v = torch.randn(3, 7, 2, 8).transpose(1, 2)
    expected = attention(q, k, v)
    for interpret in (True, False):
        cm = gjit.compile(attention)
        with gjit.config.scope(interpret=interpret):
            got = cm(q, k, v)
        for a, e in zip(got, expected):
            assert_same(a, e)


def test_grouped_heads_past_a_grid_dim_run_in_parts_of_whole_groups():
    """A call of the program's own with enable_gqa and more query heads than a grid dim takes runs in
    parts: each with its groups' keys and values."""

    def attention(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True) * 1.0

    torch.manual_seed(0)
    q, k, v = torch.randn(1, 3 * 65536, 1, 4), torch.randn(1, 3, 2, 4), torch.randn(1, 3, 2, 4)
    expected = attention(q, k, v)
    for interpret in (True, False):
        cm = gjit.compile(attention)
        with gjit.config.scope(interpret=interpret, matmul="auto"):  # (ATen's call, not the template)
            assert_same(cm(q, k, v), expected)


def test_a_kernel_that_returns_another_layout_is_copied_into_the_chosen_one(request):
    """The guess is the kernel's usual layout; a kernel that returns another (here ATen's SDPA made
    to return [B, H, L, E] contiguous) is copied into the chosen one, and the results hold."""
    torch.manual_seed(0)
    model = Attention(out_transposed).requires_grad_(False)
    x = torch.randn(3, 7, 32)
    expected, reference = model(x), copy.deepcopy(model).double()(x.double())
    with gjit.config.scope(matmul="auto"):
        cm, _ = compiled_as_on_a_gpu(model, x)
    request.getfixturevalue("contiguous_output")  # (its math call takes no boolean mask: eager's is above)
    q = torch.randn(3, 7, 2, 16).transpose(1, 2)
    assert SDPA(q, q, q).is_contiguous()
    for interpret in (True, False):  # the kernels, the eager fallback interpreter
        with gjit.config.scope(interpret=interpret):
            eager_before = gjit.stats()["eager_runs"]
            got = cm(x)
            assert gjit.stats()["eager_runs"] == eager_before
        assert_same(got, expected, reference)


def _sdpa_node(device, q_layout, **kwargs):
    """An SDPA node over fake [2, 4, 8, 64] operands on `device`, the query laid out by `q_layout`."""
    graph = torch.fx.Graph()
    with FakeTensorMode():
        q = q_layout(device)
        k = v = torch.empty(2, 4, 8, 64, dtype=torch.float16, device=device)
        nodes = []
        for name, val in (("q", q), ("k", k), ("v", v)):
            nodes.append(graph.placeholder(name))
            nodes[-1].meta["val"] = val
        call = graph.call_function(SDPA, tuple(nodes), kwargs)
        call.meta["val"] = torch.empty(2, 4, 8, 64, dtype=torch.float16, device=device)
    return call


def heads_inside(device):  # a linear layer's output split into heads
    return torch.empty(2, 8, 4, 64, dtype=torch.float16, device=device).transpose(1, 2)


def contiguous(device):  # e.g. after a kernel that wrote [B, H, L, E]
    return torch.empty(2, 4, 8, 64, dtype=torch.float16, device=device)


def sliced(device):  # a slice of a fused qkv product: not dense
    return torch.empty_strided((2, 4, 8, 64), (6144, 64, 768, 1), dtype=torch.float16, device=device)


@pytest.mark.parametrize(
    "device, q_layout, kwargs, flash, order",
    [
        ("cuda", heads_inside, {}, True, HEADS_INSIDE),
        ("cuda", contiguous, {}, True, (0, 1, 2, 3)),  # FlashAttention follows the query
        ("cuda", sliced, {}, True, HEADS_INSIDE),
        ("cuda", contiguous, {}, False, HEADS_INSIDE),  # before sm_80: the memory-efficient kernel
        ("cuda", contiguous, {"dropout_p": 0.1}, True, HEADS_INSIDE),
        ("cpu", contiguous, {}, True, (0, 1, 2, 3)),
        ("cpu", heads_inside, {}, False, HEADS_INSIDE),
    ],
)
def test_the_order_follows_the_kernel_aten_picks(device, q_layout, kwargs, flash, order):
    assert returned_order(_sdpa_node(device, q_layout, **kwargs), flash) == order


def padded(length, batch=3):
    """A padding mask from an input (kept: no proof): the last sequence's last two keys hidden."""
    keep = torch.ones(batch, 1, 1, length, dtype=torch.bool)
    keep[-1, ..., -2:] = False
    return keep


class PaddedAttention(Attention):
    def forward(self, x, keep):
        b, s, w = x.shape
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in self.qkv(x).split(w, -1))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return self.out(self.out_fn(o, b, s, w))


def test_a_call_that_keeps_its_mask_is_laid_out_so_too():
    """A call with its mask (here a padding mask, an input) is the program's own: ATen's values
    (not the written-out form's NaN rows), in the layout chosen for it. Before, its output was read
    in the traced layout whatever ATen returned: wrong values where the two differed."""
    torch.manual_seed(0)
    source = check(PaddedAttention(out_transposed), torch.randn(3, 7, 32), padded(7))
    assert written_out_strides(source) == "32 * s27, 16, 32, 1", source
    assert "attn_mask=keep" in source and "dead=None" in source, source
    assert "gjit_alloc" not in source, source


def pure_copies_of_attention(source):
    """Kernel launches that only copy an SDPA call's output (a clone kernel reading it)."""
    copy, reads = re.compile(r"gjit_poi_fused_clone_\d+\["), "(scaled_dot_product_attention"
    return [line for line in source.splitlines() if copy.search(line) and reads in line]


SLOW = pytest.mark.slow  # (CI's sweep step)


MODELS = ["gpt2-sdpa", "bert-eager", *(pytest.param(n, marks=SLOW) for n in ("bert-sdpa", "llama-sdpa"))]


@pytest.mark.parametrize("name", MODELS)
def test_transformers_models_traced_as_on_a_gpu_copy_no_attention_output(name, monkeypatch):
    """transformers' models (their eager attention as the SDPA call a GPU makes of it): no kernel
    copies an attention's output, and the outputs are eager's."""
    pytest.importorskip("transformers")
    import model_zoo

    monkeypatch.setattr(gjit.driver, "attention_as_sdpa", lambda gm: True)
    torch.manual_seed(0)
    model, args = model_zoo.MODELS[name]()
    model.requires_grad_(False)
    expected = model(*args)
    with gjit.config.scope(matmul="auto"):
        cm, out = compiled_as_on_a_gpu(model, *args)
    key = "logits" if hasattr(expected, "logits") else "last_hidden_state"
    assert_same(out[key], expected[key])
    source = cm.entries[-1].program.graph.wrapper_source
    assert source.count("gjit_written_out(") == 2, source  # two layers
    assert not pure_copies_of_attention(source), source


@pytest.mark.parametrize("written", [False, True], ids=["read", "written in place"])
def test_a_clone_an_op_writes_in_place_stays_a_copy(written):
    """A clone the program writes in place (an in-place op gjit's capture keeps) is not the call's
    output: the copy stays."""
    from gjit.capture.decompose import decompose_program
    from gjit.lowering.attention_layout import attention_layouts
    from gjit.lowering.proved_masks import proved_masks

    model, x = Attention(out_transposed).requires_grad_(False), torch.randn(3, 7, 32)
    with sdpa_kernel(SDPBackend.MATH):
        gm = decompose_program(torch.export.export(model, (x,)))[0].module()
    proved_masks(gm)
    (clone,) = [n for n in gm.graph.nodes if n.target is torch.ops.aten.clone.default]
    if written:
        with gm.graph.inserting_after(clone):
            add = gm.graph.call_function(torch.ops.aten.add_.Tensor, (clone, 1.0))
            add.meta["val"] = clone.meta["val"]
    assert attention_layouts(gm, True) == 1
    clones = [n for n in gm.graph.nodes if n.target is torch.ops.aten.clone.default]
    assert len(clones) == written, gm.graph
