"""One kernel for regions that came out as the same code: a transformer's layers.

Each region gets its own kernel, named and commented after its own nodes, so layer 3's attention
kernel differs from layer 0's only in its name and its comments. A region whose kernel is the
same code as an earlier one's, but for those, launches the earlier kernel (`code_of`): the runtime
binds the region's kernel name to the earlier kernel's function, so the wrapper and tuning's
probes still see each region's own launch, and each distinct kernel is written, imported, and
built for a GPU once (by Triton's JIT at its first launch, or by `gjit.aot`), as TorchInductor
launches one kernel for identical regions. The later region keeps its own `KernelSource` (its
arguments, nodes, assumptions and source lines) and its own source for reading, with a header
line that says whose code runs.

The same code means the same text once comments and blank lines are dropped and the kernel's
name and its size parameters' names are replaced by placeholders, and the same launch-time
compile inputs: argument types, block sizes, warps and stages. Anything else that differs keeps
the kernels apart.
"""

from __future__ import annotations

import re

from gjit.codegen.common import KernelSource

_STRING_OR_COMMENT = re.compile(r"(\"[^\"\n]*\"|'[^'\n]*')|#[^\n]*")
_WORD = re.compile(r"\w+")


def share_code(kernels: list[KernelSource]) -> None:
    """Point each kernel whose code an earlier kernel of `kernels` already has at that kernel."""
    first: dict[tuple, str] = {}
    for kernel in kernels:
        key = code_key(kernel)
        if key not in first:
            first[key] = kernel.name
            continue
        kernel.code_of = first[key]
        comment = "//" if kernel.backend == "cuda" else "#"
        head, _, rest = kernel.source.partition("\n")
        note = f"{comment} runs as {kernel.code_of}: the same code but for its name and comments"
        kernel.source = f"{head}\n{note}\n{rest}"


def code_key(kernel: KernelSource) -> tuple:
    """What `kernel` compiles from: its code without comments, with its own name and its size
    parameters' names replaced by placeholders (sizes are arguments: two layers whose inputs have
    sizes of their own run one kernel), and what the launch specializes on besides the arguments'
    values."""
    renamed = {kernel.name: "<kernel>"} | {s.name: f"<size{i}>" for i, s in enumerate(kernel.size_args)}
    code = (
        _cuda_code(kernel.source, renamed) if kernel.backend == "cuda" else code_text(kernel.source, renamed)
    )
    return (
        kernel.backend,
        code,
        tuple((renamed.get(name, name), kind) for name, kind in kernel.signature.items()),
        tuple(sorted(kernel.blocks.items())),
        tuple(sorted(kernel.launch_blocks.items())),
        kernel.num_warps,
        kernel.num_stages,
        kernel.index_dtype,
    )


def code_text(source: str, renamed: dict[str, str]) -> str:
    """The Python source renamed, with its comments (outside one-line string literals: generated
    kernels have no other) and blank lines dropped."""
    code = _STRING_OR_COMMENT.sub(lambda m: m.group(1) or "", source)
    code = "\n".join(ln.rstrip() for ln in code.splitlines() if ln.strip())
    return _WORD.sub(lambda m: renamed.get(m.group(0), m.group(0)), code)


def _cuda_code(source: str, renamed: dict[str, str]) -> str:
    """CUDA C, renamed, with its whole-line `//` comments dropped (a trailing comment keeps
    kernels apart)."""
    code = "\n".join(ln for ln in source.splitlines() if not ln.lstrip().startswith("//"))
    return _WORD.sub(lambda m: renamed.get(m.group(0), m.group(0)), code)
