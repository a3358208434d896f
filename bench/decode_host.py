"""Host time of a compiled decode call, piece by piece, without a GPU:

    .venv/bin/python bench/decode_host.py                 # static and dynamic caches
    .venv/bin/python bench/decode_host.py --cache static --tokens 40

A GPT-2 of 12 layers and tiny widths runs `generate()` with its forward compiled by gjit: a first
`generate()` compiles (kernels in Triton's interpreter), then one is timed with every kernel launch
going through Triton's own launcher and CUDA driver API over a libcuda that launches nothing
(tests/null_cuda.py; buffers on the CPU, zeroed, ATen's externs computing there). Each piece of
`CompiledFunction.__call__` is timed on every call and summed: the wrapper (`CompiledGraph.run`),
the guard, the inputs' flatten, the write-backs and the output tree (`finish`, with the returned
cache's `rebuild`). Printed per call, in microseconds; the total is `__call__`'s.
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import transformers  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402

import gjit  # noqa: E402
from gjit import api  # noqa: E402
from gjit.capture import cache_aliases, export  # noqa: E402
from gjit.runtime import graph as graph_module  # noqa: E402
from null_cuda import null_driver  # noqa: E402

PIECES = [
    ("call", api.CompiledFunction, "__call__"),
    ("flatten", api.CompiledFunction, "_flatten"),
    ("wrapper", graph_module.CompiledGraph, "run"),
    ("finish", export.CapturedProgram, "finish"),
    ("  of which the cache's rebuild", cache_aliases.CacheAliases, "rebuild"),
]


def timed(spent: collections.Counter, label: str, fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[label] += time.perf_counter() - start

    return run


def measure(cache: str, tokens: int) -> None:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=64, n_layer=12, n_head=4, vocab_size=1000, n_positions=128)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 1000, (1, 8))
    settings = dict(do_sample=False, pad_token_id=config.eos_token_id, attention_mask=torch.ones_like(ids))
    settings |= dict(disable_compile=True, max_new_tokens=tokens, min_new_tokens=tokens)
    if cache != "dynamic":
        settings["cache_implementation"] = cache
    compiled = gjit.compile(model.forward)
    model.forward = compiled
    with torch.no_grad(), gjit.config.scope(interpret=True):
        model.generate(ids, **settings)  # compiles prefill and decode
    spent: collections.Counter = collections.Counter()
    saved = [(owner, name, getattr(owner, name)) for _, owner, name in PIECES]
    run = graph_module.CompiledGraph.run

    def zeroed(size, stride, dtype, device):  # no kernel writes them: indices read from them stay in range
        return torch.empty_strided(size, stride, dtype=dtype, device=device).zero_()

    def on_the_null_driver(self, inputs, sizes):
        call = self.call_fn(interpret=False)
        call.__globals__["gjit_alloc"] = zeroed
        return list(call(inputs, sizes))

    driver.set_active(null_driver())
    try:
        graph_module.CompiledGraph.run = on_the_null_driver
        for label, owner, name in PIECES:
            setattr(owner, name, timed(spent, label, getattr(owner, name)))
        for entry in compiled.entries:
            entry.guards.check = timed(spent, "guard", entry.guards.check)
        with torch.no_grad():
            model.generate(ids, **settings)  # warm: every kernel loaded
            spent.clear()
            model.generate(ids, **settings)
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)
        graph_module.CompiledGraph.run = run
    calls = tokens  # a prefill and tokens - 1 decode calls
    print(f"| {cache} | " + " | ".join(f"{spent[label] / calls * 1e6:.0f}" for label in LABELS) + " |")


LABELS = ["call", "wrapper", "guard", "flatten", "finish", "  of which the cache's rebuild"]


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--cache", nargs="+", default=["static", "dynamic"])
    parser.add_argument("--tokens", type=int, default=20)
    opts = parser.parse_args()
    torch.set_num_threads(1)
    print(f"per compiled call, us (GPT-2, 12 layers, {opts.tokens} tokens; sm_90 null driver)")
    print("| cache | " + " | ".join(label.strip() for label in LABELS) + " |")
    print("|---|" + "---:|" * len(LABELS))
    for cache in opts.cache:
        measure(cache, opts.tokens)


if __name__ == "__main__":
    main()
