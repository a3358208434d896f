"""Written-out attention whose score is only scaled runs as ATen's scaled_dot_product_attention on a
GPU (gjit/lowering/attention_library.py): the pass on exported graphs, and the compile with it."""

import math

import pytest
import torch
import torch.nn.functional as F

import gjit
import gjit.driver
from gjit.lowering.attention_library import written_out_as_sdpa
from helpers import assert_same, check_against_float64, run_compiled, upcast

pytestmark = [pytest.mark.cpu]
aten = torch.ops.aten


def vit(q, k, v):
    """timm's ViT without its fused attention: a scale, a softmax, no mask."""
    return ((q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)).softmax(-1) @ v


def hf_eager(q, k, v):
    """transformers' eager_attention_forward without a mask: the softmax in float32, then cast."""
    scores = torch.matmul(q, k.transpose(2, 3)) * 0.125
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v).transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)


def per_head_3d(q, k, v):
    """nn.MultiheadAttention's way: batch and heads in one dim, torch.bmm, a division."""
    return torch.bmm(torch.softmax(torch.bmm(q, k.transpose(1, 2)) / math.sqrt(16.0), dim=-1), v)


def grouped(q, k, v):
    """Two query heads per key/value head, repeated as transformers' repeat_kv does."""
    b, h, s, d = k.shape
    k, v = (x[:, :, None].expand(b, h, 2, s, d).reshape(b, 2 * h, s, d) for x in (k, v))
    return torch.matmul(torch.matmul(q, k.mT).mul(0.3).softmax(-1), v)


def transposed_heads(q, k, v):
    """Heads transposed out of [B, S, H, D] and back."""
    b, s, h, d = q.shape
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    return torch.matmul(torch.matmul(q, k.mT).div(2.0).softmax(-1), v).transpose(1, 2).reshape(b, s, h * d)


MATCHED = {
    "vit": (vit, (2, 3, 17, 16), 1.0),  # the queries scaled before the product: the score is not
    "hf_eager": (hf_eager, (2, 4, 9, 32), 0.125),
    "per_head_3d": (per_head_3d, (6, 11, 8), 0.25),
    "grouped": (grouped, None, 0.3),
    "transposed_heads": (transposed_heads, (2, 9, 3, 16), 0.5),
}


def inputs(case, dtype):
    fn, shape, _ = MATCHED[case]
    torch.manual_seed(0)
    if shape is None:  # grouped: 4 query heads, 2 key/value heads
        return torch.randn(1, 4, 7, 16, dtype=dtype), *(torch.randn(1, 2, 7, 16, dtype=dtype) for _ in "kv")
    return tuple(torch.randn(*shape, dtype=dtype) for _ in "qkv")


def exported(fn, args):
    class Module(torch.nn.Module):
        def forward(self, *a):
            return fn(*a)

    dims = tuple({0: torch.export.Dim.AUTO} for _ in args)
    return torch.export.export(Module(), args, dynamic_shapes=(dims,)).run_decompositions().graph_module


def targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(MATCHED))
def test_a_score_only_scaled_becomes_one_sdpa_call(case, dtype):
    fn, _, scale = MATCHED[case]
    args = inputs(case, dtype)
    gm = exported(fn, args)
    expected = gm(*args)[0]
    assert written_out_as_sdpa(gm) == 1
    ops = targets(gm)
    assert aten.bmm.default not in ops and aten._softmax.default not in ops, gm.graph
    (sdpa,) = [n for n in gm.graph.nodes if n.target is aten.scaled_dot_product_attention.default]
    assert sdpa.kwargs["scale"] == pytest.approx(scale)
    got = gm(*args)[0]
    assert_same(got, expected, fn(*upcast(args)))
    assert written_out_as_sdpa(gm) == 0  # nothing left to replace


def masked_in_float16(q, k, v, m):
    q, k, v, m = (t.half() for t in (q, k, v, m))
    return torch.matmul((torch.matmul(q, k.mT) * 0.25 + m).softmax(-1), v)


def masked_in_bfloat16(q, k, v, m):
    q, k, v, m = (t.bfloat16() for t in (q, k, v, m))
    return torch.matmul((torch.matmul(q, k.mT) * 0.25 + m).softmax(-1), v)


def narrowed_after_the_mask(q, k, v, m):
    return torch.matmul((torch.matmul(q, k.mT) * 0.25 + m).bfloat16().softmax(-1).float(), v)


def mask_of_another_dtype(q, k, v, m):
    q, k, v = (t.bfloat16() for t in (q, k, v))
    return torch.matmul((torch.matmul(q, k.mT) * 0.25 + m).softmax(-1).to(v.dtype), v)


def masked_then_scaled(q, k, v, m):
    return torch.matmul(((torch.matmul(q, k.mT) + m) * 0.25).softmax(-1), v)


def two_masks(q, k, v, m):
    return torch.matmul((torch.matmul(q, k.mT) * 0.25 + m + m.mT).softmax(-1), v)


def filled(q, k, v, m):
    return torch.matmul(torch.matmul(q, k.mT).masked_fill(m, float("-inf")).softmax(-1), v)


def probabilities_returned(q, k, v, m):
    probs = torch.matmul(q, k.mT).softmax(-1)
    return torch.matmul(probs, v), probs


def scores_read_twice(q, k, v, m):
    s = torch.matmul(q, k.mT)
    return torch.matmul(s.softmax(-1), v) + s.sum(-1, keepdim=True)


def scaled_by_a_tensor(q, k, v, m):
    return torch.matmul((torch.matmul(q, k.mT) * m.float()).softmax(-1), v)


def other_dim(q, k, v, m):
    return torch.matmul(torch.matmul(q, k.mT).softmax(-2), v)


def number_over_scores(q, k, v, m):
    return torch.matmul((1.0 / torch.matmul(q, k.mT)).softmax(-1), v)


def negative_scale(q, k, v, m):
    return torch.matmul(torch.matmul(q, k.mT).mul(-0.5).softmax(-1), v)


def the_same_probabilities_twice(q, k, v, m):
    p = torch.matmul(q, k.mT).mul(0.5).softmax(-1)
    return torch.matmul(p, p)


@pytest.mark.parametrize(
    "fn", [masked_in_float16, masked_in_bfloat16, narrowed_after_the_mask, mask_of_another_dtype,
           masked_then_scaled, two_masks, filled,
           probabilities_returned, scores_read_twice, scaled_by_a_tensor, other_dim, number_over_scores,
           negative_scale, the_same_probabilities_twice], ids=lambda f: f.__name__,
)  # fmt: skip
def test_a_score_masked_or_read_elsewhere_keeps_its_written_out_form(fn):
    """A float16 or bfloat16 mask (in a row every key of which it masks with a fill of -1e4, eager's
    16-bit sum averages the values, and SDPA's float32 one would not), the scores cast to a narrower
    float after the mask (finfo.min becomes -inf), a mask of another dtype than the operands', added
    before the scale, a second mask, a fill (masked_fill); the probabilities or scores read again
    (also as the values of their own product), a score scaled by a tensor, by a negative number
    (FlashAttention takes a row's max before it scales) or divided into a number, a softmax over
    the queries: left as they are."""
    q, k, v = (torch.randn(2, 2, 6, 8) for _ in "qkv")
    m = torch.rand(2, 1, 6, 6) > 0.3 if fn is filled else torch.randn(2, 1, 6, 6)
    gm = exported(fn, (q, k, v, m))
    before = targets(gm)
    assert written_out_as_sdpa(gm) == 0
    assert targets(gm) == before


@pytest.fixture
def as_on_a_gpu(monkeypatch):
    """The compile's choice of the SDPA call, as on a GPU, for the kernels on this CPU."""
    monkeypatch.setattr(gjit.driver, "attention_as_sdpa", lambda gm: True)


def test_the_library_runs_atens_sdpa_for_it(as_on_a_gpu):
    """Where the library runs products (mode default, nothing measured), the attention is one
    SDPA extern: no score matrix, no softmax kernel; the output as eager's within its rounding."""
    args = inputs("hf_eager", torch.bfloat16)
    with gjit.config.scope(matmul="auto"):
        cm, report = check_against_float64(hf_eager, *args)
    externs = [e.op for e in report.externs]
    assert externs == ["aten.scaled_dot_product_attention.default"], report
    assert not any("softmax" in k.name for k in report.kernels), report


def test_the_template_takes_the_sdpa_call_as_it_took_the_written_out_form(as_on_a_gpu):
    args = inputs("transposed_heads", torch.float16)
    cm, report = check_against_float64(transposed_heads, *args)
    assert [k.name.startswith("gjit_attn_") for k in report.kernels] == [True], report
    assert not report.externs, report


def test_no_keys_or_no_queries_give_zeros_as_eagers_products(as_on_a_gpu):
    """The call runs ATen's kernel only where there are queries and keys (a fused kernel may refuse
    an empty batch or key dim): zeros otherwise, as eager's product over no keys gives."""

    def attention(q, k, v):
        return torch.matmul(torch.matmul(q, k.mT).mul(0.25).softmax(-1), v)

    for queries, keys in ((4, 0), (0, 5)):
        q, k, v = torch.randn(2, 3, queries, 16), torch.randn(2, 3, keys, 16), torch.randn(2, 3, keys, 16)
        with gjit.config.scope(matmul="auto"):
            cm, report = check_against_float64(attention, q, k, v)
        assert [e.op for e in report.externs] == ["aten.scaled_dot_product_attention.default"], report
        assert "gjit_written_out(" in cm.entries[-1].program.graph.wrapper_source
        assert (cm(q, k, v) == 0).all()


def test_an_entry_from_the_disk_cache_is_analyzed_as_compiled(as_on_a_gpu, tmp_path):
    """explain on an entry served from the disk cache lowers the stored graph again: the SDPA
    call replaces the written-out form there too, so its kernels are the entry's."""
    args = inputs("grouped", torch.float32)
    with gjit.config.scope(cache=True, cache_dir=str(tmp_path), matmul="auto"):
        first, _ = check_against_float64(grouped, *args)
        second = gjit.compile(grouped)
        out, _ = run_compiled(second, *args)
        assert gjit.stats().get("disk_cache_hits") == 1, gjit.stats()
        report = gjit.explain(second, *args)
    assert_same(out, grouped(*args), grouped(*upcast(args)))
    assert [e.op for e in report.externs] == ["aten.scaled_dot_product_attention.default"], report
    assert [k.name for k in report.kernels] == [k.name for k in gjit.explain(first, *args).kernels]


@pytest.mark.gpu
def test_on_a_gpu_written_out_attention_runs_atens_sdpa():
    torch.manual_seed(0)
    q, k, v = (torch.randn(4, 12, 197, 64, device="cuda", dtype=torch.float16) for _ in "qkv")
    with gjit.config.scope(matmul="auto"):
        cm, report = check_against_float64(vit, q, k, v)
    assert [e.op for e in report.externs] == ["aten.scaled_dot_product_attention.default"], report


def test_a_program_whose_output_is_the_attention_saves_as_a_package(as_on_a_gpu, tmp_path):
    """The product's node becomes the squeeze of the SDPA call under its own name: the program's
    signature, which names it an output, still holds, and a cold entry saves and loads."""
    args = inputs("per_head_3d", torch.float32)
    with gjit.config.scope(matmul="auto"):
        cm, _ = check_against_float64(per_head_3d, *args)
        gjit.save(cm, str(tmp_path / "attention.gjit"))
        loaded = gjit.load(str(tmp_path / "attention.gjit"), per_head_3d)
        out, _ = run_compiled(loaded, *args)
        report = gjit.explain(loaded, *args)
    assert_same(out, per_head_3d(*args), per_head_3d(*upcast(args)))
    assert [e.op for e in report.externs] == ["aten.scaled_dot_product_attention.default"], report


@pytest.fixture
def flash_layout():
    """ATen's SDPA on this CPU returning FlashAttention's layout on a GPU ([B, L, H, E] in memory)."""
    math_sdpa = torch.ops.aten._scaled_dot_product_attention_math.default
    lib = torch.library.Library("aten", "IMPL")

    def flash_like(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False):
        out = math_sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale=scale)[0]
        return out.transpose(1, 2).contiguous().transpose(1, 2)

    lib.impl("scaled_dot_product_attention", flash_like, "CPU")
    try:
        yield
    finally:
        lib._destroy()


def test_a_fused_kernels_layout_is_copied_into_the_calls_value(as_on_a_gpu, flash_layout):
    """The program's next kernels read the call's value as contiguous: the wrapper copies the
    fused kernels' layout into it, and GJIT_CHECK's eager replay does the same."""

    def viewed(q, k, v):
        return (torch.matmul(torch.matmul(q, k.mT).mul(0.25).softmax(-1), v)).flatten(2) + 1

    args = tuple(torch.randn(2, 4, 9, 32) for _ in "qkv")
    assert not torch.ops.aten.scaled_dot_product_attention.default(*args).is_contiguous()
    with gjit.config.scope(matmul="auto"):
        check_against_float64(viewed, *args)
    with gjit.config.scope(matmul="template", check=True):
        check_against_float64(viewed, *args)


def test_past_65535_heads_the_call_runs_in_parts():
    """A fused kernel launches a grid dim per head, at most 65535 of them: N = batch x heads past it
    runs in parts (the written-out form it replaces had no such limit)."""
    from gjit.runtime.attention_masks import MAX_HEADS, written_out

    q, k, v = (torch.randn(1, MAX_HEADS + 7, 3, 8) for _ in "qkv")
    calls = []

    def sdpa(q, k, v, **kwargs):
        calls.append(q.shape[1])
        return torch.ops.aten.scaled_dot_product_attention.default(q, k, v, **kwargs)

    out = written_out(sdpa, q.stride(), q, k, v, scale=0.5)
    assert calls == [MAX_HEADS, 7]
    assert torch.allclose(out, torch.ops.aten.scaled_dot_product_attention.default(q, k, v, scale=0.5))


def hf_masked(q, k, v, mask):
    """transformers' eager attention with its additive 4-D mask ([B, 1, L, S]: 0 or finfo.min)."""
    scores = torch.matmul(q, k.transpose(2, 3)) * 0.125 + mask
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v).transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)


def per_head_masked(q, k, v, mask):
    return torch.bmm(torch.softmax(torch.bmm(q, k.transpose(1, 2)) * 0.25 + mask, dim=-1), v)


def padding_mask(batch, queries, keys, dtype, dead=()):
    """0 where a query sees a key, finfo.min where padding hides it; queries in `dead` (batch, row,
    fill) see no key at all."""
    mask = torch.zeros(batch, 1, queries, keys, dtype=dtype)
    mask[1, :, :, keys // 2 :] = torch.finfo(dtype).min
    for b, row, fill in dead:
        mask[b, :, row] = fill
    return mask


def test_an_additive_mask_goes_to_sdpa_as_its_attn_mask():
    torch.manual_seed(0)
    dtype = torch.float32
    q, k, v = (torch.randn(2, 4, 9, 32, dtype=dtype) for _ in "qkv")
    mask = padding_mask(2, 9, 9, dtype, dead=[(0, 3, torch.finfo(dtype).min)])
    gm = exported(hf_masked, (q, k, v, mask))
    expected = gm(q, k, v, mask)[0]
    assert written_out_as_sdpa(gm) == 1
    (sdpa,) = [n for n in gm.graph.nodes if n.target is aten.scaled_dot_product_attention.default]
    assert sdpa.kwargs["attn_mask"].op == "placeholder" and _shape(sdpa.args[0]) == (2, 4, 9, 32)
    assert_same(gm(q, k, v, mask)[0], expected, hf_masked(*upcast((q, k, v, mask))))


def _shape(node):
    return tuple(int(s) for s in node.meta["val"].shape)


def test_a_mask_on_scores_of_one_batch_dim_broadcasts_from_the_front():
    torch.manual_seed(0)
    q, k, v = (torch.randn(6, 7, 8) for _ in "qkv")
    for mask in (torch.randn(6, 7, 7), torch.randn(7, 7), torch.randn(7)):
        gm = exported(per_head_masked, (q, k, v, mask))
        expected = gm(q, k, v, mask)[0]
        assert written_out_as_sdpa(gm) == (mask.dim() >= 2)  # SDPA reads a mask's rows and keys
        assert_same(gm(q, k, v, mask)[0], expected, per_head_masked(*upcast((q, k, v, mask))))


def test_a_vision_transformers_eager_attention_becomes_sdpa():
    """transformers' ViT with attn_implementation="eager" adds a mask it builds (zeros) to every
    score: both layers' attention become SDPA calls."""
    import transformers

    config = dict(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    model = transformers.ViTModel(
        transformers.ViTConfig(**config, intermediate_size=128, attn_implementation="eager")
    )
    model.eval()
    pixels = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        ep = torch.export.export(model, (pixels,), dynamic_shapes=({0: torch.export.Dim.AUTO},))
        ep = ep.run_decompositions()
        expected = ep.module()(pixels)[0]
        assert written_out_as_sdpa(ep.graph_module) == 2
        assert_same(ep.module()(pixels)[0], expected, model.double()(pixels.double())[0])


@pytest.mark.parametrize("matmul", ["auto", "template"])
def test_rows_the_mask_leaves_without_a_key_are_as_eagers(as_on_a_gpu, matmul):
    """A query every key of which the mask hides with -inf is NaN, as eager's softmax gives (the
    wrapper makes it so: fused kernels give zeros there; the template keeps the written-out form's
    NaN); with finfo.min, the values' mean, as in eager (SDPA adds the mask in float32, where the
    scores vanish under that fill); with -1e4, the scores' softmax in both."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 9, 32) for _ in "qkv")
    dead = [(0, 3, float("-inf")), (1, 5, torch.finfo(torch.float32).min), (1, 6, -1e4)]
    mask = padding_mask(2, 9, 9, torch.float32, dead=dead)
    with gjit.config.scope(matmul=matmul):
        cm, report = check_against_float64(hf_masked, q, k, v, mask)
        out, _ = run_compiled(cm, q, k, v, mask)
    library = [e.op for e in report.externs] == ["aten.scaled_dot_product_attention.default"]
    assert library == (matmul == "auto"), report
    assert out[0, 3].isnan().all() and not out[0, :3].isnan().any()
    assert torch.allclose(out[1, 5], v[1].mean(1).flatten(), atol=1e-5)


def test_a_fill_below_far_goes_to_sdpa_as_far():
    """The memory-efficient kernel scales scores and mask by log2(e): finfo.min would overflow to
    -inf there and a row every key of which it masks would be zeros, not eager's mean of the
    values. The call hands it a fill of -2**100 instead; -inf stays -inf, other values as they are."""
    from gjit.runtime.attention_masks import FAR, written_out

    q, k, v = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    mask = torch.tensor([0.0, -5.0, -1e30, torch.finfo(torch.float32).min, float("-inf")])[None]
    seen = []

    def sdpa(q, k, v, **kwargs):
        seen.append(kwargs["attn_mask"])
        return torch.ops.aten.scaled_dot_product_attention.default(q, k, v, **kwargs)

    written_out(sdpa, (48, 24, 8, 1), q, k, v, attn_mask=mask.expand(3, 5))
    assert torch.equal(seen[0], torch.tensor([[0.0, -5.0, -1e30, FAR, float("-inf")]] * 3))


def test_no_keys_with_a_mask_give_zeros(as_on_a_gpu):
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 4, 0, 8), torch.randn(2, 4, 0, 8)
    mask = torch.zeros(2, 1, 5, 0)
    with gjit.config.scope(matmul="auto"):
        cm, report = check_against_float64(hf_masked, q, k, v, mask)
    assert [e.op for e in report.externs] == ["aten.scaled_dot_product_attention.default"], report
