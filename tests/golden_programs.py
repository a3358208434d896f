"""The golden programs: small, representative programs whose generated sources are checked in.

Kernel headers quote user source lines with their line numbers, so add new programs at the end of
this file (editing one above moves the line numbers of every program below it).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class Program:
    name: str
    fn: Callable
    inputs: Callable[[], tuple]  # built fresh, seeded
    dynamic: bool | None = None
    knobs: dict = field(default_factory=dict)  # on top of KNOBS


def _randn(*shape, dtype=torch.float32):
    return lambda: (torch.randn(*shape, dtype=dtype),)


# -- pointwise and views ------------------------------------------------------------------------


def pointwise_chain(x, y):
    return torch.sigmoid(F.gelu(x * 2.0 + y) - y.exp()).clamp(min=0.1)


def mixed_dtypes(x, i, h):
    return (x + i).to(torch.float16) * h, (i % 3 == 0) & (x > 0)


def views(x):
    a = x.permute(2, 0, 1)[:, 1:, ::2]
    return a.transpose(0, 1).reshape(-1, a.shape[0]) * 3, x.expand(2, *x.shape).sum(0).unsqueeze(1)


def cat_pad(x, y):
    return torch.cat([F.pad(x, (1, 2)), y.relu()], dim=-1).tanh()


def where_int(x, n):
    return torch.where(n > 2, x.abs().sqrt(), -x).floor_divide(0.5), n >> 1, (n * 7) // 3


def dynamic_broadcast(x, b):
    return (x - x.mean()) * b + x.shape[0]


# -- reductions ---------------------------------------------------------------------------------


def row_sum(x):
    return x.sum(-1), x.amax(-1)


def column_sum(x):
    return x.sum(0) * 2, x.prod(0)


def full_reduction(x):
    return x.sum(), x.abs().max(), (x > 0).any()


def softmax(x):
    return torch.softmax(x, dim=-1)


def log_softmax_fp16(x):
    return torch.log_softmax(x, dim=-1)


def layer_norm(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b, eps=1e-5)


def var_mean_argmax(x):
    v, m = torch.var_mean(x, dim=1, correction=1)
    return v, m, x.argmax(1), x.argmin(-1)


def rms_norm(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


# -- indexing and spatial -----------------------------------------------------------------------


def embedding_gather(ids, table, idx):
    e = F.embedding(ids, table)
    return e.sum(-1), torch.gather(table, 1, idx), table.index_select(0, ids[0])


def cross_entropy(logits, labels):
    return F.cross_entropy(logits, labels)


def pooling(x):
    return F.max_pool2d(x.relu(), 3, 2, 1), F.avg_pool2d(x, 2), F.interpolate(x, scale_factor=2).flip(-1)


def group_norm(x):
    return F.group_norm(x, 2) + F.normalize(x, dim=1)


# -- a model layer and control flow -------------------------------------------------------------


class Block(nn.Module):
    """A pre-norm transformer block written out: matmuls are externs, the rest kernels."""

    def __init__(self, dim: int = 32, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (
            t.view(b, s, self.heads, d // self.heads).transpose(1, 2)
            for t in self.qkv(self.norm1(x)).split(d, dim=-1)
        )
        att = ((q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)).softmax(-1) @ v
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


def _block() -> nn.Module:
    torch.manual_seed(0)
    return Block().eval()


def cond(x):
    return torch.cond(x.sum() > 0, lambda t: t.sin() * 2, lambda t: t.cos() + 1, (x,))


def eager_attention(q, k, v):
    """Attention as HF's eager path writes it: two matmul templates, the softmax's probabilities
    computed on the second one's operand load, the transposes read in place."""
    b, s, h, d = q.shape
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    scores = torch.matmul(q, k.transpose(-1, -2)) * 0.25
    return torch.matmul(scores.softmax(-1), v).transpose(1, 2).reshape(b, s, h * d)


PROGRAMS = [
    Program("pointwise_chain", pointwise_chain, lambda: (torch.randn(4, 33), torch.randn(33))),
    Program(
        "mixed_dtypes",
        mixed_dtypes,
        lambda: (torch.randn(5, 7), torch.randint(-9, 9, (5, 7)), torch.randn(7).half()),
    ),
    Program("views", views, _randn(6, 5, 4)),
    Program("cat_pad", cat_pad, lambda: (torch.randn(3, 5), torch.randn(3, 4))),
    Program(
        "where_int", where_int, lambda: (torch.randn(8, 3), torch.randint(0, 5, (8, 3), dtype=torch.int32))
    ),
    Program(
        "dynamic_broadcast", dynamic_broadcast, lambda: (torch.randn(10, 6), torch.randn(6)), dynamic=True
    ),
    Program("row_sum_persistent", row_sum, _randn(16, 100)),
    Program("row_sum_looped", row_sum, _randn(4, 3000)),
    Program("row_sum_dynamic", row_sum, _randn(16, 100), dynamic=True),
    Program("column_sum", column_sum, _randn(50, 12)),
    Program("full_reduction", full_reduction, _randn(37, 11)),
    Program("softmax_persistent", softmax, _randn(8, 200)),
    Program("softmax_looped_online", softmax, _randn(4, 5000)),
    Program("log_softmax_fp16", log_softmax_fp16, _randn(8, 64, dtype=torch.float16)),
    Program(
        "layer_norm_persistent", layer_norm, lambda: (torch.randn(6, 96), torch.randn(96), torch.randn(96))
    ),
    Program(
        "layer_norm_looped_welford",
        layer_norm,
        lambda: (torch.randn(3, 2048), torch.randn(2048), torch.randn(2048)),
    ),
    Program("var_mean_argmax", var_mean_argmax, _randn(6, 40)),
    Program("rms_norm_dynamic", rms_norm, lambda: (torch.randn(2, 5, 64), torch.randn(64)), dynamic=True),
    Program(
        "embedding_gather",
        embedding_gather,
        lambda: (torch.randint(0, 20, (2, 6)), torch.randn(20, 16), torch.randint(0, 16, (20, 3))),
    ),
    Program("cross_entropy", cross_entropy, lambda: (torch.randn(8, 100), torch.randint(0, 100, (8,)))),
    Program("pooling", pooling, _randn(2, 3, 9, 9)),
    Program("group_norm", group_norm, _randn(2, 4, 5, 5)),
    Program("transformer_block", _block(), _randn(2, 8, 32)),
    Program(
        "eager_attention_fp16",
        eager_attention,
        lambda: tuple(torch.randn(2, 9, 3, 16, dtype=torch.float16) for _ in range(3)),
        dynamic=True,
    ),
    Program("cond", cond, _randn(5, 3)),
    Program(
        "embedding_gather_debug",  # debug mode: poisoned buffers, bounds checks on gathered indices
        embedding_gather,
        lambda: (torch.randint(0, 20, (2, 6)), torch.randn(20, 16), torch.randint(0, 16, (20, 3))),
        knobs={"debug": True},
    ),
]


# -- programs added later (here, so the line numbers above stay) --------------------------------


def to_channels_last(x, y):
    return x.permute(0, 2, 3, 1).contiguous() * y


def sum_and_max_of_everything(x):
    return x.sum(), x.abs().amax()


PROGRAMS += [
    Program(
        "transpose_tiles", to_channels_last, lambda: (torch.randn(2, 5, 6, 7), torch.randn(5)), dynamic=True
    ),
    Program("split_reduction", sum_and_max_of_everything, _randn(3, 20000)),
]
