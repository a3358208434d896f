"""Attention as one template kernel (kernels/attention.py): scaled_dot_product_attention and the
eager form HF models write out (bmm, scale, mask, softmax, bmm), in float32, float16 and bfloat16,
through Triton's interpreter, compared with eager and a float64 reference. Odd sizes that are not
multiples of the tiles, one query (a decode step), causal, boolean and additive masks broadcast
over batch and heads, rows with every key masked, grouped-query heads (enable_gqa and the
expand+reshape HF's repeat_kv writes), transposed and strided operands, producers in the prologue
(a rotary embedding) and consumers in the epilogue; the paths that keep today's kernels or an
extern: probabilities returned (output_attentions), dropout, gjit.config.matmul = "aten"."""

import math

import pytest
import torch
import torch.nn.functional as F

import gjit
import model_zoo
from helpers import assert_same, check_against_float64, run_compiled, upcast

pytestmark = [pytest.mark.cpu]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def check_attention(fn, *args, attention=1, kernels=None, externs=0):
    """Run `fn` compiled, compare every output with eager and float64; `attention` kernels ran
    (None: any number)."""
    cm, report = check_against_float64(fn, *args)
    names = [k.name for k in report.kernels]
    if attention is not None:
        assert sum(n.startswith("gjit_attn_") for n in names) == attention, report
    assert len(report.externs) == externs, report
    if kernels is not None:
        assert len(names) == kernels, report
    return cm, report


def qkv(batch, heads, queries, keys, dim, dtype, kv_heads=None, dim_v=None):
    kv_heads = kv_heads or heads
    return (
        torch.randn(batch, heads, queries, dim, dtype=dtype),
        torch.randn(batch, kv_heads, keys, dim, dtype=dtype),
        torch.randn(batch, kv_heads, keys, dim_v or dim, dtype=dtype),
    )


# -- scaled_dot_product_attention ------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "queries,keys,dim", [(1, 1, 8), (3, 17, 16), (17, 3, 24), (127, 65, 64), (1, 127, 32)]
)
def test_sdpa_odd_sizes(dtype, queries, keys, dim):
    q, k, v = qkv(2, 3, queries, keys, dim, dtype)
    check_attention(F.scaled_dot_product_attention, q, k, v, kernels=1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sdpa_causal_scale_and_value_dim(dtype):
    q, k, v = qkv(1, 2, 33, 40, 16, dtype, dim_v=24)
    check_attention(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), q, k, v)
    check_attention(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, scale=0.3), q, k, v)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("queries,keys", [(130, 130), (100, 40), (20, 150)])
def test_causal_attention_stops_each_query_tile_at_its_diagonal(dtype, queries, keys):
    """is_causal masks every key past the query's own index: each query tile's key loop ends at
    its last row (at S when there are more queries than keys), several tiles per head."""
    q, k, v = qkv(1, 2, queries, keys, 16, dtype)
    causal = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    _, report = check_attention(causal, q, k, v)
    (kernel,) = report.kernels
    # the blocks before the diagonal first, in a loop with neither the causal nor the bound mask
    full, masked = kernel.source.split("for n0 in range(0, full_end, BLOCK_N):")[1].split(
        "for n0 in range(full_end, keys_end, BLOCK_N):"
    )
    assert "tl.where" in masked and "<= c" in masked and "< S," in masked
    assert "<= c" not in full and "< S," not in full and "exp2" in full
    assert "tile_m = tiles_m - 1 - pid % tiles_m" in kernel.source  # the longest tiles first


@pytest.mark.parametrize("dtype", DTYPES)
def test_sdpa_masks_broadcast_over_batch_and_heads(dtype):
    q, k, v = qkv(2, 3, 9, 21, 16, dtype)
    keep = torch.rand(2, 1, 9, 21) > 0.3
    keep[..., 0] = True
    bias = torch.randn(1, 3, 1, 21, dtype=dtype)
    sdpa = F.scaled_dot_product_attention
    check_attention(lambda q, k, v, m: sdpa(q, k, v, attn_mask=m), q, k, v, keep)
    check_attention(lambda q, k, v, m: sdpa(q, k, v, attn_mask=m), q, k, v, bias)


def test_sdpa_rows_with_every_key_masked_give_zeros_as_eager():
    q, k, v = qkv(1, 2, 5, 7, 16, torch.float32)
    keep = torch.rand(5, 7) > 0.5
    keep[2] = False
    keep[0] = True
    cm, _ = check_attention(
        lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m), q, k, v, keep
    )
    out = cm(q, k, v, keep)
    assert not out.isnan().any() and (out[:, :, 2] == 0).all()
    additive = torch.zeros(5, 7).masked_fill(~keep, float("-inf"))
    check_attention(
        lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m), q, k, v, additive
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_sdpa_grouped_query_heads_by_index_math(dtype):
    q, k, v = qkv(2, 6, 11, 13, 16, dtype, kv_heads=2)
    fn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    check_attention(fn, q, k, v, kernels=1)


def test_sdpa_nan_and_inf_propagate_as_in_float64():
    """A NaN query element makes its row NaN, an infinite key the rows whose score is +inf, an
    infinite value its column: as eager's float64 (math) attention. (Eager's float32 CPU kernel
    leaves a NaN query's row NaN in its first column only.)"""
    q, k, v = qkv(1, 2, 6, 9, 16, torch.float32)
    q[0, 0, 1, 3], k[0, 1, 4, 2], v[0, 0, 5, 0] = float("nan"), float("inf"), float("-inf")
    out, cm = run_compiled(F.scaled_dot_product_attention, q, k, v)
    reference = F.scaled_dot_product_attention(*upcast((q, k, v)))
    assert torch.equal(out.isnan(), reference.isnan()) and reference.isnan().any()
    assert torch.equal(out.isinf(), reference.isinf()) and reference.isinf().any()
    finite = reference.isfinite()
    torch.testing.assert_close(out[finite].double(), reference[finite], rtol=1e-4, atol=1e-5)


def test_sdpa_strided_operands_and_epilogue():
    """Heads split off a [B, S, H*D] projection and transposed, as every HF model does; the output
    transposed back and scaled in the epilogue: one kernel, no copies."""
    x = torch.randn(2, 19, 3 * 4 * 16)

    def fn(x):
        q, k, v = x.view(2, 19, 3, 4, 16).permute(2, 0, 3, 1, 4).unbind(0)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.transpose(1, 2).reshape(2, 19, 64) * 2.0 + 1.0

    check_attention(fn, x, kernels=1)


def test_sdpa_rotary_embedding_in_the_prologue():
    q, k, v = qkv(1, 2, 12, 12, 16, torch.float32)
    cos, sin = torch.randn(12, 16), torch.randn(12, 16)

    def rotate(x):
        return torch.cat((-x[..., 8:], x[..., :8]), dim=-1)

    def fn(q, k, v, cos, sin):
        q, k = q * cos + rotate(q) * sin, k * cos + rotate(k) * sin
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    check_attention(fn, q, k, v, cos, sin, kernels=1)


def test_sdpa_repeat_kv_heads_are_read_in_place():
    """Llama's repeat_kv (expand + reshape of the key/value heads): no copy kernel."""
    q, k, v = qkv(1, 4, 10, 10, 16, torch.float32, kv_heads=2)

    def repeat(x, n):
        b, h, s, d = x.shape
        return x[:, :, None].expand(b, h, n, s, d).reshape(b, h * n, s, d)

    fn = lambda q, k, v: F.scaled_dot_product_attention(q, repeat(k, 2), repeat(v, 2), is_causal=True)
    check_attention(fn, q, k, v, kernels=1)


def test_sdpa_dynamic_head_dim_is_an_argument_guarded_to_its_tile():
    """A head dim that is a size symbol: the tile is chosen from the example, the kernel assumes
    the dim fits it (a guard), and a larger head dim recompiles."""
    fn = gjit.compile(F.scaled_dot_product_attention, dynamic=True)
    for dim in (16, 12, 40):
        q, k, v = qkv(1, 2, 5, 6, dim, torch.float32)
        out, _ = run_compiled(fn, q, k, v)
        assert_same(
            out, F.scaled_dot_product_attention(q, k, v), F.scaled_dot_product_attention(*upcast((q, k, v)))
        )
    assert len(fn.entries) == 2  # 16 and 12 share the 16-wide tile; 40 needs a 64-wide one
    assert any("head dim" in why for k in fn.entries[0].program.kernels for _, why in k.assumptions)


def test_sdpa_dropout_and_aten_setting_stay_externs():
    q, k, v = qkv(1, 2, 5, 6, 16, torch.float32)
    with gjit.config.scope(matmul="aten"):
        cm, report = check_attention(F.scaled_dot_product_attention, q, k, v, attention=0, externs=1)
    assert "gjit.config.matmul is 'aten'" in str(report)
    fn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    cm = gjit.compile(fn)
    torch.manual_seed(0)
    out, _ = run_compiled(cm, q, k, v)
    assert out.shape == q.shape
    report = gjit.explain(cm, q, k, v)
    assert "dropout" in str(report) and len(report.externs) == 1, report


# -- attention written out -------------------------------------------------------------------


def eager_attention(q, k, v, mask=None, scale=None):
    """As HF's eager_attention_forward: scores, additive mask, softmax in float32, cast, product."""
    scale = scale or 1 / math.sqrt(q.shape[-1])
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    if mask is not None:
        scores = scores + mask
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v).transpose(1, 2).contiguous()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("queries,keys", [(1, 1), (3, 17), (17, 3), (127, 65), (1, 40)])
def test_written_out_attention_is_one_kernel(dtype, queries, keys):
    q, k, v = qkv(2, 3, queries, keys, 16, dtype)
    mask = torch.randn(2, 1, queries, keys, dtype=dtype)
    check_attention(eager_attention, q, k, v, mask, kernels=1)


def test_written_out_causal_mask_with_finfo_min_and_padding():
    """GPT-2's where(causal, scores, finfo.min) and BERT's padding mask (finfo.min where padded)."""
    q, k, v = qkv(2, 2, 9, 9, 16, torch.float32)
    causal = torch.ones(9, 9, dtype=torch.bool).tril()
    padding = torch.zeros(2, 1, 1, 9)
    padding[1, ..., 6:] = torch.finfo(torch.float32).min

    def fn(q, k, v, causal, padding):
        scores = torch.matmul(q, k.transpose(-1, -2)) / torch.full([], 4.0)
        scores = torch.where(causal, scores, torch.finfo(scores.dtype).min) + padding
        return torch.matmul(scores.softmax(-1), v)

    check_attention(fn, q, k, v, causal, padding, kernels=1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("written_out", [True, False], ids=["written_out", "sdpa"])
def test_rows_masked_to_the_end_with_finfo_min_average_the_values_as_eager(dtype, written_out):
    """HF's padding mask adds finfo.min, finite: a query row with every key masked that way (a
    left-padded position) has equal scores, and eager's softmax averages the values. In base 2
    (the score times log2(e)) float32's and bfloat16's finfo.min overflow to -inf, and the row came
    out NaN (softmax) or zeros (sdpa); the next layer then reads the NaN as a key of every row."""
    q, k, v = qkv(1, 2, 6, 6, 16, dtype)
    mask = torch.zeros(1, 1, 6, 6, dtype=dtype)
    mask[..., 2, :] = torch.finfo(dtype).min
    mask[..., 4, 3:] = torch.finfo(dtype).min
    if written_out:
        fn = eager_attention
    else:
        fn = lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m)  # noqa: E731
    cm, report = check_attention(fn, q, k, v, mask)
    (kernel,) = [k for k in report.kernels if k.name.startswith("gjit_attn_")]
    # float16's finfo.min (-65504) stays finite in base 2: only the wide masks keep base e
    assert ("tl.exp2(" in kernel.source) == (dtype == torch.float16), kernel.source
    out = cm(q, k, v, mask)
    got = out[:, 2] if written_out else out[:, :, 2]
    assert got.isfinite().all()
    if dtype != torch.float16:  # finfo.min swamps every score: the values equally weighted
        torch.testing.assert_close(got.float(), v.float().mean(2), rtol=2e-2, atol=2e-2)


def test_a_left_padded_batch_through_hf_eager_attention_matches_eager():
    """Llama's eager attention (float32) on a batch whose second prompt is left-padded: the padded
    query rows have every key masked with finfo.min. Their NaN (base 2) reached every logit of the
    sequence through the next layer's keys."""
    pytest.importorskip("transformers")
    model, (ids,) = model_zoo.llama("eager")
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
        got, cm = run_compiled(model, input_ids=ids, attention_mask=mask)
    kernels = cm.entries[0].program.graph.kernels
    assert sum(k.name.startswith("gjit_attn_") for k in kernels) == 2
    torch.testing.assert_close(got.logits, want, rtol=1e-4, atol=1e-4)


def test_written_out_rows_with_every_key_masked_are_nan_as_softmax():
    q, k, v = qkv(1, 1, 4, 5, 16, torch.float32)
    mask = torch.zeros(1, 1, 4, 5)
    mask[..., 1, :] = float("-inf")
    cm, _ = check_attention(eager_attention, q, k, v, mask)
    out = cm(q, k, v, mask)
    assert out[:, 1].isnan().all() and not out[:, 0].isnan().any()


def test_written_out_transposes_read_in_place():
    """Heads transposed out of [B, S, H, D] and back: no clone kernel anywhere."""

    def attention(q, k, v):
        b, s, h, d = q.shape
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        scores = torch.matmul(q, k.transpose(-1, -2)) * 0.25
        return torch.matmul(scores.softmax(-1), v).transpose(1, 2).reshape(b, s, h * d)

    q, k, v = (torch.randn(2, 9, 3, 16) for _ in range(3))
    check_attention(attention, q, k, v, kernels=1)


def test_written_out_grouped_heads_through_repeat_kv():
    q, k, v = qkv(1, 4, 7, 7, 16, torch.bfloat16, kv_heads=2)

    def fn(q, k, v):
        b, h, s, d = k.shape
        k, v = (x[:, :, None].expand(b, h, 2, s, d).reshape(b, 2 * h, s, d) for x in (k, v))
        return eager_attention(q, k, v)

    check_attention(fn, q, k, v, kernels=1)


def test_returned_probabilities_keep_the_matmuls():
    """output_attentions=True: the probabilities are an output, so the scores are computed and
    stored as today (two matmul kernels and the softmax), no attention kernel."""

    def fn(q, k, v):
        probs = torch.matmul(q, k.transpose(-1, -2)).softmax(-1)
        return torch.matmul(probs, v), probs

    q, k, v = qkv(1, 2, 5, 6, 16, torch.float32)
    _, report = check_attention(fn, q, k, v, attention=0)
    assert sum(k.name.startswith("gjit_mm_") for k in report.kernels) == 2


def test_softmax_over_another_dim_is_not_attention():
    def fn(q, k, v):
        return torch.matmul(torch.matmul(q, k.transpose(-1, -2)).softmax(-2), v)

    q, k, v = qkv(1, 2, 5, 5, 16, torch.float32)
    check_attention(fn, q, k, v, attention=0)


def test_explain_names_the_absorbed_nodes():
    q, k, v = qkv(1, 2, 5, 6, 16, torch.float32)
    _, report = check_attention(eager_attention, q, k, v)
    (kernel,) = [k for k in report.kernels if k.name.startswith("gjit_attn_")]
    assert any("_softmax" in n for n in kernel.aten_nodes) and any("bmm" in n for n in kernel.aten_nodes)
    assert "attention template (kernels/attention.py)" in kernel.source
    assert any("attention" in line for line in report.matmuls), report.matmuls


def test_not_attention_when_the_probabilities_are_sliced_or_rounded():
    """A softmax over more keys than the product sums, or probabilities cast through bool, int or
    a narrower float than the values: two matmuls and a softmax, exact as eager."""
    mm = torch.matmul
    q, k, v = qkv(1, 2, 5, 5, 16, torch.float32)
    sliced = lambda q, k, v: mm(mm(q, k.transpose(-1, -2)).softmax(-1)[..., :3], v[:, :, :3])
    check_attention(sliced, q, k, v, attention=0)
    for cast in (
        lambda p: p.to(torch.bool).to(p.dtype),
        lambda p: p.to(torch.int32).to(p.dtype),
        lambda p: p.half().to(p.dtype),
    ):
        fn = lambda q, k, v, cast=cast: mm(cast(mm(q, k.transpose(-1, -2)).softmax(-1)), v)
        check_attention(fn, q, k, v, attention=0)


def test_not_attention_when_the_product_reads_what_it_would_replace():
    """The probabilities or the scores read again by the output product, the scores read at a
    second index, a score term read twice: compiled (no crash), exact as eager."""
    mm = torch.matmul
    q, k = torch.randn(1, 2, 6, 6), torch.randn(1, 2, 6, 6)
    check_attention(lambda q, k: (lambda p: mm(p, p))(mm(q, k.mT).softmax(-1)), q, k, attention=0)
    check_attention(lambda q, k: (lambda s: mm(s.softmax(-1), s))(mm(q, k.mT)), q, k, attention=0)
    check_attention(lambda q, k: mm((lambda s: s + s.mT)(mm(q, k.mT)).softmax(-1), k), q, k, attention=0)

    def twice(q, k, v):
        a = mm(q, k.mT) * 0.5
        return mm((a + a * 2).softmax(-1), v)

    check_attention(twice, q, k, torch.randn(1, 2, 6, 6), attention=None)


def test_written_out_attention_over_no_keys_is_zero_as_eager():
    q, k, v = qkv(1, 2, 4, 0, 16, torch.float32)
    cm, _ = check_attention(
        lambda q, k, v: torch.matmul(torch.matmul(q, k.mT).softmax(-1), v), q, k, v, attention=None
    )
    assert (cm(q, k, v) == 0).all()
