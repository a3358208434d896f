"""gjit/lowering/causal.py: which masks a program builds from its sizes are proved the causal one
(a key j kept for query i exactly where j <= i, for every size), and which are not."""

import math

import pytest
import torch

from gjit.lowering.causal import adds_nothing, is_causal, is_causal_additive, keeps_every_key

pytestmark = [pytest.mark.cpu]


def mask_node(fn, rows=8, keys=8):
    """The output node of `fn(x)` exported with x [2, rows, keys] (rows dynamic), decomposed."""

    class Module(torch.nn.Module):
        def forward(self, x):
            return (fn(x),)

    x = torch.randn(2, rows, keys)
    ep = torch.export.export(Module(), (x,), dynamic_shapes=({1: torch.export.Dim.AUTO},))
    gm = ep.run_decompositions().graph_module
    (out,) = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
    expected = fn(x)
    return out, expected


def rows_keys(x):
    return torch.arange(x.shape[1])[:, None], torch.arange(x.shape[2])[None, :]


def ahead(x):
    """(keys up to one past the row, the causal keys): where() picks the first where torch's
    arithmetic takes its condition as true."""
    rows, keys = rows_keys(x)
    return keys <= rows + 1, keys <= rows


def one_arange_two_dims(x):
    idx = torch.arange(x.shape[1])
    return idx[None, :] <= idx[:, None]


def diagonal_through_one_arange(x):
    idx = torch.arange(x.shape[1])
    return (idx[None, :] <= idx[:, None]) & (idx[None, :] >= idx[:, None])


BOOLEAN = {  # mask -> (the value where a key is kept, whether that is the causal mask, proved so)
    "triu hides": (lambda x: torch.ones(x.shape[1], x.shape[2], dtype=torch.bool).triu(1), False, True),
    "triu keeps": (lambda x: torch.ones(x.shape[1], x.shape[2], dtype=torch.bool).triu(1), True, False),
    "tril of ones == 0": (lambda x: torch.tril(torch.ones(x.shape[1], x.shape[2])) == 0, False, True),
    "tril keeps": (lambda x: torch.ones(x.shape[1], x.shape[2], dtype=torch.bool).tril(), True, True),
    "tril viewed 4-D": (
        lambda x: (
            torch.ones(x.shape[1], x.shape[2], dtype=torch.bool).tril().view(1, 1, x.shape[1], x.shape[2])
        ),
        True,
        True,
    ),
    "aranges compared": (lambda x: rows_keys(x)[1] <= rows_keys(x)[0], True, True),
    "one arange along two dims": (one_arange_two_dims, True, True),
    "tril(1)": (lambda x: torch.ones(x.shape[1], x.shape[2], dtype=torch.bool).tril(1), True, False),
    "an offset": (lambda x: rows_keys(x)[1] <= rows_keys(x)[0] + 1, True, False),
    "rows only": (lambda x: (rows_keys(x)[0] >= 0).expand(x.shape[1], x.shape[2]), True, False),
    "a band": (
        lambda x: (rows_keys(x)[1] <= rows_keys(x)[0]) & (rows_keys(x)[1] > rows_keys(x)[0] - 3),
        True,
        False,
    ),
    "the diagonal through one arange": (diagonal_through_one_arange, True, False),
    "transposed": (
        lambda x: torch.ones(x.shape[1], x.shape[2], dtype=torch.bool).triu().mT,
        True,
        True,
        False,
    ),
    "an input": (lambda x: (x[0] > 0) | (rows_keys(x)[1] <= rows_keys(x)[0]), True, False),
    "an index cast to bool": (
        lambda x: torch.arange(x.shape[2]).bool()[None, :] <= rows_keys(x)[0],
        True,
        False,
    ),
    "indices through float16": (
        lambda x: torch.arange(1, x.shape[2] + 1).half()[None, :] <= (rows_keys(x)[0] + 1).half(),
        True,
        True,
        False,  # exact at these sizes, not past 2048
    ),
    "row 0's keys for every row": (
        lambda x: (
            torch.ones(x.shape[1], x.shape[2], dtype=torch.bool).tril()[:1].expand(x.shape[1], x.shape[2])
        ),
        True,
        False,
    ),
    "a float32 constant that rounds": (
        lambda x: torch.where(rows_keys(x)[1] <= rows_keys(x)[0], 1.0, 1.00000001) == 1,
        True,
        False,
    ),
    "a number compared in float32": (
        lambda x: torch.where(rows_keys(x)[1] <= rows_keys(x)[0], 1.0, 0.0) > 0.99999999,  # 1.0 > 1.0
        True,
        False,
    ),
    "indices compared in float16": (
        lambda x: rows_keys(x)[1] - rows_keys(x)[0] + 4096 <= torch.full((), 4096.0, dtype=torch.float16),
        True,
        False,  # 4097 is 4096 in float16
    ),
    "an int64 constant compared exactly": (
        lambda x: (
            torch.where(
                rows_keys(x)[1] <= rows_keys(x)[0],
                torch.full((), 2.0**60, dtype=torch.long),
                torch.zeros((), dtype=torch.long),
            )
            == 2**60 + 1
        ),
        True,
        False,
    ),
    "a float64 constant past 2**53": (
        lambda x: torch.where(torch.full(x.shape[1:], 2**53 + 1, dtype=torch.float64) == 2**53, *ahead(x)),
        True,
        False,
    ),
    "int64 arithmetic that wraps": (
        lambda x: torch.where(torch.full(x.shape[1:], -(2**63)) - 1 < 0, *reversed(ahead(x))),
        True,
        False,
    ),
    "a float64 product that underflows": (
        lambda x: torch.where(
            torch.full(x.shape[1:], 2.0**-600, dtype=torch.float64) * 2.0**-600 == 0, *ahead(x)
        ),
        True,
        False,
    ),
    "a select's arithmetic": (lambda x: torch.tril(torch.ones(x.shape[1], x.shape[2])) + 1 >= 2, True, True),
}


@pytest.mark.parametrize("case", list(BOOLEAN))
def test_a_boolean_mask_is_proved_causal_only_where_it_is(case):
    """Proved only where it is causal; unproved (and left a mask) where the proof does not reach:
    a transpose, indices through float16."""
    fn, keep, causal, *proved = BOOLEAN[case]
    proved = proved[0] if proved else causal
    node, mask = mask_node(fn)
    truth = torch.ones(8, 8, dtype=torch.bool).tril()
    assert torch.equal(mask.expand(8, 8, 8, 8)[0, 0] == keep, truth) == causal  # what the cases say
    assert is_causal(node, keep) == proved


@pytest.mark.parametrize(
    "fn, causal",
    [
        (lambda x: torch.triu(torch.full((x.shape[1], x.shape[2]), float("-inf")), 1), True),
        (lambda x: torch.triu(torch.full((x.shape[1], x.shape[2]), float("-inf")), 0), False),
        (lambda x: torch.triu(torch.full((x.shape[1], x.shape[2]), -1e30), 1), False),
        (lambda x: torch.where(rows_keys(x)[1] <= rows_keys(x)[0], 0.0, float("-inf")), True),
        (lambda x: torch.triu(torch.full((x.shape[1], x.shape[2]), float("-inf")), 1) * 2, False),  # unproved
        (lambda x: torch.triu(torch.full((x.shape[1], x.shape[2]), float("-inf")), 1) * 2 + 1, False),
        (lambda x: torch.triu(torch.full((x.shape[1], x.shape[2]), float("-inf")), 1) * 0, False),  # NaN
    ],
    ids=["triu of -inf", "the diagonal too", "a finite fill", "where", "scaled", "two added", "times 0"],
)
def test_an_additive_mask_is_causal_where_it_is_zero_and_minus_inf(fn, causal):
    """0 where kept and -inf elsewhere exactly; arithmetic on the mask is not looked into (and
    raises nothing)."""
    node, _ = mask_node(fn)
    assert is_causal_additive(node) == causal


def test_more_keys_than_queries_is_the_top_left_mask():
    node, _ = mask_node(lambda x: torch.ones(x.shape[1], x.shape[2], dtype=torch.bool).tril(), rows=5, keys=9)
    assert is_causal(node, True)


def positions(x, step=1):
    """transformers' position ids: [B, L], expanded from one arange."""
    return (torch.arange(x.shape[1]) * step)[None].expand(x.shape[0], -1)


def indices(x):
    """Index tensors over the batch, the queries and the keys, as masking_utils broadcasts them."""
    length = x.shape[1]
    return (torch.arange(x.shape[0])[:, None, None, None], torch.arange(length)[None, None, :, None],
            torch.arange(length)[None, None, None, :])  # fmt: skip


def gathered(x, ids):
    """`kv_idx <= q_idx` on position ids gathered by index tensors (transformers' masking_utils
    under tracing), and-ed with its check that no sequence is packed."""
    b, q_idx, kv_idx = indices(x)
    packed = (torch.diff(ids, dim=-1, prepend=ids[:, :1] - 1) != 1).cumsum(-1)
    return (ids[b, kv_idx] <= ids[b, q_idx]) & (packed[b, q_idx] == packed[b, kv_idx])


def one_back(x):
    b, q_idx, kv_idx = indices(x)
    return positions(x)[b, q_idx] - 1 >= positions(x)[b, kv_idx]


def one_more_less_one(x):
    b, q_idx, kv_idx = indices(x)
    return positions(x)[b, kv_idx + 1 - 1] <= positions(x)[b, q_idx]


def after_a_part_of_unknown_size(x):
    ids = torch.cat([positions(x), positions(x)], -1)
    return ids[:, None, None, : x.shape[1]] <= positions(x)[:, None, :, None]


def running_sum_of_ones(x):
    ones = torch.ones(x.shape[1], x.shape[1], dtype=torch.long)
    return ones.cumsum(-1) <= torch.arange(1, x.shape[1] + 1)[:, None]


def tril(x):
    return torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()


GATHERED = {  # mask of [B, 1, L, L] -> (whether it is the causal one, proved so)
    "transformers' causal mask": (lambda x: gathered(x, positions(x)), True),
    "packed: steps of 2": (lambda x: gathered(x, positions(x, 2)), False),
    "ids read one back": (one_back, False),
    "after a part of a size not known": (
        after_a_part_of_unknown_size,
        True,
        False,  # the select on the size is not looked into
    ),
    "one more than an index, less one": (one_more_less_one, True),
    "a running sum of ones": (running_sum_of_ones, True),
    "ids from the input": (lambda x: gathered(x, x[..., 0].long().abs() % x.shape[1]), False),
    "a first column and the rest": (
        lambda x: torch.cat([torch.ones(x.shape[1], 1, dtype=torch.bool), tril(x)[:, 1:]], -1),
        True,
        False,  # its select is on the key alone (j < 1): not looked into
    ),
    "a first row and the rest": (
        lambda x: torch.cat([torch.arange(x.shape[1])[None, :] <= 0, tril(x)[1:]], 0),
        True,
        False,  # the same, on the row
    ),
}


@pytest.mark.parametrize("case", list(GATHERED))
def test_masks_gathered_by_index_tensors_cat_and_cumsum(case):
    """Index tensors in bounds, a cat of parts of known sizes and a running sum of a value that is
    zero or the same along its dim are taken (not a part of a size not known); a packed sequence,
    an input, an index one back are not the causal mask."""
    fn, causal, *proved = GATHERED[case]
    node, mask = mask_node(fn, rows=8, keys=8)
    truth = torch.ones(8, 8, dtype=torch.bool).tril()
    assert torch.equal(mask.expand(2, 1, 8, 8)[0, 0], truth) == causal
    assert is_causal(node, True) == (proved[0] if proved else causal)


@pytest.mark.parametrize(
    "fn, keeps",
    [
        (lambda x: (torch.arange(x.shape[1])[None, None, :, None] >= 0).expand(2, 1, -1, x.shape[1]), True),
        (lambda x: (torch.arange(x.shape[1])[None, :] >= 1).expand(x.shape[1], x.shape[1]), False),
        (lambda x: torch.ones(x.shape[1], x.shape[2], dtype=torch.bool), True),
        (lambda x: gathered(x, positions(x)), False),
        (lambda x: x > -1e30, False),  # true on this input, not proved for every input
    ],
    ids=["an index at least 0", "at least 1", "ones", "causal", "an input"],
)
def test_a_mask_that_keeps_every_key(fn, keeps):
    node, mask = mask_node(fn)
    assert keeps_every_key(node) == keeps
    assert not keeps_every_key(node, keep=False)


@pytest.mark.parametrize(
    "fn, nothing",
    [
        (lambda x: torch.zeros(x.shape[1], x.shape[2]), True),
        (lambda x: torch.where(torch.arange(x.shape[1])[:, None] >= 0, 0.0, -math.inf).expand(-1, 8), True),
        (lambda x: torch.triu(torch.full((x.shape[1], x.shape[2]), float("-inf")), 1), False),
        (lambda x: torch.zeros(x.shape[1], x.shape[2]) * x[0], False),
    ],
    ids=["zeros", "a select of 0", "causal", "times an input"],
)
def test_an_additive_mask_that_adds_nothing(fn, nothing):
    node, _ = mask_node(fn)
    assert adds_nothing(node) == nothing


def decode_mask(offset):
    """One query after `past` keys in a cache: `kv_idx <= past + q_idx + offset` over the keys
    (past + 1 of them), its sizes and past symbolic, as transformers builds it under export."""

    class Module(torch.nn.Module):
        def forward(self, keys):
            past = keys.shape[1] - 1
            q_idx = torch.arange(1) + past
            return (torch.arange(past + 1)[None, None, None, :] <= q_idx[None, None, :, None] + offset,)

    keys = torch.randn(2, 9)
    ep = torch.export.export(Module(), (keys,), dynamic_shapes=({1: torch.export.Dim.AUTO},))
    (out,) = [n for n in ep.run_decompositions().graph_module.graph.nodes if n.op == "output"][0].args[0]
    return out, Module()(keys)[0]


@pytest.mark.parametrize("offset, keeps", [(0, True), (1, True), (-1, False)])
def test_one_query_after_a_cache_keeps_every_key(offset, keeps):
    """The keys' range is their size's (past + 1): the last key is past, kept where offset >= 0."""
    node, mask = decode_mask(offset)
    assert bool(mask.all()) == keeps
    assert keeps_every_key(node) == keeps


@pytest.mark.parametrize("shift, keeps", [(0, True), (-1, False)])
def test_rows_sliced_from_a_size_after_a_cache(shift, keeps):
    """`tril[past + shift : past + shift + 1, : past + 1]`: a slice that starts at a size (a
    cache's length), its row past for shift 0, every key of past + 1."""

    class Module(torch.nn.Module):
        def forward(self, keys):
            past = keys.shape[1] - 1
            full = torch.ones(keys.shape[1] + 4, keys.shape[1] + 4, dtype=torch.bool).tril()
            return (full[past + shift : past + shift + 1, : past + 1],)

    keys = torch.randn(2, 9)
    ep = torch.export.export(Module(), (keys,), dynamic_shapes=({1: torch.export.Dim.AUTO},))
    (out,) = [n for n in ep.run_decompositions().graph_module.graph.nodes if n.op == "output"][0].args[0]
    assert bool(Module()(keys)[0].all()) == keeps
    assert keeps_every_key(out) == keeps
