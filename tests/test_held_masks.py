"""Masks read from a buffer or a constant tensor (gjit/lowering/held_masks.py): minGPT's `bias`, a
`tril` registered once and sliced per call. Their contents are read at compile time, a causal one
makes the call causal with no mask, and the entry's guard reads them again where the tensor may have
changed: an in-place write, a new tensor, another process's module (the on-disk cache, a package)."""

import copy
import math

import pytest
import sympy
import torch
import torch.nn.functional as F
from test_attention_library import TwoMinGPTLayers, as_on_a_gpu  # noqa: F401 - a fixture

import gjit
from gjit.lowering import held_masks
from gjit.lowering.held_masks import Band, band_of
from helpers import assert_same, check_against_float64, run_compiled

pytestmark = [pytest.mark.cpu]
SDPA = "aten.scaled_dot_product_attention.default"


def ones(n, m=None, dtype=torch.bool):
    return torch.ones(n, n if m is None else m, dtype=dtype)


def additive(n):
    return torch.zeros(n, n).masked_fill(ones(n).triu(1), -math.inf)


BANDS = {  # tensor -> its band as (offset, inside, outside), or None: not a band
    "tril, bool": (ones(6).tril(), (0, True, False)),
    "tril of ones, float": (ones(6, dtype=torch.float32).tril().view(1, 1, 6, 6), (0, 1.0, 0.0)),
    "triu(1) is the complement": (ones(6).triu(1), (0, False, True)),
    "additive, -inf above": (
        torch.zeros(5, 5).masked_fill(ones(5).triu(1), float("-inf")),
        (0, 0.0, float("-inf")),
    ),
    "tril(-1): no key in row 0": (ones(6).tril(-1), (-1, True, False)),
    "tril(2)": (ones(4, 7, dtype=torch.int64).tril(2), (2, 1, 0)),
    "rectangular, fp16": (ones(3, 8, dtype=torch.float16).tril(), (0, 1.0, 0.0)),
    "ones": (ones(4), (0, True, True)),
    "transposed tril is triu": (ones(6).tril().t(), (-1, False, True)),  # its contents, not its strides
    "a padding pattern": (torch.tensor([[1, 1, 0], [1, 1, 0], [1, 1, 0]], dtype=torch.bool), None),
    "a sliding window": (ones(6).tril() & ones(6).triu(-2), None),
    "-0.0 and 0.0, two values": (torch.zeros(4, 4).masked_fill(ones(4).triu(1), -0.0), (0, 0.0, -0.0)),
    "NaN": (torch.zeros(4, 4).masked_fill(ones(4).triu(1), float("nan")), None),
    "batched": (ones(6).tril().expand(2, 6, 6), None),
    "one dim": (torch.ones(6, dtype=torch.bool), None),
    "one row": (ones(1, 8).tril(), None),
    "complex": (ones(4, dtype=torch.complex64), None),
}


@pytest.mark.parametrize("case", list(BANDS))
def test_a_band_is_read_bit_for_bit(case):
    t, expected = BANDS[case]
    band = band_of(t)
    if expected is None:
        assert band is None, band
        return
    assert band is not None
    assert (band.offset, band.inside, band.outside) == expected
    assert band.holds(t) and band.holds(t.contiguous()) and not band.holds(t.to(torch.float64))
    assert Band.from_record(band.record()) == band
    value = band.value()  # the proofs' value: each element, by its indices
    rows, cols = t.shape[-2:]
    for i in range(rows):
        for j in range(cols):
            at = dict(zip([s for s in value.dims if s is not None], [i, j]))
            got = value.expr.xreplace(at)
            element = t.reshape(rows, cols)[i, j].item()
            if got in (sympy.true, sympy.false):
                assert bool(got) == bool(element), (i, j)
            else:
                assert float(got) == element, (i, j)


def test_what_is_not_read(monkeypatch):
    assert band_of(ones(4).tril()) is not None
    monkeypatch.setattr(held_masks, "MAX_ELEMENTS", 15)  # more elements than this: not read
    assert band_of(ones(4).tril()) is None
    monkeypatch.undo()
    with torch.inference_mode():
        made_in_inference = ones(4).tril()  # no version counter: a write could not be seen
    assert band_of(made_in_inference) is None
    band = band_of(ones(4).tril())
    assert not band.holds(ones(5).tril()) and not band.holds(None) and not band.holds(ones(4).triu())


class HeldMask(torch.nn.Module):
    """SDPA with a mask sliced from a buffer (`kind`: registered, or a plain tensor attribute, which
    export lifts as a constant)."""

    def __init__(self, mask, kind="buffer", width=16):
        super().__init__()
        if kind == "buffer":
            self.register_buffer("mask", mask)
        else:
            self.mask = mask
        self.qkv = torch.nn.Linear(width, 3 * width)

    def forward(self, x):
        b, t, w = x.shape
        q, k, v = (y.view(b, t, 2, -1).transpose(1, 2) for y in self.qkv(x).split(w, -1))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask[:t, :t])


CALLS = {  # mask -> what the SDPA call becomes
    "a causal buffer": (lambda: ones(32).tril(), "causal"),
    "an additive causal buffer": (
        lambda: torch.zeros(32, 32).masked_fill(ones(32).triu(1), -math.inf),
        "causal",
    ),
    "a buffer of ones": (lambda: ones(32), "no mask"),
    "tril(-1)": (lambda: ones(32).tril(-1), "mask"),
    "a sliding window": (lambda: ones(32).tril() & ones(32).triu(-3), "mask"),
}


def wrapper(cm, entry=-1):
    return cm.entries[entry].program.graph.wrapper_source


def reads_the_mask(cm, entry=-1):
    """Whether the entry's wrapper reads the mask (more than the unpacking of its arguments)."""
    return wrapper(cm, entry).count("_mask") > 1


HELD_CALLS = [(case, "buffer", matmul) for case in CALLS for matmul in ("auto", "template")]


@pytest.mark.parametrize("case,kind,matmul", [*HELD_CALLS, ("a causal buffer", "constant", "auto")])
def test_the_call_is_causal_or_unmasked_where_the_held_mask_is(case, kind, matmul):
    """ATen's SDPA call (the library) is causal or has no mask; the attention template reads no
    mask (its causal bound). A plain tensor attribute is one of the program's constants."""
    mask, becomes = CALLS[case]
    torch.manual_seed(0)
    model = HeldMask(mask(), kind).requires_grad_(False)
    x = torch.randn(3, 7, 16)
    with gjit.config.scope(matmul=matmul):
        cm, report = check_against_float64(model, x, reference_fn=_float64(model))
        check_against_float64(cm, torch.randn(2, 11, 16), reference_fn=_float64(model))  # other sizes
    assert len(cm.entries) == 1
    source = wrapper(cm)
    assert reads_the_mask(cm) == (becomes == "mask"), source
    if matmul == "auto":
        assert ("is_causal=True" in source) == (becomes == "causal"), source
    else:
        assert not report.externs, report
    held = cm.entries[0].program.graph.held
    assert [source[:2] for source in held] == ([] if becomes == "mask" else [[kind, "mask"]])
    guards = cm.entries[0].guards.format()
    assert ("mask holds" in guards) == (becomes != "mask"), guards


def _float64(model):
    return copy.deepcopy(model).double()


def causal_buffer():
    """A HeldMask over a causal bool buffer, and an input."""
    torch.manual_seed(0)
    return HeldMask(ones(32).tril()).requires_grad_(False), torch.randn(3, 7, 16)


def causal_buffer_compiled():
    """causal_buffer's model and input, and the model compiled (checked against float64 once)."""
    model, x = causal_buffer()
    cm, _ = check_against_float64(model, x, reference_fn=_float64(model))
    return model, x, cm


def test_a_write_to_the_mask_recompiles_and_the_guard_says_why():
    model, x, cm = causal_buffer_compiled()
    check_against_float64(cm, x, reference_fn=_float64(model))
    model.mask[5, 2] = False  # in place: the same tensor, memory and strides; a new version
    why = cm.entries[0].guards.failures([x])
    assert any("mask holds True where j - i <= 0" in w and "another pattern" in w for w in why), why
    check_against_float64(cm, x, reference_fn=_float64(model))
    assert len(cm.entries) == 2
    assert not reads_the_mask(cm, 0) and reads_the_mask(cm, 1)
    model.mask[5, 2] = True  # causal again: the first entry serves
    check_against_float64(cm, x, reference_fn=_float64(model))
    assert len(cm.entries) == 2


def test_a_new_tensor_in_the_buffer_is_read_once():
    model, x, cm = causal_buffer_compiled()
    model.mask = ones(32).tril()  # another tensor with the same contents: no recompile
    check_against_float64(cm, x, reference_fn=_float64(model))
    assert len(cm.entries) == 1
    model.mask = ones(32).tril(1)  # one without: a recompile that keeps the mask
    check_against_float64(cm, x, reference_fn=_float64(model))
    assert len(cm.entries) == 2 and reads_the_mask(cm)


def test_mingpt_written_out_runs_the_causal_call(as_on_a_gpu):  # noqa: F811
    """minGPT's masked_fill(bias == 0, -inf), written out: ATen's SDPA call, causal, no mask built."""
    torch.manual_seed(0)
    model = TwoMinGPTLayers().eval()
    q, k, v = (torch.randn(2, 3, 12, 16) for _ in "qkv")
    with gjit.config.scope(matmul="auto"):
        cm, report = check_against_float64(model, q, k, v, reference_fn=model.double())
    assert [e.op for e in report.externs] == [SDPA] * 2, report
    source = wrapper(cm)
    assert source.count("is_causal=True") == 2 and "attn_mask" not in source, source
    assert not report.kernels, report  # no mask's kernel, no softmax
    assert sorted(name for _, name, _ in cm.entries[0].program.graph.held) == ["first.bias", "second.bias"]


def test_the_on_disk_cache_serves_the_entry_only_where_the_mask_holds(tmp_path):
    model, x = causal_buffer()
    with gjit.config.scope(cache=True, cache_dir=str(tmp_path / "cache")):
        check_against_float64(model, x, reference_fn=_float64(model))
        hits = gjit.stats().get("disk_cache_hits", 0)
        warm, _ = check_against_float64(model, x, reference_fn=_float64(model))  # a fresh compile
        assert gjit.stats()["disk_cache_hits"] == hits + 1 and not reads_the_mask(warm)
        with torch.no_grad():
            report = gjit.explain(warm, x)  # lowered and fused again, with the stored proof
        assert not report.externs and len(report.kernels) == 2, report  # a product, the attention
        other = copy.deepcopy(model)
        other.mask = ones(32).tril(1)  # not causal: an entry of its own (the bands are in the key)
        misses = gjit.stats()["disk_cache_misses"]
        cold, _ = check_against_float64(other, x, reference_fn=_float64(other))
        assert gjit.stats()["disk_cache_hits"] == hits + 1
        assert gjit.stats()["disk_cache_misses"] == misses + 1
        assert reads_the_mask(cold) and not cold.entries[0].program.graph.held
        again, _ = check_against_float64(model, x, reference_fn=_float64(model))  # its own entry still
        assert gjit.stats()["disk_cache_hits"] == hits + 2 and not reads_the_mask(again)


def test_a_package_names_the_mask_its_entry_needs(tmp_path):
    model, x, cm = causal_buffer_compiled()
    gjit.save(cm, str(tmp_path / "held.gjit"))
    loaded = gjit.load(str(tmp_path / "held.gjit"), model=model)
    out, _ = run_compiled(loaded, x)
    assert_same(out, model(x), _float64(model)(x.double()))
    model.mask[3, 1] = False
    with pytest.raises(gjit.RecompileError, match="mask holds True where j - i <= 0"):
        run_compiled(loaded, x, expect_eager=None)


class Cached(torch.nn.Module):
    """Attention after a cache of `past` keys: the mask's rows past..past + L of a tril buffer, its
    keys up to past + L."""

    def __init__(self, n=64):
        super().__init__()
        self.register_buffer("mask", ones(n).tril())

    def forward(self, q, k, v):
        length = q.shape[-2]
        past = k.shape[-2] - length
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=self.mask[past : past + length, : past + length]
        )


def test_a_decode_step_after_a_cache_keeps_every_key():
    """One query after the cache reads row `past` of the tril: every key; a prompt after a cache
    (past unknown against L, the rows' start a size difference) keeps its mask."""
    torch.manual_seed(0)
    model = Cached().eval()
    qkv = [torch.randn(2, 3, n, 16) for n in (1, 9, 9)]
    cm, _ = check_against_float64(model, *qkv, reference_fn=model)
    check_against_float64(cm, *[torch.randn(2, 3, n, 16) for n in (1, 13, 13)], reference_fn=model)
    decode = len(cm.entries)
    assert not any(reads_the_mask(cm, e) or "is_causal" in wrapper(cm, e) for e in range(decode))
    check_against_float64(cm, *[torch.randn(2, 3, n, 16) for n in (4, 13, 13)], reference_fn=model)
    assert len(cm.entries) == decode + 1 and reads_the_mask(cm)


def test_new_strides_under_the_same_tensor_are_read_again():
    """`.data = .data.t()` keeps the tensor, its memory and its version: its strides tell."""
    model, x, cm = causal_buffer_compiled()
    model.mask.data = model.mask.data.t()  # triu now
    check_against_float64(cm, x, reference_fn=_float64(model))
    assert len(cm.entries) == 2 and reads_the_mask(cm)


def test_the_knob_keeps_proofs_off_contents():
    """GJIT_HELD_MASKS=0: for a program whose masks change by writes the version counter does not
    see (`.data`, NumPy), no proof reads a buffer."""
    model, x = causal_buffer()
    with gjit.config.scope(held_masks=False):
        cm, _ = check_against_float64(model, x, reference_fn=_float64(model))
    assert reads_the_mask(cm) and not cm.entries[0].program.graph.held
    model.mask.data.fill_(True)  # unseen by the version counter, and no proof read it
    check_against_float64(cm, x, reference_fn=_float64(model))
    assert len(cm.entries) == 1


def test_an_inference_tensor_in_the_buffer_is_a_miss_that_says_so():
    model, x, cm = causal_buffer_compiled()
    with torch.inference_mode():
        model.mask = ones(32).tril()  # the same contents; its writes would not be seen
    why = cm.entries[0].guards.failures([x])
    assert any("inference tensor" in w for w in why), why


class AddedTerm(torch.nn.Module):
    """A causal additive buffer after a second added term: the attention stays written out."""

    def __init__(self, n=16):
        super().__init__()
        self.register_buffer("mask", additive(n))
        self.pos = torch.nn.Parameter(torch.randn(n, n) * 0.1)

    def forward(self, q, k, v):
        t = q.shape[-2]
        att = (q @ k.transpose(-2, -1)) * 0.25 + self.pos[:t, :t]
        return F.softmax(att + self.mask[:t, :t], dim=-1) @ v


def test_a_proof_no_rewrite_used_is_not_guarded(as_on_a_gpu):  # noqa: F811
    torch.manual_seed(0)
    model = AddedTerm().requires_grad_(False)
    qkv = [torch.randn(2, 2, 7, 8) for _ in "qkv"]
    with gjit.config.scope(matmul="auto"):
        cm, report = check_against_float64(model, *qkv, reference_fn=_float64(model))
    assert SDPA not in [e.op for e in report.externs] and not cm.entries[0].program.graph.held, report
