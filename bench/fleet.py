"""A fleet sharing a compile cache through Redis: first-output time and compiles per process.

    .venv/bin/python bench/fleet.py                   # tiny GPT-2 (sdpa), needs redis-server
    .venv/bin/python bench/fleet.py --model mlp --processes 8 --at-once 4

Every process is fresh, with an empty local disk cache of its own (a new machine, as far as the
cache goes), and compiles the same model: first, 8 processes one after another, then 4 at once;
each with a shared redis-server (GJIT_REMOTE_CACHE) and without it; with it, the 4 at once run
twice: on the server the 8 filled, then on an emptied one. A process reports the time
from the start of its compile to its first output (CPU: the eager fallback runs the graph) and
whether it compiled (decomposed) or was served by the remote.

    .venv/bin/python bench/fleet.py --binaries        # GPU kernel binaries through the same server

With --binaries each process instead measures what a first call on a GPU adds: its kernels for
an H100 (sm_90) with an empty Triton cache of its own, through gjit's prebuild (workers, and the
remote cache's binaries when there is one) and Triton's launcher (bench/first_launch.py's replay
on a driver that names sm_90, no GPU needed): the seconds until every launch's binary is ready,
the kernels built in the process, and the binaries it installed from the server.

    .venv/bin/python bench/fleet.py --package         # a package through the same server

With --package a process first asks the server for the model's package (gjit.load("remote:...")):
served from it, nothing is exported or compiled; without one (the first process, or no server) it
compiles and saves its package to the server for the others.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BUILD = """
import json, sys, time
import torch, gjit
sys.path.insert(0, sys.argv[2])
import model_zoo
name = sys.argv[1]
if name == "mlp":
    torch.manual_seed(0)
    Linear = torch.nn.Linear
    model = torch.nn.Sequential(Linear(256, 1024), torch.nn.GELU(), Linear(1024, 256)).eval()
    args = (torch.randn(16, 256),)
else:
    model, args = model_zoo.MODELS[name]()
"""

CHILD = BUILD + """
with torch.no_grad():
    begin = time.perf_counter()
    gjit.compile(model)(*args)
    first = time.perf_counter() - begin
stats = gjit.stats()
print(json.dumps({"first": first, "compiled": stats.get("decompositions", 0) > 0,
                  "remote_hits": stats.get("remote_cache_hits", 0)}))
"""


CHILD_BINARIES = """
import json, sys, time
import gjit
sys.path.insert(0, sys.argv[3])
import first_launch
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver
from gjit.codegen.toolchain.compile_only import finish_warm_up
from gjit.runtime import prebuild
graph, inputs, sizes, launches = first_launch.first_call(*first_launch.build(sys.argv[1]))
driver.set_active(prebuild.TargetDriver(GPUTarget("cuda", 90, 32)))
finish_warm_up()  # Triton's one-time hashing, which a GPU process pays either way
namespace = graph.call_fn(interpret=False).__globals__
begin = time.perf_counter()
graph.prebuild(graph.call_fn(interpret=False), inputs, sizes)
at_launch = first_launch.launch_all(namespace, launches)
first = time.perf_counter() - begin
stats = gjit.stats()
built = stats.get("kernels_prebuilt", 0) + at_launch
print(json.dumps({"first": first, "compiled": built > 0, "built": built,
                  "remote_hits": stats.get("remote_binary_hits", 0)}))
"""


CHILD_PACKAGE = BUILD + """
with torch.no_grad():
    begin = time.perf_counter()
    try:
        gjit.load("remote:bench-" + name, model=model)(*args)
        compiled = False
    except gjit.PackageError:  # none yet (or no server): compile, and share the package
        cm = gjit.compile(model)
        cm(*args)
        compiled = True
        if gjit.config.remote_cache:
            try:
                gjit.save(cm, "remote:bench-" + name)
            except gjit.PackageError as e:
                print("not shared:", e, file=sys.stderr)
    first = time.perf_counter() - begin
print(json.dumps({"first": first, "compiled": compiled, "remote_hits": 0}))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


MODE = ""  # "binaries" (--binaries) or "package" (--package): what the children do instead


def launch(model: str, cache_dir: str, url: str | None) -> subprocess.Popen:
    env = dict(os.environ, GJIT_CACHE="1", GJIT_CACHE_DIR=cache_dir)
    env["TRITON_CACHE_DIR"] = os.path.join(cache_dir, "triton")  # each process: a new machine's
    env.pop("GJIT_INTERPRET", None)
    env.pop("GJIT_REMOTE_CACHE", None)
    if url:
        env["GJIT_REMOTE_CACHE"] = url
    child = {"binaries": CHILD_BINARIES, "package": CHILD_PACKAGE}.get(MODE, CHILD)
    argv = [sys.executable, "-c", child, model, os.path.join(ROOT, "tests"), os.path.join(ROOT, "bench")]
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def result(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"a fleet process failed:\n{err[-3000:]}")
    return json.loads(out.strip().splitlines()[-1])


def at_once(model: str, count: int, url: str | None, root: str, phase: str) -> list[dict]:
    procs = [launch(model, os.path.join(root, f"{phase}{k}"), url) for k in range(count)]
    return [result(p) | {"phase": phase} for p in procs]


def fleet(model: str, processes: int, count: int, url: str | None, root: str) -> list[dict]:
    """`processes` one after another, then `count` at once (with a server: on the server the first
    phase filled, then again on an emptied one)."""
    runs = []
    for k in range(processes):
        runs.append(result(launch(model, os.path.join(root, f"seq{k}"), url)) | {"phase": "sequential"})
    runs += at_once(model, count, url, root, "at once")
    if url:
        import redis

        redis.Redis.from_url(url).flushall()
        runs += at_once(model, count, url, root, "at once, empty server")
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="gpt2-sdpa")
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--at-once", type=int, default=4)
    parser.add_argument("--binaries", action="store_true", help="GPU kernel binaries (sm_90), see above")
    parser.add_argument("--package", action="store_true", help="packages through the server, see above")
    opts = parser.parse_args()
    global MODE
    MODE = "binaries" if opts.binaries else "package" if opts.package else ""
    server = shutil.which("redis-server")
    if server is None:
        sys.exit("bench/fleet.py needs redis-server (apt-get install redis-server)")
    port = free_port()
    redis = subprocess.Popen(
        [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    time.sleep(0.5)
    try:
        table = {}
        for label, url in (("without remote", None), ("with Redis", f"redis://127.0.0.1:{port}/0")):
            with tempfile.TemporaryDirectory(prefix="gjit_fleet_") as root:
                table[label] = fleet(opts.model, opts.processes, opts.at_once, url, root)
    finally:
        redis.kill()
    print(f"model {opts.model}: {opts.processes} processes one after another, then {opts.at_once} at once")
    if MODE == "binaries":
        print("| cache | phase | sm_90 binaries ready s (each process) | median | built | installed |")
        print("|---|---|---|---:|---:|---:|")
    else:
        print("| cache | phase | first output s (each process) | median | compiled |")
        print("|---|---|---|---:|---:|")
    for label, runs in table.items():
        for phase in ("sequential", "at once", "at once, empty server"):
            rs = [r for r in runs if r["phase"] == phase]
            if not rs:
                continue
            times = ", ".join(f"{r['first']:.2f}" for r in rs)
            median = statistics.median(r["first"] for r in rs)
            compiled = sum(r["compiled"] for r in rs)
            if MODE == "binaries":
                built = ", ".join(str(r["built"]) for r in rs)
                hits = ", ".join(str(r["remote_hits"]) for r in rs)
                print(f"| {label} | {phase} | {times} | {median:.2f} | {built} | {hits} |")
            else:
                print(f"| {label} | {phase} | {times} | {median:.2f} | {compiled} of {len(rs)} |")


if __name__ == "__main__":
    main()
