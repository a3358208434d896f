"""Random programs (tests/fuzz.py) compiled by gjit and compared with eager, 0 mismatches expected.

The default run is 160 programs, seeds 0-159, in 8 chunks (pytest shows progress per chunk), then
the first 60 again with backend="cupy" (GJIT_FUZZ_CUDA_PROGRAMS), on the CUDA C host emulation;
CI's sweep step then runs seeds 160-519 (GJIT_FUZZ_SEED=160 GJIT_FUZZ_PROGRAMS=360) and 160-219 on
CUDA C: 520 programs on Triton and 120 on CUDA C in all. Each
program is called twice with different sizes of the same ranks, so guards, cache hits and
recompiles run too. Programs run in GJIT_FUZZ_WORKERS worker processes (default: one per core,
at most 8; 1 under pytest-xdist, which runs the chunks in parallel itself; 1 runs them in the
test process). A failing program is shrunk (statements, outputs, sizes, layouts, dtypes) while
it still fails the same way, and the assertion message holds a self-contained reproducer script.

A longer run, or other seeds:

    GJIT_FUZZ_PROGRAMS=5000 GJIT_FUZZ_SEED=100000 .venv/bin/python -m pytest tests/test_fuzz.py
    .venv/bin/python tests/fuzz.py --programs 5000 --seed 100000     # the same, without pytest
    GJIT_BACKEND=cupy .venv/bin/python tests/fuzz.py --programs 500  # CUDA C kernels
    .venv/bin/python tests/fuzz.py --show 17                         # program 17 as a script
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
from collections import Counter

import pytest
import torch

import fuzz
import gjit
from gjit.lowering import graph  # noqa: F401 - its import registers every lowering
from gjit.lowering.registry import LOWERINGS

# generated programs hit ops that warn by design (var() of one element is NaN, etc.)
pytestmark = [pytest.mark.cpu, pytest.mark.filterwarnings("ignore")]

PROGRAMS = int(os.environ.get("GJIT_FUZZ_PROGRAMS", "160"))
CUDA_PROGRAMS = int(os.environ.get("GJIT_FUZZ_CUDA_PROGRAMS", "60"))  # the first seeds again, on CUDA C
FIRST_SEED = int(os.environ.get("GJIT_FUZZ_SEED", "0"))
# under pytest-xdist (`pytest -n 2`, as CI runs) xdist spreads the chunks over its processes
DEFAULT_WORKERS = 1 if os.environ.get("PYTEST_XDIST_WORKER") else min(8, os.cpu_count() or 1)
WORKERS = int(os.environ.get("GJIT_FUZZ_WORKERS", str(DEFAULT_WORKERS)))
CHUNKS = 8
CUDA_CHUNKS = 2
SHRUNK_PER_CHUNK = 2  # failures shrunk into reproducers per chunk (each takes up to a minute or so)


def chunk_seeds(chunk: int, programs: int = PROGRAMS, chunks: int = CHUNKS) -> range:
    size = -(-programs // chunks)
    start = FIRST_SEED + chunk * size
    return range(start, min(start + size, FIRST_SEED + programs))


@pytest.fixture(scope="module")
def run_seeds():
    """seeds -> [(seed, failure or None, counters)]. With several workers the next chunk's
    programs are queued too, so no worker waits at the end of a chunk."""
    if WORKERS <= 1:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # tiny tensors; and under xdist the other process has the other core
        yield lambda seeds, backend="triton": [fuzz.check_seed(s, backend) for s in seeds]
        torch.set_num_threads(threads)
        return
    pool = concurrent.futures.ProcessPoolExecutor(
        WORKERS,
        mp_context=multiprocessing.get_context("spawn"),  # no fork of a process with threads
        initializer=fuzz.init_worker,
        initargs=(gjit.config.cache_dir,),
    )
    futures: dict[tuple[str, int], concurrent.futures.Future] = {}

    def run(seeds: range, backend: str = "triton") -> list:
        last = FIRST_SEED + (PROGRAMS if backend == "triton" else CUDA_PROGRAMS)
        for seed in [*seeds, *range(seeds.stop, min(seeds.stop + len(seeds), last))]:
            if (backend, seed) not in futures:
                futures[backend, seed] = pool.submit(fuzz.check_seed, seed, backend)
        try:
            return [futures[backend, seed].result() for seed in seeds]
        except concurrent.futures.process.BrokenProcessPool:
            pytest.fail(
                f"a worker process died (a crash in a kernel?) running seeds {seeds.start}-{seeds.stop - 1} "
                f"or earlier; find the program: python tests/fuzz.py --seed {seeds.start} "
                f"--programs {len(seeds)} -v"
            )

    yield run
    pool.shutdown(cancel_futures=True)


@pytest.mark.parametrize("chunk", range(CHUNKS), ids=lambda k: f"seeds_{chunk_seeds(k).start}")
def test_random_programs_match_eager(chunk, run_seeds):
    check_chunk(chunk_seeds(chunk), run_seeds, "triton")


@pytest.mark.parametrize(
    "chunk", range(CUDA_CHUNKS), ids=lambda k: f"seeds_{chunk_seeds(k, CUDA_PROGRAMS, CUDA_CHUNKS).start}"
)
def test_random_programs_match_eager_on_cuda_c(chunk, run_seeds):
    """The same programs with backend="cupy", each kernel run on the host emulation."""
    check_chunk(chunk_seeds(chunk, CUDA_PROGRAMS, CUDA_CHUNKS), run_seeds, "cupy")


def check_chunk(seeds: range, run_seeds, backend: str) -> None:
    if not seeds:
        pytest.skip("GJIT_FUZZ_PROGRAMS leaves this chunk empty")
    results = run_seeds(seeds, backend)
    counts = sum((c for _, _, c in results), Counter())
    failures = [(seed, failure) for seed, failure, _ in results if failure is not None]
    reports = []
    for k, (seed, failure) in enumerate(failures):
        if k < SHRUNK_PER_CHUNK:
            with gjit.config.scope(backend=backend):
                reports.append(fuzz.report(seed, failure))
        else:
            reports.append(f"fuzz program {seed} fails too (call {failure.call}, {failure.summary()})")
    assert not failures, f"{len(failures)} of {len(seeds)} programs fail:\n\n" + "\n\n".join(reports)
    assert counts["programs"] == len(seeds)
    assert counts["kernels"] >= len(seeds) // 2, f"few programs ran kernels: {dict(counts)}"


def test_shrinker_finds_a_planted_bug(monkeypatch, tmp_path):
    """neg lowered as abs: the fuzzer's check fails, and the shrunk reproducer is one statement
    with its failure, which the reproducer script itself raises."""
    aten = torch.ops.aten
    monkeypatch.setitem(LOWERINGS, aten.neg.default, LOWERINGS[aten.abs.default])
    program = fuzz.Program(
        seed=7,
        inputs=[fuzz.Input("x0", ("s0", "s1"), torch.float32, ("permute", (1, 0)), seed=70)],
        stmts=[
            fuzz.Stmt("v0", "torch.exp(x0)", ("x0",)),
            fuzz.Stmt("v1", "v0.sum(-1)", ("v0",)),
            fuzz.Stmt("v2", "-v0", ("v0",), keeps_exact=True),
            fuzz.Stmt("v3", "v2 * 2 + x0", ("v2", "x0")),
        ],
        outputs=["v3", "v1"],
        sizes=[{"s0": 3, "s1": 5}, {"s0": 4, "s1": 6}],
    )
    with gjit.config.scope(cache_dir=str(tmp_path)):  # keep the planted bug's kernels out of the cache
        failure = fuzz.check(program)
        assert failure is not None and failure.kind == "mismatch"
        small, small_failure = fuzz.shrink(program, failure)
        assert small_failure.kind == "mismatch"
        assert [s.expr for s in small.stmts] == ["-x0"]
        assert len(small.sizes) == 1 and small.inputs[0].layout == ("contiguous",)
        script = small.reproducer(small_failure)
        with pytest.raises(AssertionError, match="not close"):
            exec(compile(script, "<reproducer>", "exec"), {"__name__": "reproducer"})
