"""Written-out attention whose score is only scaled runs as ATen's scaled_dot_product_attention on a
GPU (gjit/lowering/attention_library.py): the pass on exported graphs, and the compile with it."""

import math

import pytest
import torch
import torch.nn.functional as F

import gjit
import gjit.driver
from gjit.lowering.attention_call import written_out_as_sdpa
from gjit.runtime.graph import FallbackInterpreter
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
    got = FallbackInterpreter(gm).run(*args)[0]  # the SDPA node as the wrapper calls it
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


def filled_near_the_scores(q, k, v, m):
    return torch.matmul(torch.matmul(q, k.mT).masked_fill(m, -100.0).softmax(-1), v)


def filled_in_float16(q, k, v, m):
    q, k, v = (t.half() for t in (q, k, v))
    return torch.matmul(torch.matmul(q, k.mT).masked_fill(m, -1e4).softmax(-1), v)


def hf_mask_in_float16(q, k, v, m):
    q, k, v = (t.half() for t in (q, k, v))
    mask = torch.where(m, torch.zeros((), dtype=q.dtype), torch.finfo(q.dtype).min)
    return torch.matmul((torch.matmul(q, k.mT) * 0.25 + mask).softmax(-1), v)


def filled_by_a_tensor(q, k, v, m):
    s = torch.matmul(q, k.mT)
    return torch.matmul(torch.where(m, s, s.detach().amin(-1, keepdim=True)).softmax(-1), v)


def filled_and_masked(q, k, v, m):
    return torch.matmul((torch.matmul(q, k.mT).masked_fill(m, float("-inf")) + 1.0 * m).softmax(-1), v)


def filled_then_negated(q, k, v, m):
    return torch.matmul(torch.matmul(q, k.mT).masked_fill(m, float("-inf")).mul(-0.5).softmax(-1), v)


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
           masked_then_scaled, two_masks, filled_near_the_scores, filled_in_float16, hf_mask_in_float16,
           filled_by_a_tensor, filled_and_masked, filled_then_negated,
           probabilities_returned, scores_read_twice, scaled_by_a_tensor, other_dim, number_over_scores,
           negative_scale, the_same_probabilities_twice], ids=lambda f: f.__name__,
)  # fmt: skip
def test_a_score_masked_or_read_elsewhere_keeps_its_written_out_form(fn):
    """A float16 or bfloat16 mask (in a row every key of which it masks with a fill of -1e4, eager's
    16-bit sum averages the values, and SDPA's float32 one would not), the scores cast to a narrower
    float after the mask (finfo.min becomes -inf), a mask of another dtype than the operands', added
    before the scale, a second mask; a fill near the scores (-100: a hidden key may weigh in eager),
    a finite fill on float16 operands (finfo.min added or -1e4 in its place: FAR is no float16), a
    fill by a tensor, a fill and a mask, a fill scaled by a negative number; the probabilities or
    scores read again
    (also as the values of their own product), a score scaled by a tensor, by a negative number
    (FlashAttention takes a row's max before it scales) or divided into a number, a softmax over
    the queries: left as they are."""
    q, k, v = (torch.randn(2, 2, 6, 8) for _ in "qkv")
    boolean = fn.__name__.startswith(("filled", "hf_mask"))
    m = torch.rand(2, 1, 6, 6) > 0.3 if boolean else torch.randn(2, 1, 6, 6)
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
    assert_same(FallbackInterpreter(gm).run(q, k, v, mask)[0], expected, hf_masked(*upcast((q, k, v, mask))))


def _shape(node):
    return tuple(int(s) for s in node.meta["val"].shape)


def test_a_mask_on_scores_of_one_batch_dim_broadcasts_from_the_front():
    torch.manual_seed(0)
    q, k, v = (torch.randn(6, 7, 8) for _ in "qkv")
    for mask in (torch.randn(6, 7, 7), torch.randn(7, 7), torch.randn(7)):
        gm = exported(per_head_masked, (q, k, v, mask))
        expected = gm(q, k, v, mask)[0]
        assert written_out_as_sdpa(gm) == (mask.dim() >= 2)  # SDPA reads a mask's rows and keys
        got = FallbackInterpreter(gm).run(q, k, v, mask)[0]
        assert_same(got, expected, per_head_masked(*upcast((q, k, v, mask))))


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
        specs = ep.graph_signature.input_specs
        lifted = [{**ep.state_dict, **ep.constants}[s.target] for s in specs if s.target is not None]
        got = FallbackInterpreter(ep.graph_module).run(*lifted, pixels)[0]
        assert_same(got, expected, model.double()(pixels.double())[0])


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
    values. The call hands it a fill of -2**100 instead; -inf stays -inf, NaN NaN (a row it reaches
    is NaN in eager), other values as they are."""
    from gjit.runtime.attention_masks import FAR, written_out

    q, k, v = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    mask = torch.tensor([0.0, -5.0, -1e30, torch.finfo(torch.float32).min, float("-inf"), float("nan")])[None]
    seen = []

    def sdpa(q, k, v, **kwargs):
        seen.append(kwargs["attn_mask"])
        return torch.ops.aten.scaled_dot_product_attention.default(q, k, v, **kwargs)

    out = written_out(sdpa, (48, 24, 8, 1), q, k, v, attn_mask=mask.expand(3, 6))
    expected = torch.tensor([[0.0, -5.0, -1e30, FAR, float("-inf"), float("nan")]] * 3)
    torch.testing.assert_close(seen[0], expected, rtol=0, atol=0, equal_nan=True)
    assert out.isnan().all()  # eager's softmax over a NaN score


def test_no_keys_with_a_mask_give_zeros(as_on_a_gpu):
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 4, 0, 8), torch.randn(2, 4, 0, 8)
    mask = torch.zeros(2, 1, 5, 0)
    with gjit.config.scope(matmul="auto"):
        cm, report = check_against_float64(hf_masked, q, k, v, mask)
    assert [e.op for e in report.externs] == ["aten.scaled_dot_product_attention.default"], report


# -- fills: keys hidden by a boolean condition --------------------------------------------------------


class MinGPT(torch.nn.Module):
    """minGPT's causal attention: a lower-triangular buffer, masked_fill with -inf, then a softmax."""

    def __init__(self, size=16):
        super().__init__()
        self.register_buffer("bias", torch.tril(torch.ones(size, size)).view(1, 1, size, size))

    def forward(self, q, k, v):
        t = q.shape[-2]
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
        return F.softmax(att, dim=-1) @ v


def padding_fill(q, k, v, keep):
    """The Annotated Transformer's: masked_fill(mask == 0, -1e9) with a [B, 1, 1, S] padding mask."""
    scores = torch.matmul(q, k.mT) / math.sqrt(q.shape[-1])
    return torch.matmul(scores.masked_fill(keep[:, None, None, :] == 0, -1e9).softmax(-1), v)


def where_finfo_min(q, k, v, keep):
    """transformers' older GPT-2: torch.where(causal, scores, finfo.min), the softmax in float32."""
    scores = torch.matmul(q, k.mT) * 0.125
    scores = torch.where(keep[:, None, None, :], scores, torch.finfo(scores.dtype).min)
    return torch.matmul(F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def filled_then_scaled(q, k, v, keep):
    """The fill before the scale: -inf stays -inf, -1e9 is scaled, a replacing fill still."""
    scores = torch.matmul(q, k.mT).masked_fill(~keep[:, None, None, :], -1e9)
    return torch.matmul((scores * 0.25).softmax(-1), v)


def causal_in_graph(q, k, v, keep):
    """A causal mask the program builds (triu of ones), filled with -inf."""
    t = q.shape[-2]
    hidden = torch.triu(torch.ones(t, t, dtype=torch.bool, device=q.device), 1)
    return torch.matmul(torch.matmul(q, k.mT).mul(0.25).masked_fill(hidden, float("-inf")).softmax(-1), v)


def hf_eager_mask(q, k, v, keep):
    """transformers' eager_mask: where(keep, 0, finfo.min) in the operands' dtype, added."""
    mask = torch.where(keep[:, None, None, :], torch.zeros((), dtype=q.dtype), torch.finfo(q.dtype).min)
    return hf_masked(q, k, v, mask)


def finfo_min_doubled(q, k, v, keep):
    """finfo.min divided by 0.5 after the fill: -inf in eager, so NaN where a query keeps no key."""
    scores = torch.matmul(q, k.mT).masked_fill(~keep[:, None, None, :], torch.finfo(q.dtype).min) / 0.5
    return torch.matmul(scores.softmax(-1), v)


def float64_mask_narrowed(q, k, v, keep):
    """A float64 mask of -1e300 added, the sum cast to the operands' dtype: -inf there."""
    mask = torch.where(keep[:, None, None, :], torch.zeros((), dtype=torch.float64), -1e300)
    return torch.matmul((torch.matmul(q, k.mT) * 0.125 + mask).to(q.dtype).softmax(-1), v)


def minus_ten_thousand(q, k, v, keep):
    """A fill of -1e4 (-9984 in bfloat16)."""
    return torch.matmul(torch.matmul(q, k.mT).masked_fill(~keep[:, None, None, :], -1e4).softmax(-1), v)


def per_head_causal(q, k, v, keep):
    """torch.bmm over batch x heads, a causal [L, S] condition: the [1, N] call with a 2-D mask."""
    q, k, v = (t.flatten(0, 1) for t in (q, k, v))
    hidden = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool).triu(1)
    return torch.bmm(torch.bmm(q, k.mT).masked_fill(hidden, float("-inf")).softmax(-1), v)


def causal_added(q, k, v, keep):
    """nn.Transformer's generate_square_subsequent_mask (triu of -inf) added to the scores."""
    t = q.shape[-2]
    mask = torch.triu(torch.full((t, k.shape[-2]), float("-inf"), dtype=q.dtype), diagonal=1)
    return torch.matmul((torch.matmul(q, k.mT) * 0.25 + mask).softmax(-1), v)


CAUSAL = "causal"  # the call is causal: no mask

FILLS = {  # form -> (function, the fill the call's mask holds)
    "padding_fill": (padding_fill, -(2.0**100)),
    "causal_added": (causal_added, CAUSAL),
    "finfo_min_doubled": (finfo_min_doubled, float("-inf")),
    "float64_mask_narrowed": (float64_mask_narrowed, float("-inf")),
    "minus_ten_thousand": (minus_ten_thousand, -(2.0**100)),
    "per_head_causal": (per_head_causal, CAUSAL),
    "where_finfo_min": (where_finfo_min, -(2.0**100)),
    "filled_then_scaled": (filled_then_scaled, -(2.0**100)),
    "causal_in_graph": (causal_in_graph, CAUSAL),
    "hf_eager_mask": (hf_eager_mask, -(2.0**100)),
}


def fill_inputs(dtype, dead=True):
    """q, k, v [2, 4, 9, 32]; keep [2, 9]: batch 1 hides its last four keys, batch 0 (if `dead`)
    every one."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 9, 32, dtype=dtype) for _ in "qkv")
    keep = torch.ones(2, 9, dtype=torch.bool)
    keep[1, 5:] = False
    if dead:
        keep[0] = False
    return q, k, v, keep


def _sdpa_nodes(gm):
    return [n for n in gm.graph.nodes if n.target is aten.scaled_dot_product_attention.default]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("form", list(FILLS))
def test_a_fill_goes_to_sdpa_as_a_mask_built_from_its_condition(form, dtype):
    """The keys a fill hides go to SDPA as a mask of the operands' dtype: 0 where a key is kept,
    -inf or FAR (for a finite fill that replaces the score, or a finfo.min added that swamps it)
    where not, built from the fill's condition. A query every key of which it hides: NaN under
    -inf, the values' mean under a finite fill, as in eager."""
    fn, value = FILLS[form]
    causal = value == CAUSAL
    args = fill_inputs(dtype, dead=not causal)
    gm = exported(fn, args)
    expected = gm(*args)[0]
    assert written_out_as_sdpa(gm) == 1
    (sdpa,) = _sdpa_nodes(gm)
    if causal:  # proved causal (gjit/lowering/causal.py): FlashAttention's causal kernel, no mask
        assert sdpa.kwargs.get("is_causal") and "attn_mask" not in sdpa.kwargs, gm.graph
        assert aten.where.self not in targets(gm) and aten.arange.start_step not in targets(gm), gm.graph
    else:
        mask = sdpa.kwargs["attn_mask"]
        assert mask.target is aten.where.self and mask.meta["val"].dtype == dtype, gm.graph
        assert sdpa.meta["gjit_attention_mask_fill"] == value
    assert aten._softmax.default not in targets(gm)
    out = FallbackInterpreter(gm).run(*args)[0]  # the SDPA node as the wrapper calls it
    assert_same(out, expected, fn(*upcast(args)))
    if not causal:
        assert expected[0].isnan().any() == (value == float("-inf"))


class TwoMinGPTLayers(torch.nn.Module):
    """Two of minGPT's attentions, each with its own buffer, the second reading the first's output."""

    def __init__(self):
        super().__init__()
        self.first, self.second = MinGPT(), MinGPT()

    def forward(self, q, k, v):
        return self.second(self.first(q, k, v), k, v)


def test_mingpts_causal_attention_runs_sdpa_with_the_mask_built_from_its_buffer(as_on_a_gpu):
    torch.manual_seed(0)
    model = TwoMinGPTLayers().eval()
    q, k, v = (torch.randn(2, 3, 12, 16) for _ in "qkv")
    with gjit.config.scope(matmul="auto"):
        cm, report = check_against_float64(model, q, k, v, reference_fn=model.double())
    assert [e.op for e in report.externs] == ["aten.scaled_dot_product_attention.default"] * 2, report
    assert not any("softmax" in k.name for k in report.kernels), report
    model.second.bias[0, 0, 5, :3] = 0  # the buffers are read live: a mask that is not causal
    out, _ = run_compiled(cm, q, k, v)
    assert_same(out, model(q, k, v), model.double()(*upcast((q, k, v))))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_on_a_gpu_fills_run_atens_sdpa_with_the_built_mask(dtype):
    """minGPT's causal fill, and a -1e9 padding fill with a batch that keeps no key (bf16: FAR
    where finite fills go): ATen's kernels with the built mask, eager's rows."""
    torch.manual_seed(0)
    model = TwoMinGPTLayers().cuda().to(dtype)
    q, k, v = (torch.randn(2, 12, 16, 64, device="cuda", dtype=dtype) for _ in "qkv")
    with gjit.config.scope(matmul="auto"):
        cm, report = check_against_float64(model, q, k, v, reference_fn=model.double())
        assert [e.op for e in report.externs] == ["aten.scaled_dot_product_attention.default"] * 2, report
        if dtype is torch.bfloat16:
            args = tuple(t.cuda() for t in fill_inputs(dtype))
            cm, report = check_against_float64(padding_fill, *args)
            assert [e.op for e in report.externs] == ["aten.scaled_dot_product_attention.default"], report


@pytest.mark.parametrize("matmul", ["auto", "template"])
@pytest.mark.parametrize("form", ["padding_fill", "where_minus_inf"])
def test_rows_a_fill_leaves_without_a_key_are_as_eagers(as_on_a_gpu, form, matmul):
    """Batch 0 keeps no key: the values' mean under a finite fill, NaN under -inf, through SDPA
    (the wrapper's call) and through the template; GJIT_CHECK's replay agrees."""

    def where_minus_inf(q, k, v, keep):
        scores = torch.matmul(q, k.mT) * 0.125
        return torch.matmul(torch.where(keep[:, None, None, :], scores, float("-inf")).softmax(-1), v)

    fn = padding_fill if form == "padding_fill" else where_minus_inf
    q, k, v, keep = fill_inputs(torch.float32)
    for check in (False, True):
        with gjit.config.scope(matmul=matmul, check=check):
            cm, report = check_against_float64(fn, q, k, v, keep)
            out, _ = run_compiled(cm, q, k, v, keep)
        library = [e.op for e in report.externs] == ["aten.scaled_dot_product_attention.default"]
        assert library == (matmul == "auto"), report
    if form == "padding_fill":
        assert torch.allclose(out[0], v[0].mean(1, keepdim=True).expand_as(out[0]), atol=1e-5)
    else:
        assert out[0].isnan().all() and not out[1].isnan().any()


def test_attentions_of_one_condition_share_the_mask_and_its_hidden_rows(as_on_a_gpu):
    """Two attentions hiding the same keys read one mask the compile builds, and the wrapper finds
    the queries that keep no key once per call."""

    def two(q, k, v, keep):
        hidden = ~keep[:, None, None, :]
        first = torch.matmul(torch.matmul(q, k.mT).masked_fill(hidden, float("-inf")).softmax(-1), v)
        return torch.matmul(torch.matmul(first, k.mT).masked_fill(hidden, float("-inf")).softmax(-1), v)

    args = fill_inputs(torch.float32, dead=False)
    gm = exported(two, args)
    assert written_out_as_sdpa(gm) == 2
    masks = {n.kwargs["attn_mask"] for n in _sdpa_nodes(gm)}
    assert len(masks) == 1, gm.graph
    with gjit.config.scope(matmul="auto"):
        cm, report = check_against_float64(two, *args)
    source = cm.entries[-1].program.graph.wrapper_source
    assert source.count("gjit_hidden_rows(") == 1 and source.count("gjit_written_out(") == 2, source


def not_quite_causal(q, k, v, keep):
    """Masks the program builds that are not the causal one: the diagonal hidden too, a key ahead
    seen, the keys after the queries' count (bottom right), a band."""
    t, s = q.shape[-2], k.shape[-2]
    rows, keys = torch.arange(t)[:, None], torch.arange(s)[None, :]
    masks = [torch.triu(torch.full((t, s), float("-inf")), 0), (keys <= rows + 1)]
    masks.append(keys <= rows + (s - t))
    masks.append((keys <= rows) & (keys > rows - 3))
    outs = [torch.matmul((torch.matmul(q, k.mT) * 0.25 + masks[0]).softmax(-1), v)]
    for m in masks[1:]:  # each attention its own scores (scores read twice stay written out)
        outs.append(
            torch.matmul((torch.matmul(q, k.mT) * 0.25).masked_fill(~m, float("-inf")).softmax(-1), v)
        )
    return tuple(outs)


def test_masks_built_from_sizes_that_are_not_causal_stay_masks():
    q, k, v = torch.randn(2, 4, 9, 32), torch.randn(2, 4, 12, 32), torch.randn(2, 4, 12, 32)
    args = (q, k, v, None)
    gm = exported(lambda q, k, v: not_quite_causal(q, k, v, None), args[:3])
    expected = gm(*args[:3])
    assert written_out_as_sdpa(gm) == 4
    for sdpa in _sdpa_nodes(gm):
        assert not sdpa.kwargs.get("is_causal") and sdpa.kwargs.get("attn_mask") is not None, gm.graph
    for out, exp, ref in zip(
        FallbackInterpreter(gm).run(*args[:3]), expected, not_quite_causal(*upcast(args))
    ):
        assert_same(out, exp, ref)


@pytest.mark.parametrize("matmul", ["auto", "template"])
def test_a_causal_mask_built_in_the_program_runs_causal_attention(as_on_a_gpu, matmul):
    """More keys than queries: is_causal is the top-left causal mask, as tril gives it; the library
    runs ATen's causal call, the template its causal kernel (no mask read)."""

    def causal_tril(q, k, v):
        keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        return torch.matmul((torch.matmul(q, k.mT) * 0.25).masked_fill(~keep, float("-inf")).softmax(-1), v)

    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 9, 32), torch.randn(2, 4, 12, 32), torch.randn(2, 4, 12, 32)
    with gjit.config.scope(matmul=matmul):
        cm, report = check_against_float64(causal_tril, q, k, v)
    library = [e.op for e in report.externs] == ["aten.scaled_dot_product_attention.default"]
    assert library == (matmul == "auto"), report
    assert len(report.kernels) == (matmul == "template"), report  # no kernel builds the mask
    source = cm.entries[-1].program.graph.wrapper_source
    assert ("is_causal=True" in source) == (matmul == "auto"), source
