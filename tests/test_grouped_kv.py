"""Grouped-query attention (gjit/lowering/grouped_kv.py): an unmasked SDPA call whose keys and values
are repeated per group of query heads (transformers' `repeat_kv`) reads the groups' tensors with
enable_gqa=True; the copies are gone, and the results are eager's."""

import copy

import pytest
import torch
import torch.nn.functional as F

import gjit
from gjit.capture.decompose import decompose_program
from gjit.lowering.grouped_kv import grouped_kv, packed_queries
from gjit.lowering.proved_masks import proved_masks
from gjit.runtime.graph import FallbackInterpreter
from helpers import assert_same, check_against_float64

pytestmark = [pytest.mark.cpu]
SDPA = torch.ops.aten.scaled_dot_product_attention.default


def repeat_kv(x, n):
    """transformers' repeat_kv: each of the KV heads n times in a row."""
    b, kv, s, d = x.shape
    return x[:, :, None, :, :].expand(b, kv, n, s, d).reshape(b, kv * n, s, d)


class Grouped(torch.nn.Module):
    """SDPA over 4 query heads and 4 / n key/value heads, repeated n times by `repeat`."""

    def __init__(self, repeat=repeat_kv, causal_mask=False, n=2):
        super().__init__()
        self.repeat, self.causal_mask, self.n = repeat, causal_mask, n

    def forward(self, q, k, v):
        mask = None
        if self.causal_mask:  # one a proof drops
            mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        return F.scaled_dot_product_attention(
            q, self.repeat(k, self.n), self.repeat(v, self.n), attn_mask=mask
        )


def inputs(dtype=torch.bfloat16, length=7, dim=16, heads=4, kv=2):
    q = torch.randn(2, heads, length, dim, dtype=dtype)
    return q, *(torch.randn(2, kv, length, dim, dtype=dtype) for _ in "kv")


def exported(module, args):
    dims = tuple({0: torch.export.Dim.AUTO, 2: torch.export.Dim.AUTO} for _ in args)
    with torch.no_grad():
        return decompose_program(torch.export.export(module, args, dynamic_shapes=dims))[0].module()


CASES = {  # module, inputs -> whether the call takes the groups
    "repeat_kv": (Grouped(), inputs(), True),
    "float16": (Grouped(), inputs(torch.float16), True),
    "a causal mask, proved and dropped": (Grouped(causal_mask=True), inputs(), True),
    "one key/value head (no copy: a view of the expand)": (Grouped(n=4), inputs(kv=1), True),
    "float32 (the math path would take it)": (Grouped(), inputs(torch.float32), False),
    "a head dim over 256": (Grouped(), inputs(dim=272), False),
    "tiled, not interleaved": (Grouped(lambda x, n: x.repeat(1, n, 1, 1)), inputs(), False),
    "repeated along another dim": (
        Grouped(
            lambda x, n: x[:, None].expand(x.shape[0], n, *x.shape[1:]).reshape(x.shape[0], -1, *x.shape[2:])
        ),
        inputs(),
        False,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_call_takes_the_groups_where_it_reads_them_repeated(case):
    module, args, takes = CASES[case]
    torch.manual_seed(0)
    gm = exported(module, args)
    expected = gm(*args)
    proved_masks(gm)
    assert grouped_kv(gm) == takes
    (call,) = [n for n in gm.graph.nodes if n.target is SDPA]
    assert bool(call.kwargs.get("enable_gqa")) == takes, gm.graph
    if takes:  # the calls read the placeholders, and the copies are gone
        assert [a.op for a in call.args[1:3]] == ["placeholder"] * 2, gm.graph
        assert not [n for n in gm.graph.nodes if n.target is torch.ops.aten.expand.default], gm.graph
    assert_same(gm(*args), expected)
    other = inputs(args[0].dtype, length=11, dim=args[0].shape[-1], kv=args[1].shape[1])
    assert_same(gm(*other), module(*other))


def test_a_mask_that_stays_keeps_the_copies():
    """With a mask ATen runs its memory-efficient kernel, which takes no groups."""
    args = (*inputs(), torch.rand(2, 1, 7, 7) > 0.3)

    class Padded(torch.nn.Module):
        def forward(self, q, k, v, keep):
            return F.scaled_dot_product_attention(q, repeat_kv(k, 2), repeat_kv(v, 2), attn_mask=keep)

    gm = exported(Padded(), args)
    assert proved_masks(gm) == 0 and grouped_kv(gm) == 0


def test_more_heads_than_a_grid_dim_keep_the_copies():
    """Over 65535 heads the wrapper's call runs in parts of the query's heads, which the groups'
    tensors would not follow."""
    args = inputs(length=3, dim=8, heads=65540, kv=2)
    gm = exported(Grouped(n=32770), args)
    assert grouped_kv(gm) == 0


def test_the_choice_follows_the_card_the_compile_is_for():
    gm = exported(Grouped(), inputs())  # a graph on the CPU
    assert gjit.driver.flash_attention_runs(gm, None)
    assert not gjit.driver.flash_attention_runs(gm, 75) and gjit.driver.flash_attention_runs(gm, 90)


def llama(dtype=torch.bfloat16):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval().to(dtype).requires_grad_(False)


class Logits(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(ids, use_cache=False).logits


def test_llama_reads_its_key_and_value_groups_in_place(monkeypatch):
    torch.manual_seed(0)
    model = Logits(llama())
    ids = torch.randint(0, 128, (2, 7))
    with gjit.config.scope(matmul="auto"):
        cm, report = check_against_float64(model, ids, reference_fn=copy.deepcopy(model).double())
        check_against_float64(cm, torch.randint(0, 128, (3, 10)), reference_fn=copy.deepcopy(model).double())
        source = cm.entries[0].program.graph.wrapper_source
        assert source.count("enable_gqa=True") == 2 and "is_causal=True" in source, source
        monkeypatch.setattr(gjit.driver, "grouped_kv", lambda gm: 0)
        _, without = check_against_float64(model, ids, reference_fn=copy.deepcopy(model).double())
    assert len(report.kernels) < len(without.kernels), (report, without)


@pytest.mark.slow  # (CI's sweep step: 9 s)
def test_a_cached_entry_is_analysed_as_it_was_compiled(tmp_path, monkeypatch):
    """explain of an entry from the disk cache lowers again by the compile's choice (stored with
    it), not by the card of the process that explains it."""
    torch.manual_seed(0)
    model = Logits(llama())
    ids = torch.randint(0, 128, (2, 7))
    with gjit.config.scope(matmul="auto", cache=True, cache_dir=str(tmp_path / "cache")):
        cold, cold_report = check_against_float64(model, ids, reference_fn=copy.deepcopy(model).double())
        warm, _ = check_against_float64(model, ids, reference_fn=copy.deepcopy(model).double())
        assert gjit.stats()["disk_cache_hits"] >= 1 and warm.entries[0].program.graph.grouped_kv
        monkeypatch.setattr(gjit.driver, "flash_attention_runs", lambda gm, target: False)
        with torch.no_grad():
            report = gjit.explain(warm, ids)
    assert [k.name for k in report.kernels] == [k.name for k in cold_report.kernels]


def assert_generates_as_eager(model, ids, **settings):
    """4 greedy tokens of `model.generate` with its forward compiled (kernels interpreted) are eager's."""
    settings = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, **settings)
    with torch.no_grad():
        expected = model.generate(ids, **settings)
        model.forward = gjit.compile(model.forward)
        with gjit.config.scope(interpret=True, debug=True, matmul="auto"):
            got = model.generate(ids, **settings)
    assert torch.equal(got, expected)


def test_llama_generate_decodes_on_the_groups():
    """generate() with the dynamic cache: the prompt and each decode step (the cache's keys and
    values, whole) read the groups; the tokens are eager's."""
    torch.manual_seed(0)
    model = llama()
    ids = torch.randint(0, 128, (2, 7))
    assert_generates_as_eager(model, ids)
    for entry in model.forward.entries:
        source = entry.program.graph.wrapper_source
        assert source.count("enable_gqa=True") == 2, source


@pytest.mark.gpu
def test_on_a_gpu_the_grouped_call_matches_eager():
    """On the card: the call takes the groups (FlashAttention, sm_80 and up), within eager's rounding."""
    torch.manual_seed(0)
    model = Logits(llama()).cuda()
    ids = torch.randint(0, 128, (2, 64), device="cuda")
    with gjit.config.scope(matmul="auto"):
        cm, _ = check_against_float64(model, ids, reference_fn=copy.deepcopy(model).double())
    source = cm.entries[0].program.graph.wrapper_source
    takes = torch.cuda.get_device_capability() >= (8, 0)
    assert (source.count("enable_gqa=True") == 2) == takes, source


class Decoding(torch.nn.Module):
    """One query a head over a cache of 4 / n key/value heads, repeated n times, under `mask`."""

    def __init__(self, mask_kind, n=2):
        super().__init__()
        self.mask_kind, self.n = mask_kind, n

    def forward(self, q, k, v, mask):
        keep = None if self.mask_kind == "none" else mask
        o = F.scaled_dot_product_attention(q, repeat_kv(k, self.n), repeat_kv(v, self.n), attn_mask=keep)
        return o.transpose(1, 2).reshape(q.shape[0], 1, -1)


def decoding_inputs(mask_kind, dtype, length=9, heads=4, kv=2):
    q = torch.randn(2, 1, heads, 16, dtype=dtype).transpose(1, 2)  # a linear layer's, split in heads
    k, v = (torch.randn(2, kv, length, 16, dtype=dtype) for _ in "kv")
    keep = torch.ones(2, 1, 1, length, dtype=torch.bool)
    keep[1, ..., length - 3 :] = False  # the static cache's empty places
    masks = {
        "none": keep,
        "boolean": keep,
        "additive": torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, float("-inf")),
        "per head": torch.randn(2, heads, 1, length, dtype=dtype),  # (an ALiBi-like bias)
    }
    return q, k, v, masks[mask_kind]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mask_kind", ["boolean", "additive", "per head", "none"])
def test_one_query_a_head_reads_the_groups_as_rows(mask_kind, dtype):
    """A decode step: the query heads of a group are the rows of one call on the group's keys and
    values, under its mask (every kernel takes that: the memory-efficient one and float32 too);
    the copies are gone, the results eager's."""
    torch.manual_seed(0)
    module, args = Decoding(mask_kind), decoding_inputs(mask_kind, dtype)
    gm = exported(module, args)
    expected = gm(*args)
    grouped_kv(gm)  # (first, as in the compile: FlashAttention's groups where it takes the call)
    takes = packed_queries(gm) == 1
    assert takes == (mask_kind != "none" or dtype is torch.float32), gm.graph
    if takes:
        (call,) = [n for n in gm.graph.nodes if n.target is SDPA]
        assert [a.op for a in call.args[1:3]] == ["placeholder"] * 2, gm.graph
        assert call.args[0].meta["val"].shape == (2, 2, 2, 16), gm.graph
        assert not [n for n in gm.graph.nodes if n.target is torch.ops.aten.expand.default], gm.graph
        assert_same(FallbackInterpreter(gm).run(*args), expected)
    with gjit.config.scope(matmul="auto"):
        cm, report = check_against_float64(module, *args)
    assert not report.kernels, report  # (no copies: the output's transpose and reshape are views)


def test_a_causal_call_or_more_queries_keep_the_copies():
    """is_causal with one query sees the first key alone (as rows the heads would see more), and
    more queries than one are not the rows of one block."""

    class Causal(torch.nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, repeat_kv(k, 2), repeat_kv(v, 2), is_causal=True)

    q, k, v, mask = decoding_inputs("boolean", torch.float32)
    assert packed_queries(exported(Causal(), (q, k, v))) == 0
    prefill = (torch.randn(2, 4, 3, 16), k, v, mask.expand(2, 1, 3, 9))
    assert packed_queries(exported(Decoding("boolean"), prefill)) == 0


@pytest.mark.slow
def test_llama_generate_with_the_static_cache_decodes_on_the_groups():
    """generate() with transformers' static cache: each decode step's mask is an input (no proof),
    so the call keeps it, and reads the cache's groups in place, the query heads of a group as
    rows; the tokens are eager's."""
    torch.manual_seed(0)
    model = llama()
    ids = torch.randint(0, 128, (2, 7))
    assert_generates_as_eager(model, ids, cache_implementation="static")
    prefill, decode = (entry.program.graph.wrapper_source for entry in model.forward.entries)
    assert prefill.count("enable_gqa=True") == 2, prefill
    calls = [line for line in decode.splitlines() if "gjit_written_out(" in line]
    assert len(calls) == 2 and all("attn_mask=" in c and "enable_gqa" not in c for c in calls), decode
    assert "clone" not in decode and "expand" not in decode, decode


@pytest.mark.gpu
@pytest.mark.parametrize("mask_kind", ["boolean", "additive"])
def test_on_a_gpu_a_decode_step_reads_the_groups_as_rows(mask_kind):
    """On the card (the memory-efficient kernel with the mask): eager's values within its rounding."""
    torch.manual_seed(0)
    args = tuple(t.cuda() for t in decoding_inputs(mask_kind, torch.bfloat16, length=300, heads=32, kv=4))
    with gjit.config.scope(matmul="auto"):
        cm, report = check_against_float64(Decoding(mask_kind, n=8), *args)
    assert not report.kernels, report
