"""One kernel for regions that came out as the same code: a transformer's layers.

Each region gets its own kernel, named and commented after its own nodes, so layer 3's attention
kernel differs from layer 0's only in its name and its comments. A region whose kernel is the
same code as an earlier one's, but for those, launches the earlier kernel (`code_of`): each
distinct kernel is written, imported, and built for a GPU once (by Triton's JIT at its first
launch, or by `gjit.aot`), as TorchInductor launches one kernel for identical regions. The later
region keeps its own `KernelSource` (its arguments, nodes, assumptions and source lines) and its
own source for reading, with a header line that says whose code runs.

The same code means the same tokens once comments are dropped and the kernel's name and its size
parameters' names are replaced by placeholders, and the same launch-time compile inputs: argument
types, block sizes, warps and stages. Anything else that differs keeps the kernels apart.
"""

from __future__ import annotations

import io
import re
import tokenize

from gjit.codegen.common import KernelSource


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
        _cuda_code(kernel.source, renamed)
        if kernel.backend == "cuda"
        else _triton_code(kernel.source, renamed)
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


def _triton_code(source: str, renamed: dict[str, str]) -> tuple:
    """Python's tokens of the source, renamed: comments and blank lines dropped, exactly."""
    skip = {tokenize.COMMENT, tokenize.NL}
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return tuple((tok.type, renamed.get(tok.string, tok.string)) for tok in tokens if tok.type not in skip)


def _cuda_code(source: str, renamed: dict[str, str]) -> str:
    """CUDA C, renamed, with its whole-line `//` comments dropped (a trailing comment keeps
    kernels apart)."""
    code = "\n".join(ln for ln in source.splitlines() if not ln.lstrip().startswith("//"))
    return re.sub(r"\b\w+\b", lambda m: renamed.get(m.group(0), m.group(0)), code)
