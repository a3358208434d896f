"""generate() of 64 tokens: gjit vs torch.compile vs eager, with the recipe users run.

    .venv/bin/python bench/generate.py                   # tiny GPT-2 and Llama, random weights
    .venv/bin/python bench/generate.py --tokens 32 --models gpt2

For each system, `model.forward` is replaced by the compiled forward and `generate()` runs twice
(greedy; the second with another prompt length and batch size). Printed per system:

- compiles over both generate() calls, and the seconds spent in the calls that compiled, each
  system starting from empty compile caches (gjit's and Triton's; inductor's);
- per decode step: gjit's guard + dispatch (the call with the entry's wrapper replaced by one
  returning its outputs, so what gjit adds around the kernels) next to torch.compile's and eager's
  whole per-call time (on a CPU those include their ATen or C++ kernels; gjit's kernels only run
  in Triton's interpreter there, so its whole-call time is not a kernel figure);
- kernels per decode step: gjit's generated kernels + ATen externs of the decode entry, and the
  kernels inductor generated for its last (dynamic) decode graph.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings

import torch

import gjit
from gjit.bench import median_us, scratch_caches


def build(name: str) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    if name == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=500)).eval()
    config = tf.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=500,
    )
    return tf.LlamaForCausalLM(config).eval()


class Recorder:
    """Wraps a forward: times every call, notes the calls that compiled and the last call's inputs."""

    def __init__(self, forward, compiles):
        self.forward, self.compiles = forward, compiles
        self.compile_s, self.step_s, self.last = 0.0, [], None
        self.kernels_at_compile: list[int] = []

    def __call__(self, *args, **kwargs):
        before = self.compiles()
        kernels = torch._inductor.metrics.generated_kernel_count
        start = time.perf_counter()
        out = self.forward(*args, **kwargs)
        elapsed = time.perf_counter() - start
        if self.compiles() > before:
            self.compile_s += elapsed
            self.kernels_at_compile.append(torch._inductor.metrics.generated_kernel_count - kernels)
        elif kwargs.get("input_ids") is not None and kwargs["input_ids"].shape[1] == 1:
            self.step_s.append(elapsed)  # a decode step served from an entry
        self.last = (args, kwargs)
        return out


def guard_dispatch_us(cm: gjit.CompiledFunction, args: tuple, kwargs: dict) -> float:
    """cm(...) with its entry's wrapper replaced by one returning the outputs, minus that wrapper."""
    entry, sizes = cm.entry_for(args, kwargs)
    graph = entry.program.graph
    flat = torch.utils._pytree.tree_flatten(cm._normalize(args, kwargs))[0]
    outputs = graph.run(entry.program.captured.graph_inputs(flat), sizes)
    graph.run = lambda graph_inputs, sizes: outputs
    try:
        call = median_us(lambda: cm(*args, **kwargs))
        direct = median_us(lambda: graph.run(None, sizes))
    finally:
        del graph.run
    return call - direct


def run(system: str, name: str, tokens: int) -> dict:
    model = build(name)
    prompts = [torch.randint(3, 500, (2, 7)), torch.randint(3, 500, (3, 12))]
    forward = model.forward
    if system == "gjit":
        gjit.reset()
        compiled = gjit.compile(forward)
        compiles = lambda: gjit.stats()["compiles"]  # noqa: E731
    elif system == "torch.compile":
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        compiled = torch.compile(forward)
        compiles = lambda: torch._dynamo.utils.counters["stats"]["unique_graphs"]  # noqa: E731
    else:
        compiled, compiles = forward, lambda: 0
    recorder = Recorder(compiled, compiles)
    model.forward = recorder
    tokens_out = []
    with torch.no_grad():
        for ids in prompts:
            out = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
            tokens_out.append(out)
        row = {
            "system": system,
            "model": name,
            "compiles": compiles(),
            "compile_s": recorder.compile_s,
            "step_us": statistics.median(recorder.step_s) * 1e6,
            "tokens": tokens_out,
        }
        if system == "gjit":
            args, kwargs = recorder.last
            row["guard_dispatch_us"] = guard_dispatch_us(compiled, args, kwargs)
            report = gjit.explain(compiled, *args, **kwargs)
            row["kernels"] = f"{len(report.kernels)} + {len(report.externs)} externs"
            row["eager_runs"] = gjit.stats()["eager_runs"]
        elif system == "torch.compile" and recorder.kernels_at_compile:
            row["kernels"] = str(recorder.kernels_at_compile[-1])
    return row


def cold(system: str, name: str, tokens: int) -> dict:
    """One system's run with its compile caches empty (gjit's and Triton's, or inductor's)."""
    if system == "gjit":
        with scratch_caches():
            return run(system, name, tokens)
    with torch._inductor.utils.fresh_cache():
        return run(system, name, tokens)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--models", nargs="*", default=["gpt2", "llama"])
    opts = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    with torch._inductor.utils.fresh_cache():
        torch.compile(lambda x: x + 1)(torch.randn(4))  # pay inductor's imports before measuring
    print(f"generate() of {opts.tokens} tokens, twice (prompts 2x7, then 3x12); torch {torch.__version__}")
    header = "| model | system | compiles | compile s | per decode step | kernels per decode step |"
    print(header + "\n|---|---|---:|---:|---|---|")
    for name in opts.models:
        rows = [cold(system, name, opts.tokens) for system in ("eager", "gjit", "torch.compile")]
        for row in rows[1:]:
            same = all(torch.equal(a, b) for a, b in zip(row["tokens"], rows[0]["tokens"]))
            assert same, f"{row['system']} generated other tokens than eager for {name}"
        for row in rows:
            if row["system"] == "gjit":
                step = f"guard + dispatch {row['guard_dispatch_us']:.0f} us"
            else:
                step = f"whole call {row['step_us']:.0f} us"
            print(
                f"| {name} | {row['system']} | {row['compiles']} | {row['compile_s']:.1f} | {step} "
                f"| {row.get('kernels', '-')} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
