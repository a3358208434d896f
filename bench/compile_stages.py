"""Where a cold compile goes, on CPU: gjit's stages for real-size models, each in a fresh process.

    .venv/bin/python bench/compile_stages.py                    # the five workloads, a few minutes
    .venv/bin/python bench/compile_stages.py --models t5 gpt2 --json out.json

The same four workloads as bench/models_gpu.py (random weights from transformers' configs, SDPA):
GPT-2 small fp16 8 x 512 (a forward), a Llama shape (hidden 2048, 8 layers, 32 heads, 4 KV heads,
MLP 5632, vocab 32000) bf16 4 x 1024, BERT-base bf16 32 x 128, GPT-2 small fp16 `generate()` (batch
1, a 32-token prompt, greedy: its prefill and decode entries), and T5-small (transformers' T5Config
defaults: d_model 512, 6 + 6 layers, d_ff 2048, 8 heads; float32, batch 2, 32 encoder and 16 decoder
tokens). Each runs in a process of its own with an empty gjit cache folder, as a new user's first
compile: nothing warmed up, on CPU, so no kernel is built and nothing is tuned (the forwards are
compiled without being run; `generate()` runs, its compiled calls through the eager fallback).

Per workload: cold s (the wall time of gjit's compiles, export to guards), gjit's timed stages
summed over its entries (export; decompose; lower; the passes after it: attention, fuse,
statistics, rows, products; codegen; wrapper; serialize: the decomposed program in torch.export's
format, for the disk cache; the disk cache: key, write, store; guards), what
the stages do not cover (other), export's share of the cold compile, and the exported graph's
ATen nodes with decompose's milliseconds per node. `--json` keeps every stage of every entry.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
WORKLOADS = {
    "gpt2": "GPT-2 small, fp16, 8 x 512",
    "llama": "Llama shape (2048 wide, 8 layers, GQA 32/4), bf16, 4 x 1024",
    "bert": "BERT-base, bf16, 32 x 128",
    "generate": "GPT-2 small generate(), fp16, prompt 32 (prefill + decode)",
    "t5": "T5-small, fp32, 2 x 32 (encoder) / 16 (decoder)",
}
# the table's columns: a group of the driver's stage names each
GROUPS = {
    "export": ("export",),
    "decompose": ("decompose",),
    "lower": ("lower",),
    "passes": ("attention", "fuse", "statistics", "rows", "products"),
    "codegen": ("codegen",),
    "wrapper": ("wrapper",),
    "serialize": ("serialize",),  # the decomposed program as the disk cache stores it
    "cache": ("cache", "write", "cache_store"),
    "guards": ("guards",),
}
NEW_TOKENS = 4  # generate(): the decode entry compiles at the first new token; the rest hit it


def child(name: str) -> dict:
    """One workload's cold compile, in this process."""
    import torch

    sys.path.insert(0, HERE)
    import gjit
    from gjit.api import CompiledFunction

    walls: list[float] = []
    compile_once = CompiledFunction._compile

    def timed_compile(self, *args, **kwargs):  # each compile's wall time, export to guards
        start = time.perf_counter()
        try:
            return compile_once(self, *args, **kwargs)
        finally:
            walls.append(time.perf_counter() - start)

    CompiledFunction._compile = timed_compile
    model, args = build(name)
    with torch.no_grad():
        if name == "generate":
            compiled = model.forward = gjit.compile(model.forward)
            model.generate(args[0], max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS)
        else:
            compiled = gjit.compile(model)
            entry, _ = compiled.entry_for(args, {})
            assert entry is not None, compiled.eager_reason or getattr(compiled, "_capture_failed", "")
    stats = gjit.stats()
    entries = [
        {
            "timings": dict(e.program.timings),
            "aten_nodes": len(e.program.captured.exported.graph.nodes)
            if e.program.captured.exported
            else None,
        }
        for e in compiled.entries
    ]
    return {
        "workload": name,
        "cold_s": sum(walls),
        "compiles": len(walls),
        "stages": stats["compile_seconds"],
        "entries": entries,
        "kernels": stats["kernels"],
        "decompositions_by_node": stats.get("decompositions_by_node", 0),
        "decomposition_traces": stats.get("decomposition_traces", 0),
        "decomposition_traces_renamed": stats.get("decomposition_traces_renamed", 0),
    }


def build(name: str):
    """The workload's model (random weights, eval mode, its dtype) and its positional inputs."""
    import torch

    if name == "t5":
        import transformers

        torch.manual_seed(0)
        config = transformers.T5Config(use_cache=False)  # t5-small's widths are the defaults
        model = transformers.T5ForConditionalGeneration(config).eval()
        ids = torch.randint(0, config.vocab_size, (2, 32))
        return model, (ids, None, torch.randint(0, config.vocab_size, (2, 16)))
    import models_gpu
    import models_gpu_child

    workload = next(w for w in models_gpu.WORKLOADS if w.name == name)
    model, ids = models_gpu_child.build(vars(workload), small=False, device="cpu")
    return model, (ids,)


def run(name: str, timeout: float) -> dict:
    """`name` in a fresh process with an empty gjit cache folder."""
    with tempfile.TemporaryDirectory(prefix="gjit_stages_") as cache:
        env = dict(os.environ, GJIT_CACHE_DIR=cache, GJIT_CACHE="1", GJIT_PROGRESS="0")
        argv = [sys.executable, os.path.abspath(__file__), "--child", name]
        try:
            proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            return {"workload": name, "error": f"ran past {timeout:.0f} s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"workload": name, "error": (proc.stderr or proc.stdout).strip().splitlines()[-1:]}
    return json.loads(lines[-1])


def groups(row: dict) -> dict[str, float]:
    stages = row["stages"]
    out = {group: sum(stages.get(s, 0.0) for s in names) for group, names in GROUPS.items()}
    out["other"] = row["cold_s"] - sum(out.values())  # outside the stages (and any stage not named here)
    return out


def table(rows: list[dict]) -> list[str]:
    lines = [
        "| workload | cold s | "
        + " | ".join(GROUPS)
        + " | other | export share | ATen nodes | decompose ms/node |",
        "|---|" + "---:|" * (len(GROUPS) + 6),
    ]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['workload']} | failed: {row['error']} |")
            continue
        cells = " | ".join(f"{v:.2f}" for v in groups(row).values())
        nodes = sum(e["aten_nodes"] or 0 for e in row["entries"])
        per_node = 1000 * row["stages"].get("decompose", 0.0) / nodes if nodes else float("nan")
        share = row["stages"].get("export", 0.0) / row["cold_s"]
        lines.append(
            f"| {row['workload']} | {row['cold_s']:.2f} | {cells} | {share:.0%} | {nodes} | {per_node:.2f} |"
        )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--json", help="write every figure here")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per workload")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return 0
    import torch

    rows = []
    for name in args.models:
        print(f"{name}: {WORKLOADS[name]} ...", file=sys.stderr, flush=True)
        rows.append(run(name, args.timeout))
    machine = (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}"
    )
    print(f"gjit's cold compile by stage, seconds (CPU: {machine}; no kernel builds, no tuning)")
    print("\n".join(table(rows)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "workloads": WORKLOADS, "rows": rows}, f, indent=1)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
