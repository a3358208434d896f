"""Golden kernels: the generated kernel and wrapper sources of representative programs, checked in.

A refactor of the pipeline must leave them byte-identical; a change that alters them on purpose
regenerates them in its own commit and says why (process replay, as tinygrad does it).

    python tests/golden.py            # regenerate tests/golden/<backend>/<program>.txt
    python tests/golden.py --check    # compare only; exit 1 and show a diff when one differs

tests/test_golden.py runs the comparison in CI. Each program is compiled with fixed knobs (the
defaults below, whatever the environment says) and called once through the eager fallback: what
codegen and the wrapper writer produce is recorded, with the kernels' launch metadata (signature,
blocks, traffic, assumptions), which the wrapper and the guards depend on.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
import tempfile
import warnings

import torch

import gjit
from gjit.config import BACKENDS
from golden_programs import PROGRAMS, Program

GOLDEN_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")
# every knob that changes generated code, pinned (an environment variable must not move a golden file)
KNOBS = dict(debug=False, interpret=False, cache=False, check=False, xblock=1024, reduction="auto",
             persistent_max=1024, rblock=0, matmul="template")  # fmt: skip


def generate(program: Program, backend: str) -> str:
    """The golden text of one program on one backend: every kernel with its launch metadata, then
    the wrapper, for the graph and each torch.cond branch."""
    torch.manual_seed(0)
    inputs = program.inputs()
    with gjit.config.scope(**{**KNOBS, **program.knobs, "backend": backend}):
        cm = gjit.compile(program.fn, dynamic=program.dynamic)
        with torch.no_grad():
            cm(*inputs)
    if not cm.entries:
        raise RuntimeError(f"golden program {program.name} did not compile: {cm.eager_reason}")
    out = [f"# golden: {program.name} on {backend} (regenerate: python tests/golden.py)"]
    _render_graph(cm.entries[-1].program.graph, "graph", out)
    return "\n".join(out) + "\n"


def _render_graph(graph, title: str, out: list[str]) -> None:
    for k in graph.kernels:
        out.append(f"\n# ===== {title}: kernel {k.name} =====")
        meta = dict(
            in_args=k.in_args, out_args=k.out_args, size_args=[s.name for s in k.size_args],
            numel=str(k.numel), rnumel=str(k.rnumel), index_dtype=k.index_dtype, signature=k.signature,
            blocks=k.blocks, launch_blocks=k.launch_blocks, persistent=k.persistent, passes=k.passes,
            bytes_read=str(k.bytes_read), bytes_written=str(k.bytes_written),
            assumptions=[why for _, why in k.assumptions],
        )  # fmt: skip
        if k.ynumel is not None:  # a 2-D tile's rows (numel: its columns)
            meta["ynumel"] = str(k.ynumel)
        out += [f"# {key}: {value}" for key, value in meta.items()]
        out.append(k.source.rstrip("\n"))
    out.append(f"\n# ===== {title}: wrapper =====")
    out.append(graph.wrapper_source.rstrip("\n"))
    for name, sub in graph.subgraphs.items():
        _render_graph(sub, f"{title}.{name}", out)


def path_of(program: Program, backend: str) -> str:
    return os.path.join(GOLDEN_DIR, backend, f"{program.name}.txt")


def diff(expected: str, actual: str, path: str) -> str:
    return "".join(
        difflib.unified_diff(
            expected.splitlines(True), actual.splitlines(True), f"{path} (checked in)", f"{path} (generated)"
        )
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="compare only, write nothing")
    parser.add_argument("names", nargs="*", help="only these programs")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=FutureWarning)
    gjit.config.cache_dir = tempfile.mkdtemp(prefix="gjit_golden_")
    failed = 0
    for program in PROGRAMS:
        if args.names and program.name not in args.names:
            continue
        for backend in BACKENDS:
            path = path_of(program, backend)
            text = generate(program, backend)
            old = open(path, encoding="utf-8").read() if os.path.exists(path) else ""
            if old == text:
                continue
            failed += 1
            if args.check:
                print(diff(old, text, os.path.relpath(path)))
            else:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "w", encoding="utf-8") as f:
                    f.write(text)
                print(f"wrote {os.path.relpath(path)}")
    if args.check and failed:
        print(f"{failed} golden file(s) differ", file=sys.stderr)
    return 1 if args.check and failed else 0


if __name__ == "__main__":
    sys.exit(main())
