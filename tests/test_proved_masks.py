"""SDPA calls whose mask the program builds from its sizes run without it (gjit/lowering/proved_masks.py):
causal where it is proved causal, unmasked where it is proved to keep every key; the mask's kernels
are gone. The masks are written as transformers builds them under torch.export."""

import copy

import pytest
import sympy
import torch
import torch.nn.functional as F

import gjit
from gjit.capture.decompose import decompose_program
from gjit.lowering.proved_masks import proved_masks
from helpers import assert_same, check_against_float64

pytestmark = [pytest.mark.cpu]
aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default


def position_ids(batch, length, step=1):
    return (torch.arange(length) * step)[None].expand(batch, -1)


def hf_causal(batch, length, step=1):
    """transformers' causal mask (masking_utils, under tracing): `kv_idx <= q_idx` on the position
    ids gathered by index tensors, and-ed with the check that no sequence is packed (the running
    sum of the steps between position ids that are not 1)."""
    pos = position_ids(batch, length, step)
    packed = (torch.diff(pos, dim=-1, prepend=pos[:, :1] - 1) != 1).cumsum(-1)
    b = torch.arange(batch)[:, None, None, None]
    q_idx, kv_idx = torch.arange(length)[None, None, :, None], torch.arange(length)[None, None, None, :]
    keep = torch.ones((), dtype=torch.bool) & (pos[b, kv_idx] <= pos[b, q_idx])
    return (keep & (packed[b, q_idx] == packed[b, kv_idx])).expand(batch, -1, length, length)


def hf_bidirectional(batch, length):
    """transformers' mask for an encoder without padding, under tracing: every key."""
    return (torch.arange(length)[None, None, :, None] >= 0).expand(batch, -1, length, length)


class Attention(torch.nn.Module):
    """One head-split attention layer as transformers writes it, its mask built by `mask`."""

    def __init__(self, mask, width=32, heads=2):
        super().__init__()
        self.mask, self.heads = mask, heads
        self.qkv, self.out = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)

    def forward(self, x):
        b, s, w = x.shape
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in self.qkv(x).split(w, -1))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask(b, s))
        return self.out(o.transpose(1, 2).reshape(b, s, w))


def exported(module, x):
    dims = ({0: torch.export.Dim.AUTO, 1: torch.export.Dim.AUTO},)
    with torch.no_grad():  # decomposed as gjit decomposes (SDPA kept whole)
        return decompose_program(torch.export.export(module, (x,), dynamic_shapes=dims))[0].module()


MASKS = {  # mask -> what the call becomes: is_causal, unmasked, or left with the mask
    "transformers' causal mask": (hf_causal, "causal"),
    "transformers' bidirectional mask": (hf_bidirectional, "no mask"),
    "an additive causal mask": (
        lambda b, s: torch.zeros(s, s).masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf")),
        "causal",
    ),
    "an additive mask of zeros": (lambda b, s: torch.zeros(b, 1, s, s), "no mask"),
    "packed sequences": (lambda b, s: hf_causal(b, s, step=2), "mask"),  # every step 2: one packed each
    "a shifted index": (
        lambda b, s: torch.arange(s)[:, None] >= torch.arange(s)[None, :].clamp(max=s - 1),
        "mask",  # clamp: not looked into
    ),
    "the row before": (
        lambda b, s: position_ids(b, s)[:, None, :, None] - 1 >= position_ids(b, s)[:, None, None, :],
        "mask",
    ),
    "every key but the first": (lambda b, s: (torch.arange(s) >= 1).expand(s, s), "mask"),
}


def _calls(gm):
    return [n for n in gm.graph.nodes if n.target is SDPA]


@pytest.mark.parametrize("case", list(MASKS))
def test_a_mask_proved_causal_or_keeping_every_key_goes(case):
    mask, becomes = MASKS[case]
    torch.manual_seed(0)
    x = torch.randn(3, 7, 32)
    gm = exported(Attention(mask), x)
    expected = gm(x)
    assert proved_masks(gm) == (becomes != "mask")
    (call,) = _calls(gm)
    assert ("attn_mask" in call.kwargs or len(call.args) > 3) == (becomes == "mask"), gm.graph
    assert bool(call.kwargs.get("is_causal")) == (becomes == "causal"), gm.graph
    if becomes != "mask":  # the mask's nodes are gone with it
        assert not [n for n in gm.graph.nodes if n.target in (aten.arange.default, aten.arange.start_step)]
    assert_same(gm(x), expected)


@pytest.mark.parametrize("case", ["transformers' causal mask", "transformers' bidirectional mask"])
def test_the_compiled_call_runs_sdpa_without_the_mask_and_without_its_kernels(case):
    mask, becomes = MASKS[case]
    torch.manual_seed(0)
    model = Attention(mask).requires_grad_(False)
    with gjit.config.scope(matmul="auto"):
        cm, report = check_against_float64(model, torch.randn(3, 7, 32), reference_fn=in_float64(model))
        check_against_float64(cm, torch.randn(2, 11, 32), reference_fn=in_float64(model))  # other sizes
    assert len(cm.entries) == 1
    source = cm.entries[-1].program.graph.wrapper_source
    assert ("is_causal=True" in source) == (becomes == "causal"), source
    assert "attn_mask" not in source and "gjit_additive_mask" not in source, source
    assert [e.op for e in report.externs if "addmm" not in e.op] == [str(SDPA)], report
    assert not [k for k in report.kernels if "arange" in k.name or "cumsum" in k.name], report


def in_float64(model):
    return copy.deepcopy(model).double()


@pytest.mark.parametrize("interpret", [True, False], ids=["kernels", "fallback interpreter"])
def test_the_calls_output_is_put_in_the_layout_traced_with_the_mask(interpret, request):
    """Without its mask ATen may pick a kernel whose output has another layout than the one export
    traced: the wrapper (and the eager fallback interpreter) copy it into the traced one, which the
    program's views and kernels read."""
    torch.manual_seed(0)
    model = Attention(hf_causal).requires_grad_(False)
    x = torch.randn(3, 7, 32)
    expected, reference = model(x), in_float64(model)(x.double())
    with gjit.config.scope(interpret=True, matmul="auto"):
        cm = gjit.compile(model)
        cm(x)  # compiled with ATen's own kernel
    source = cm.entries[-1].program.graph.wrapper_source
    assert "is_causal=True" in source and "gjit_written_out" in source, source
    request.getfixturevalue("contiguous_output")
    assert SDPA(*(torch.randn(3, 2, 7, 16) for _ in "qkv")).is_contiguous()
    eager_before = gjit.stats()["eager_runs"]
    with gjit.config.scope(interpret=interpret):
        got = cm(x)
    assert gjit.stats()["eager_runs"] == eager_before
    assert_same(got, expected, reference)


def test_gpt2_generate_runs_its_prefill_causal_and_its_decode_steps_unmasked():
    """transformers' GPT-2 under generate(): the prompt's mask is proved causal, each step's (one
    query after the cache) to keep every key; the tokens are eager's."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 128, (2, 7))
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        model.forward = gjit.compile(model.forward)
        with gjit.config.scope(interpret=True, debug=True, matmul="auto"):
            got = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(got, expected)
    prefill, decode = (e.program.graph.wrapper_source for e in model.forward.entries)
    for source in (prefill, decode):
        assert "torch.nn.functional.scaled_dot_product_attention" in source, source
        assert "attn_mask" not in source and "gjit_additive_mask" not in source, source
    assert "is_causal=True" in prefill and "is_causal" not in decode


def eager_attention(mask):
    """transformers' eager attention: its mask as `where(keep, 0, finfo.min)` added to the scaled
    scores (`mask(b, s)` the boolean one, or a float one added as it is)."""

    def attention(q, k, v):
        keep = mask(q.shape[0], q.shape[2])
        if keep.dtype == torch.bool:
            keep = torch.where(keep, torch.zeros((), dtype=q.dtype), torch.finfo(q.dtype).min)
        return torch.matmul((torch.matmul(q, k.mT) * 0.25 + keep).softmax(-1), v)

    return attention


@pytest.mark.parametrize(
    "case", ["transformers' causal mask", "transformers' bidirectional mask", "an additive mask of zeros"]
)
def test_written_out_attention_with_a_proved_mask_is_one_sdpa_call_without_it(case):
    """On a GPU, the written-out form's SDPA call (gjit/lowering/attention_library.py) takes the
    same proofs: causal, or no mask."""
    from gjit.lowering.attention_call import written_out_as_sdpa

    mask, becomes = MASKS[case]

    class Module(torch.nn.Module):
        def forward(self, q, k, v):
            return eager_attention(mask)(q, k, v)

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 7, 16) for _ in "qkv")
    dims = tuple({0: torch.export.Dim.AUTO, 2: torch.export.Dim.AUTO} for _ in "qkv")
    with torch.no_grad():
        gm = decompose_program(torch.export.export(Module(), (q, k, v), dynamic_shapes=dims))[0].module()
    expected = gm(q, k, v)
    assert written_out_as_sdpa(gm) == 1
    (call,) = _calls(gm)
    assert "attn_mask" not in call.kwargs, gm.graph
    assert bool(call.kwargs.get("is_causal")) == (becomes == "causal"), gm.graph
    assert_same(gm(q, k, v), expected, Module()(*(t.double() for t in (q, k, v))))


def test_a_mask_that_widens_the_output_is_left_as_it_is():
    """A mask of more batches than the queries: eager raises; the call keeps it (without it ATen
    would give fewer batches than the program's value holds)."""

    class Widened(torch.nn.Module):
        def forward(self, q, k, v):
            n = q.shape[-2]
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=torch.ones(n, n, dtype=torch.bool).tril().expand(3, 1, n, n)
            )

    q = k = v = torch.randn(1, 2, 5, 8)
    with pytest.raises(RuntimeError):
        Widened()(q, k, v)
    with torch.no_grad():
        gm = decompose_program(torch.export.export(Widened(), (q, k, v)))[0].module()
    assert proved_masks(gm) == 0


def test_a_size_that_may_be_0_is_not_taken_as_positive():
    """`arange(L) + P >= 1` keeps every key where P >= 1, not at P == 0 (row 0 then keeps none):
    sympy takes export's size symbols as positive whatever their range, so a proof reads the range
    from the shape environment (gjit's guards hold each size to it: 2 and up, or 1 for some)."""
    from torch.utils._sympy.value_ranges import ValueRanges

    class Offset(torch.nn.Module):
        def forward(self, q, k, v, cache):
            rows = q.shape[2]
            keep = (torch.arange(rows)[:, None] + cache.shape[0] >= 1).expand(rows, k.shape[2])
            return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)

    q, k, v = (torch.randn(1, 2, 5, 8) for _ in "qkv")
    rows = torch.export.Dim("rows", min=2)
    dims = ({2: rows}, {2: rows}, {2: rows}, {0: torch.export.Dim("past", min=0)})
    for least, proved in ((0, 0), (1, 1)):
        gm = torch.export.export(Offset(), (q, k, v, torch.randn(3)), dynamic_shapes=dims).module()
        cache = gm.graph.find_nodes(op="placeholder")[3]
        (past,) = [n.meta["val"] for n in gm.graph.nodes if n.args[:2] == (cache, 0)]  # its size
        past.node.shape_env.var_to_range[past.node.expr] = ValueRanges(least, sympy.oo)
        assert proved_masks(gm) == proved
        assert_same(gm(q, k, v, torch.randn(3)), Offset()(q, k, v, torch.randn(3)))


def test_a_boolean_tril_added_to_the_scores_is_no_causal_mask():
    """`scores + tril(ones(bool))` adds 1 where j <= i (eager promotes the bool): not the causal
    mask, whatever the proof says of the boolean tensor."""
    from gjit.lowering.attention_call import written_out_as_sdpa

    class Added(torch.nn.Module):
        def forward(self, q, k, v):
            keep = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).tril()
            return torch.matmul((torch.matmul(q, k.mT) * 0.25 + keep).softmax(-1), v)

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 7, 16) for _ in "qkv")
    dims = tuple({2: torch.export.Dim.AUTO} for _ in "qkv")
    with torch.no_grad():
        gm = decompose_program(torch.export.export(Added(), (q, k, v), dynamic_shapes=dims))[0].module()
    expected = gm(q, k, v)
    written_out_as_sdpa(gm)
    assert not any(call.kwargs.get("is_causal") for call in _calls(gm)), gm.graph
    assert_same(gm(q, k, v), expected)


@pytest.mark.parametrize("mask", ["zeros", "causal"])
def test_a_float64_mask_added_keeps_the_written_out_form(mask):
    """A float64 mask added to float32 scores makes the softmax float64, as a cast to float64
    would, which the written-out form keeps: proved or not, the attention stays as it is."""
    from gjit.lowering.attention_call import written_out_as_sdpa

    class Added(torch.nn.Module):
        def forward(self, q, k, v):
            n = q.shape[1]
            m = torch.zeros(n, n, dtype=torch.float64)
            if mask == "causal":
                m = m.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
            return torch.bmm((torch.bmm(q, k.transpose(1, 2)) * 0.25 + m).softmax(-1).float(), v)

    q, k, v = (torch.randn(4, 7, 16) for _ in "qkv")
    dims = tuple({1: torch.export.Dim.AUTO} for _ in "qkv")
    with torch.no_grad():
        gm = decompose_program(torch.export.export(Added(), (q, k, v), dynamic_shapes=dims))[0].module()
    assert written_out_as_sdpa(gm) == 0
