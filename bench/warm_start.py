"""Start-up time: the first compiled output of a fresh process, gjit next to torch.compile.

    .venv/bin/python bench/warm_start.py                  # gpt2, bert, llama (sdpa) and an MLP
    .venv/bin/python bench/warm_start.py --models mlp --json out.json
    .venv/bin/python bench/warm_start.py --models gpt2-12   # 12 layers: kernels shared across layers

Every figure comes from a process of its own, on CPU (no kernels interpreted): the first
compiled call minus the first eager call of the same process, after a tiny warm-up graph of the
same system (which pays its one-time imports and start-up). Per model, in one run:

- gjit cold: empty on-disk cache; export, decompose, lower, fuse, codegen, guards, run.
- gjit cold sm_90: what a cold start on a GPU adds up to, next to torch.compile's cold start
  (which builds CPU kernels here): empty caches of its own, a warm-up graph built for an H100 as
  well (Triton's one-time start, as torch.compile's warm-up pays Inductor's), then the model
  compiled, every kernel built for sm_90 by `gjit.aot` (PTX and cubin,
  `gjit.config.compile_workers` processes at once), and the first call.
- gjit warm: a new process with the cache the cold one filled (export, key, entry, guards, run).
- gjit package: a new process, `gjit.load` of the package the cold process saved (no warm-up
  graph: nothing of gjit's ran before), then the first call; no export, no compile.
- torch.compile cold and warm: empty inductor and Triton caches, then a new process with them.

gjit's per-stage seconds are printed next to each total; `import gjit` is timed on its own.

    python bench/warm_start.py --device cuda    # on a GPU (bench/gpu_checks.sh runs it)

On a GPU the models and inputs are on the card and each cold start builds its kernels for real:
gjit cold in `compile_workers` processes (gjit/runtime/prebuild.py), gjit 1 worker one after
another in Triton's launcher, torch.compile cold its own; the package is saved with its kernels'
binaries and loaded with an empty Triton cache (a new machine's), so it builds none.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = ("gpt2-sdpa", "bert-sdpa", "llama-sdpa", "mlp")

CHILD = """
import json, sys, time
start = time.perf_counter()
import torch
imported_torch = time.perf_counter()
import gjit
imported_gjit = time.perf_counter()
system, phase, name, tests, package, device = sys.argv[1:7]
sys.path.insert(0, tests)
import model_zoo

def build(name):
    if name == "gpt2-12":  # a model as deep as GPT-2 small (tiny widths): 12 layers
        return model_zoo.gpt2_12()
    if name != "mlp":
        return model_zoo.MODELS[name]()
    torch.manual_seed(0)
    Linear = torch.nn.Linear
    layers = [Linear(256, 1024), torch.nn.GELU(), torch.nn.LayerNorm(1024), Linear(1024, 256)]
    return torch.nn.Sequential(*layers).eval(), (torch.randn(16, 256),)

def first_tensor(out):
    if isinstance(out, torch.Tensor):
        return out
    return next(v for v in out.values() if isinstance(v, torch.Tensor))

model, args = build(name)
model = model.to(device)
args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)

def sync():
    if device.startswith("cuda"):
        torch.cuda.synchronize()

with torch.no_grad():
    if phase != "package":  # the system's one-time start-up, paid on another graph
        warm_up = gjit.compile if system == "gjit" else torch.compile
        tiny = warm_up(lambda x: x * 2 + 1)
        tiny(torch.randn(8, device=device))
        if phase == "sm_90":
            gjit.aot(tiny, torch.randn(8), arch="sm_90", out_dir=package + ".warm_up")
    sync()
    begin = time.perf_counter()
    expected = model(*args)
    sync()
    eager = time.perf_counter() - begin
    begin = time.perf_counter()
    if phase == "package":
        fn = gjit.load(package, model=model)
    else:
        fn = gjit.compile(model) if system == "gjit" else torch.compile(model)
    if phase == "sm_90":  # every kernel built for an H100 (no GPU needed), in workers
        built = gjit.aot(fn, *args, arch="sm_90", out_dir=package + ".sm_90")
    out = fn(*args)
    sync()
    first = time.perf_counter() - begin
    torch.testing.assert_close(first_tensor(out), first_tensor(expected), rtol=1e-4, atol=1e-4)
    if system == "gjit" and phase == "cold":  # on a GPU with its kernels' binaries
        gjit.save(fn, package, binaries=device.startswith("cuda"))
stats = gjit.stats()
print(json.dumps({
    "start": first - eager,
    "sm_90 kernels": len(built.kernels) if phase == "sm_90" else None,
    "stages": dict(fn.entries[0].program.timings) if system == "gjit" else {},
    "counters": {k: v for k, v in stats.items() if isinstance(v, int)},
    "import gjit": imported_gjit - imported_torch,
}))
"""

RUNS = (
    ("gjit", "cold"),
    ("gjit", "sm_90"),
    ("gjit", "warm"),
    ("gjit", "package"),
    ("torch.compile", "cold"),
    ("torch.compile", "warm"),
)
# on a GPU (--device cuda) a cold start builds its kernels for real: in compile_workers processes
# (gjit/runtime/prebuild.py), and in one, one after another ("1 worker"), for comparison
GPU_RUNS = (
    ("gjit", "cold"),
    ("gjit", "1 worker"),
    ("gjit", "warm"),
    ("gjit", "package"),
    ("torch.compile", "cold"),
    ("torch.compile", "warm"),
)
DEVICE = "cpu"  # --device


def run_child(system: str, phase: str, name: str, caches: str) -> dict:
    if phase in ("sm_90", "1 worker"):  # caches of its own: a cold start too
        caches = os.path.join(caches, phase.replace(" ", "_"))
    env = dict(os.environ, GJIT_CACHE="1", GJIT_CACHE_DIR=os.path.join(caches, "gjit"))
    if phase == "1 worker":
        env["GJIT_COMPILE_WORKERS"] = "1"
    env.pop("GJIT_INTERPRET", None)
    # a package's process is a new machine's: Triton's cache empty (on a GPU the package's binaries fill it)
    env["TRITON_CACHE_DIR"] = os.path.join(caches, "triton" if phase != "package" else "triton_package")
    env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(caches, "inductor")
    package = os.path.join(caches, "model.gjit")
    argv = [sys.executable, "-c", CHILD, system, phase, name, os.path.join(ROOT, "tests"), package, DEVICE]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{system} {phase} start of {name} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(names: tuple[str, ...]) -> dict[str, dict[str, dict]]:
    results = {}
    for name in names:
        with tempfile.TemporaryDirectory(prefix="gjit_start_") as caches:
            runs = {
                f"{system} {phase}": run_child(system, phase, name, caches) for system, phase in runs_here()
            }
        warm, package = runs["gjit warm"]["counters"], runs["gjit package"]["counters"]
        if warm.get("disk_cache_misses") or warm.get("decompositions"):
            raise RuntimeError(f"the warm start of {name} did not come from the on-disk entry: {warm}")
        if package.get("exports") or package.get("compiles"):
            raise RuntimeError(f"the package start of {name} exported or compiled: {package}")
        results[name] = runs
    return results


def runs_here() -> tuple:
    return RUNS if DEVICE == "cpu" else GPU_RUNS


def format_table(results: dict[str, dict[str, dict]]) -> str:
    runs = [f"{s} {p}" for s, p in runs_here()]
    head = " | ".join(runs)
    on_cpu = DEVICE == "cpu"
    first = "sm_90 kernels" if on_cpu else "kernels built in workers"
    cold = "gjit sm_90" if on_cpu else "gjit cold"
    label = "gjit cold sm_90" if on_cpu else "gjit cold"
    ratios = f"{first} | {label} / torch.compile cold | gjit warm / torch.compile warm"
    lines = [f"| model | {head} | {ratios} |"]
    lines.append("|---" + "|---:" * (len(runs) + 3) + "|")
    for name, r in results.items():
        cells = " | ".join(f"{r[run]['start']:.2f}" for run in runs)
        cold_ratio = r[cold]["start"] / r["torch.compile cold"]["start"]
        ratio = r["gjit warm"]["start"] / r["torch.compile warm"]["start"]
        if on_cpu:
            kernels = r["gjit sm_90"]["sm_90 kernels"]
        else:
            counters = r["gjit cold"]["counters"]  # built during codegen, or by the first call's prebuild
            kernels = counters.get("kernels_built_early", 0) + counters.get("kernels_prebuilt", 0)
        lines.append(f"| {name} | {cells} | {kernels} | {cold_ratio:.2f}x | {ratio:.2f}x |")
    lines.append("")
    lines.append("gjit's stages of the model's entry (ms):")
    lines.append("")
    gjit_runs = ["gjit cold", "gjit warm", "gjit package"]
    head = " | ".join(f"{name} {run.split()[1]}" for name in results for run in gjit_runs)
    lines.append(f"| stage | {head} |")
    lines.append("|---" + "|---:" * (len(results) * len(gjit_runs)) + "|")
    stages = list(dict.fromkeys(s for r in results.values() for run in gjit_runs for s in r[run]["stages"]))
    for stage in stages:
        cells = " | ".join(
            f"{r[run]['stages'][stage] * 1e3:.0f}" if stage in r[run]["stages"] else "-"
            for r in results.values()
            for run in gjit_runs
        )
        lines.append(f"| {stage} | {cells} |")
    imports = statistics.median(r[run]["import gjit"] for r in results.values() for run in gjit_runs)
    lines.append("")
    lines.append(
        f"`import gjit` after `import torch`: {imports * 1e3:.0f} ms (median over the gjit processes)"
    )
    return "\n".join(lines)


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--json", help="write every process's figures here")
    parser.add_argument(
        "--device", default="cpu", help="cuda: the models on the GPU, kernels built for real (see GPU_RUNS)"
    )
    opts = parser.parse_args()
    global DEVICE
    DEVICE = opts.device
    results = measure(tuple(opts.models))
    print(format_table(results))
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
