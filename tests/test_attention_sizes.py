"""SDPA's sizes made one symbol (gjit/capture/attention_sizes.py): a cache's keys and values of one
length, a mask's key dim of the keys' length, checked by the guard, on a cold and a warm start."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

import gjit
from helpers import check, run_compiled

pytestmark = pytest.mark.cpu


def decode_step(q, k_cache, v_cache, kv):
    """A decode step over a dynamic cache: the step's key and value (one projection's halves, as
    GPT-2's) appended, then attention."""
    k = torch.cat([k_cache, kv[..., :16]], 2)
    v = torch.cat([v_cache, kv[..., 16:]], 2)
    return F.scaled_dot_product_attention(q, k, v), k, v


def step_inputs(length: int, v_length: int | None = None, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q, kv = torch.randn(2, 4, 1, 16, generator=g), torch.randn(2, 4, 1, 32, generator=g)
    k_cache = torch.randn(2, 4, length, 16, generator=g)
    v_cache = torch.randn(2, 4, length if v_length is None else v_length, 16, generator=g)
    return q, k_cache, v_cache, kv


def symbols(cm: gjit.CompiledFunction) -> list[str]:
    return sorted(map(str, cm.entries[-1].program.symbols))


def test_a_caches_keys_and_values_take_one_length_and_one_kernel():
    cm = gjit.compile(decode_step, dynamic=True)
    with gjit.config.scope(matmul="auto"):  # SDPA ATen's call
        check(cm, *step_inputs(5), kernels=1)  # both appends in one kernel: they read one projection
    # batch, heads and one length (the head dims are the slices'): the values' length is the keys'
    assert len(symbols(cm)) == 3, symbols(cm)
    assert "in2_size[2] == " in cm.entries[-1].guards.source  # checked, not assumed
    with gjit.config.scope(matmul="auto"):
        check(cm, *step_inputs(9, seed=1), kernels=1)
    assert len(cm.entries) == 1, "another length of both is the same entry"


def test_keys_and_values_of_other_lengths_are_not_served_by_the_entry():
    cm = gjit.compile(decode_step, dynamic=True)
    check(cm, *step_inputs(5))
    before = gjit.stats().get("recompiles", 0)
    # outside SDPA's contract (eager's CPU kernel reads the values over the keys' length): only
    # that the entry refuses it is checked
    out, _ = run_compiled(cm, *step_inputs(6, v_length=8, seed=2))
    assert len(cm.entries) == 2 and gjit.stats().get("recompiles", 0) == before + 1
    assert out[1].shape[2] == 7 and out[2].shape[2] == 9


class MaskedStep(torch.nn.Module):
    """A mask over the keys handed in as an input of its own length (a padding mask grown a step)."""

    def forward(self, q, k_cache, v_cache, kv, keep):
        k, v = torch.cat([k_cache, kv[..., :16]], 2), torch.cat([v_cache, kv[..., 16:]], 2)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])


def test_a_masks_key_dim_takes_the_keys_length():
    q, k_cache, v_cache, kv = step_inputs(6, seed=3)
    keep = torch.rand(2, 7, generator=torch.Generator().manual_seed(4)) > 0.3
    keep[:, -1] = True
    cm = gjit.compile(MaskedStep(), dynamic=True)
    check(cm, q, k_cache, v_cache, kv, keep)
    assert len(symbols(cm)) == 3, symbols(cm)  # batch, heads, one length
    keep = torch.ones(2, 11, dtype=torch.bool)
    check(cm, *step_inputs(10, seed=5), keep)
    assert len(cm.entries) == 1


class BiasedStep(torch.nn.Module):
    def forward(self, q, k_cache, v_cache, kv, bias):
        k, v = torch.cat([k_cache, kv[..., :16]], 2), torch.cat([v_cache, kv[..., 16:]], 2)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)


def test_a_mask_that_broadcasts_over_the_keys_keeps_its_size():
    """A mask of one column broadcasts: no size is made equal to it, and none specialized."""
    q, k_cache, v_cache, kv = step_inputs(6, seed=6)
    bias = torch.randn(2, 1, 1, 1)
    cm = gjit.compile(BiasedStep(), dynamic=True)
    check(cm, q, k_cache, v_cache, kv, bias)
    check(cm, *step_inputs(3, seed=7), bias)
    assert len(cm.entries) == 1


@pytest.fixture
def disk_cache(tmp_path):
    with gjit.config.scope(cache=True, cache_dir=str(tmp_path / "cache")):
        yield


def test_a_warm_start_keeps_the_guard_on_the_lengths(disk_cache):
    cold = gjit.compile(decode_step, dynamic=True)
    check(cold, *step_inputs(5))
    hits = gjit.stats().get("disk_cache_hits", 0)
    warm = gjit.compile(decode_step, dynamic=True)
    check(warm, *step_inputs(5))
    assert gjit.stats().get("disk_cache_hits", 0) == hits + 1
    cats = [k for k in gjit.explain(warm, *step_inputs(7)).kernels if "cat" in k.name]
    assert len(cats) == 1, cats
    # the lengths checked (as the appends' sizes: decomposition's shape guard)
    assert re.search(r"\(s\d+ \+ 1\) == \(s\d+ \+ 1\)", warm.entries[0].guards.source)
    out, _ = run_compiled(warm, *step_inputs(6, v_length=8, seed=2))
    assert len(warm.entries) == 2, "the warm entry must refuse keys and values of other lengths"
    assert out[1].shape[2] == 7 and out[2].shape[2] == 9


class Step(torch.nn.Module):
    def forward(self, q, k_cache, v_cache, kv):
        return decode_step(q, k_cache, v_cache, kv)


def test_a_package_written_after_a_warm_start_checks_the_lengths(disk_cache, tmp_path):
    """The warm start's guards are in its own export's symbols; the package keeps the stored
    program, whose keys and values share one: the package's guards are renamed to it (it once
    named a symbol nothing bound, and the package did not load)."""
    model = Step()
    check(gjit.compile(model, dynamic=True), *step_inputs(5))
    warm = gjit.compile(model, dynamic=True)
    check(warm, *step_inputs(5))
    assert gjit.stats().get("disk_cache_hits", 0) >= 1
    path = str(tmp_path / "step.gjit")
    gjit.save(warm, path)
    loaded = gjit.load(path, model=model)
    check(loaded, *step_inputs(9, seed=3))
    assert "in2_size[2] == " in loaded.entries[0].guards.source
    with pytest.raises(gjit.RecompileError):
        run_compiled(loaded, *step_inputs(6, v_length=8, seed=2), expect_eager=None)
