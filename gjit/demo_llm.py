"""`python -m gjit.demo --model gpt2-generate`: generate() with the compiled forward, as users run it.

A tiny GPT-2 (random weights, transformers' defaults: `use_cache=True`, a DynamicCache) decodes
greedily with `model.forward = gjit.compile(model.forward)`, kernels in Triton's CPU interpreter
with poisoned buffers. Printed: each entry (prefill, decode) with its dynamic dims, kernels and
externs; the compile count; a second generate() with another prompt length and batch size served
without a new compile; the tokens against eager's. Exits 1 when a token differs.
"""

from __future__ import annotations

import argparse
import time

import torch

import gjit
from gjit.debug.report import build_report


def section(title: str) -> None:
    print(f"\n== {title} " + "=" * max(0, 86 - len(title)))


def run(args: argparse.Namespace) -> int:
    from transformers import GPT2Config, GPT2LMHeadModel

    gjit.config.interpret = args.device == "cpu"
    gjit.config.debug = True
    gjit.reset()
    torch.manual_seed(args.seed)
    config = GPT2Config(n_layer=2, n_embd=args.hidden, n_head=4, vocab_size=1000)
    model = GPT2LMHeadModel(config).to(args.device).eval()
    prompts = [
        torch.randint(3, 1000, (args.batch, args.seq), device=args.device),
        torch.randint(3, 1000, (args.batch + 1, args.seq + 5), device=args.device),
    ]
    tokens = args.tokens

    def generate(ids: torch.Tensor) -> torch.Tensor:
        return model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)

    print(
        f"gjit demo: GPT-2 ({sum(p.numel() for p in model.parameters())} parameters, random weights) "
        f"generate() of {tokens} tokens, model.forward = gjit.compile(model.forward)"
    )
    with torch.no_grad():
        expected = [generate(ids) for ids in prompts]
        model.forward = cm = gjit.compile(model.forward)
        start = time.perf_counter()
        first = generate(prompts[0])
        first_s = time.perf_counter() - start
        compiles_first = gjit.stats()["compiles"]
        start = time.perf_counter()
        second = generate(prompts[1])
        second_s = time.perf_counter() - start

    for index, entry in enumerate(cm.entries):
        report = build_report(entry)
        kind = "prefill (empty cache)" if index == 0 else "decode (one token, the cache passed back in)"
        section(f"entry {index}: {kind}")
        print(f"dynamic dims: {', '.join(entry.guards.dynamic_dims) or 'none'}")
        print(f"kernels ({len(report.kernels)}):")
        for k in report.kernels:
            print(f"    {k.name}  ({len(k.aten_nodes)} ATen nodes)")
        externs = ", ".join(f"{e.node} ({e.op.split('.')[-2]})" for e in report.externs)
        print(f"externs ({len(report.externs)}): {externs}")
    decode = build_report(cm.entries[-1])
    section("source of the decode step's largest kernel")
    largest = max(decode.kernels, key=lambda k: len(k.aten_nodes))
    print(largest.source.rstrip())

    section("numbers")
    stats = gjit.stats()
    same = [torch.equal(a, b) for a, b in zip([first, second], expected)]
    print(
        f"generate() #1, prompt {tuple(prompts[0].shape)}: {compiles_first} compiles "
        f"(prefill + decode), {tokens} tokens in {first_s:.1f} s (compiles included, kernels interpreted)"
    )
    print(
        f"generate() #2, prompt {tuple(prompts[1].shape)}: "
        f"{stats['compiles'] - compiles_first} new compiles, {second_s:.1f} s"
    )
    print(
        f"calls: {stats['cache_hits']} cache hits, {stats['compiles']} compiles, "
        f"{stats['eager_runs']} eager runs; tokens equal to eager: {same}"
    )
    ok = all(same) and stats["eager_runs"] == 0
    verdict = "OK: generated tokens match eager's" if ok else "MISMATCH: tokens differ or calls ran eagerly"
    print(f"\n{verdict}")
    return 0 if ok else 1
