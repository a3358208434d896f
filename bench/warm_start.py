"""Cold vs warm compile of the tiny HF models, per stage, each compile in a process of its own.

    .venv/bin/python bench/warm_start.py                  # gpt2, bert, llama (sdpa)
    .venv/bin/python bench/warm_start.py --models gpt2-eager --json out.json

For each model a first process compiles into empty gjit and Triton caches (cold: export,
decompose, lower, fuse, codegen, every kernel built for sm_90), then a second process compiles
the same model again with those caches (warm: the on-disk entry replaces lowering, fusion and
codegen; Triton finds the sm_90 binaries in its own cache). Times run from gjit.compile to a
runnable entry with its kernels built, so the interpreter start and imports are not counted.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = ("gpt2-sdpa", "bert-sdpa", "llama-sdpa")

CHILD = """
import json, sys, time, torch, gjit
sys.path.insert(0, sys.argv[2])
import model_zoo
model, args = model_zoo.MODELS[sys.argv[1]]()
with torch.no_grad():
    gjit.aot(lambda x: x + 1, torch.randn(8))  # Triton start-up, not the model's compile
    start = time.perf_counter()
    cm = gjit.compile(model)
    entry, _ = cm.entry_for(args, {})
    built = time.perf_counter()
    gjit.aot(cm, *args)
    stages = dict(entry.program.timings)
    stages["sm_90 build"] = time.perf_counter() - built
    stages["total"] = time.perf_counter() - start
print(json.dumps({"stages": stages, "stats": {k: v for k, v in gjit.stats().items() if "disk" in k}}))
"""


def compile_in_child(name: str, caches: str) -> dict:
    env = dict(os.environ, GJIT_CACHE="1", GJIT_CACHE_DIR=os.path.join(caches, "gjit"))
    env["TRITON_CACHE_DIR"] = os.path.join(caches, "triton")
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, name, os.path.join(ROOT, "tests")],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"compiling {name} failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(names: tuple[str, ...]) -> dict[str, dict[str, dict]]:
    results = {}
    for name in names:
        with tempfile.TemporaryDirectory(prefix="gjit_warm_") as caches:
            cold = compile_in_child(name, caches)
            warm = compile_in_child(name, caches)
        if warm["stats"].get("disk_cache_misses") or not warm["stats"].get("disk_cache_hits"):
            raise RuntimeError(f"the second compile of {name} did not hit the on-disk cache: {warm['stats']}")
        results[name] = {"cold": cold["stages"], "warm": warm["stages"]}
    return results


def format_table(results: dict[str, dict[str, dict]]) -> str:
    stages = list(dict.fromkeys(s for r in results.values() for phase in r.values() for s in phase))
    stages.sort(key=lambda s: s == "total")
    head = "".join(f" | {n} cold | {n} warm" for n in results)
    lines = [f"| stage (ms){head} |", "|---" + "|---:" * (2 * len(results)) + "|"]
    for stage in stages:
        cells = "".join(
            f" | {r['cold'].get(stage, 0) * 1e3:.0f} | "
            + (f"{r['warm'][stage] * 1e3:.0f}" if stage in r["warm"] else "-")
            for r in results.values()
        )
        lines.append(f"| {stage}{cells} |")
    return "\n".join(lines)


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--json", help="write the per-stage seconds here")
    opts = parser.parse_args()
    results = measure(tuple(opts.models))
    print(format_table(results))
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
