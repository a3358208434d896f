"""Masks a program reads from a buffer or a constant tensor rather than building them from its sizes
(minGPT's and nanoGPT's `bias`: `tril(ones(N, N))` registered once at the longest length and sliced
to each call's): their contents, read once at compile time as a value gjit/lowering/causal.py's
proofs take (`Held`), and read again by the entry's guard where the tensor may have changed
(guards/state.py: another tensor, memory or strides, or an in-place write, which bumps its version
counter). Like autograd's checks, the guard does not see writes the version counter does not (through
`.data`, NumPy or DLPack); GJIT_HELD_MASKS=0 keeps every proof off contents.

What a tensor may hold to be read (`Band`): every dim of size 1 but the last two (rows i, columns
j), and in those one value where j - i <= offset and another elsewhere (tril, triu, their
complements; as bools, 0 and 1, 0 and -inf, ...), or one value everywhere, compared bit for bit.
Anything else (a padding pattern, a sliding window, a NaN, more than MAX_ELEMENTS elements, a tensor
without a version counter) is no value, and the proofs fail as for a tensor input.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import Any

import sympy
import torch
from torch.export.graph_signature import InputKind

from gjit.lowering.mask_values import Value, number_of

log = logging.getLogger("gjit.lowering")
MAX_ELEMENTS = 1 << 22  # a larger tensor is not read (its check costs a pass over it)
DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
          torch.float16, torch.bfloat16, torch.float32, torch.float64)  # fmt: skip
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # a float compared by its bits


@dataclasses.dataclass(frozen=True)
class Band:
    """A tensor of `shape` and `dtype` whose last two dims hold `inside` where j - i <= `offset`
    and `outside` elsewhere (the same value: one everywhere)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    inside: bool | int | float
    outside: bool | int | float

    def __str__(self) -> str:
        if self.inside == self.outside:
            return f"{self.inside} everywhere ({self.dtype}, {list(self.shape)})"
        where = f"{self.inside} where j - i <= {self.offset}, else {self.outside}"
        return f"{where} ({self.dtype}, {list(self.shape)})"

    def expected(self, device: torch.device) -> torch.Tensor:
        rows, cols = self.shape[-2:]
        d = _differences(rows, cols, device)
        inside, outside = (torch.tensor(x, dtype=self.dtype, device=device) for x in self.values)
        return torch.where(d <= self.offset, inside, outside).view(self.shape)

    def holds(self, t: object) -> bool:
        """Whether `t` is a tensor of this band (its shape, dtype and contents, bit for bit) whose
        writes its version counter sees (not an inference tensor)."""
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != self.shape or t.dtype != self.dtype:
            return False
        if t.is_neg() or t.layout != torch.strided or not _versioned(t):
            return False
        with torch.no_grad():
            return torch.equal(_bits(t), _bits(self.expected(t.device)))

    @property
    def values(self) -> tuple:
        return self.inside, self.outside

    def value(self) -> Value:
        """Its element over one index symbol per dim of size above 1 (mask_values.py's `Value`)."""
        dims = [None if n == 1 else sympy.Dummy(integer=True, nonnegative=True) for n in self.shape]
        if self.inside == self.outside:
            return Value(_as_expr(self.inside), (None,) * len(dims))
        i, j = dims[-2:]
        within = sympy.Le(j - i, self.offset)
        if self.dtype == torch.bool:
            return Value(within if self.inside else sympy.Not(within), tuple(dims))
        branches = ((_as_expr(self.inside), within), (_as_expr(self.outside), True))
        return Value(sympy.Piecewise(*branches), tuple(dims))

    def record(self) -> list:
        """JSON for the cache and packages (a float by its repr: exact, and -inf too)."""
        return [list(self.shape), str(self.dtype).removeprefix("torch."), self.offset,
                repr(self.inside), repr(self.outside)]  # fmt: skip

    @staticmethod
    def from_record(record: list) -> Band:
        shape, dtype_name, offset, inside, outside = record
        dtype = getattr(torch, dtype_name)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"not a dtype: {dtype_name}")
        parse = _parser(dtype)
        return Band(tuple(int(n) for n in shape), dtype, int(offset), parse(inside), parse(outside))


def _parser(dtype: torch.dtype) -> Callable[[str], bool | int | float]:
    if dtype == torch.bool:
        return {"True": True, "False": False}.__getitem__
    return float if dtype.is_floating_point else int


def _as_expr(x: bool | int | float) -> sympy.Basic:
    number = number_of(x)
    if number is None:
        raise ValueError(f"no value for {x!r}")
    return number


def _differences(rows: int, cols: int, device: torch.device) -> torch.Tensor:
    """j - i for each row i and column j."""
    return torch.arange(cols, device=device)[None, :] - torch.arange(rows, device=device)[:, None]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A float tensor as integers of its width (-0.0 is not 0.0), any other as it is."""
    return t.view(BITS[t.element_size()]) if t.dtype.is_floating_point else t


def _versioned(t: torch.Tensor) -> bool:
    try:
        t._version  # noqa: B018
    except RuntimeError:
        return False
    return True


def band_of(t: torch.Tensor) -> Band | None:
    """The band `t` holds, or None (the module's doc)."""
    shape = tuple(t.shape)
    if t.dim() < 2 or any(n != 1 for n in shape[:-2]) or min(shape[-2:]) < 2 or t.numel() > MAX_ELEMENTS:
        return None
    if t.dtype not in DTYPES or t.is_neg() or t.layout != torch.strided or t.device.type == "meta":
        return None
    if not _versioned(t):  # an inference tensor: the guard could not see a write
        return None
    with torch.no_grad():
        rows, cols = shape[-2:]
        m = t.reshape(rows, cols)
        inside, outside = m[-1, 0].item(), m[0, -1].item()  # j - i least and greatest
        if inside != inside or outside != outside:  # NaN
            return None
        if _bits(m[-1:, :1]).item() == _bits(m[:1, -1:]).item():
            band = Band(shape, t.dtype, 0, inside, inside)
        else:
            d = _differences(rows, cols, t.device)
            offset = int(d[_bits(m) == _bits(m[-1:, :1])].max().item())
            band = Band(shape, t.dtype, offset, inside, outside)
        return band if band.holds(t) else None


class Held:
    """The buffers and constant tensors of one program a proof may read, by placeholder name, with
    the `bands` they hold by (kind, qualified name) (the compile's `program_bands`, or a cached
    entry's stored ones); `proved` keeps those a proof a rewrite used read, which the entry's guard
    then checks."""

    def __init__(self, sources: dict[str, tuple[str, str]], bands: dict[tuple[str, str], Band]):
        self.sources = sources  # placeholder name -> (kind, qualified name): "buffer" or "constant"
        self.bands = bands
        self.proved: dict[tuple[str, str], Band] = {}

    def value(self, node: torch.fx.Node) -> Value | None:
        """The value of the placeholder `node` where it is a buffer or constant holding a band of
        its traced shape (mask_values.py's `Evaluator` reads it), else None."""
        band = self.bands.get(self.sources.get(node.name))
        val = node.meta.get("val")
        if band is None or not isinstance(val, torch.Tensor) or val.shape != band.shape:
            return None
        return band.value()

    def read_by_proof(self, nodes: set) -> None:
        """The placeholders a proof a rewrite used read: their bands are the entry's to check."""
        for node in nodes:
            source = self.sources[node.name]
            self.proved[source] = self.bands[source]
            log.info("mask %s: the proof read %s %s, which holds %s", node.name, *source, self.proved[source])

    def record(self) -> list:
        """`proved` as JSON: [kind, qualified name, band] each (CompiledGraph.held)."""
        return [[kind, name, band.record()] for (kind, name), band in sorted(self.proved.items())]


def _read(band: Callable[[str, str], Band | None], kind: str, name: str) -> Band | None:
    """`band(kind, name)`, None where reading fails (an optimization: never a reason not to compile)."""
    try:
        return band(kind, name)
    except Exception as e:
        log.debug("the %s %s is not read (%s: %s)", kind, name, type(e).__name__, e)
        return None


def program_bands(program: Any, module: torch.nn.Module | None) -> dict[tuple[str, str], Band]:
    """The band each buffer and constant of an ExportedProgram holds, by (kind, qualified name),
    where it holds one: what a mask's proof may read, and so part of the on-disk cache's key (a
    module whose mask holds another compiles its own entry). A buffer is read from `module` (the
    live one; None: the program's own state)."""
    kinds = {InputKind.BUFFER: "buffer", InputKind.CONSTANT_TENSOR: "constant"}
    read = functools.partial(_program_band, program, module)
    found = (
        (kinds[spec.kind], spec.target) for spec in program.graph_signature.input_specs if spec.kind in kinds
    )
    bands = {source: _read(read, *source) for source in found}
    return {source: band for source, band in bands.items() if band is not None}


def _program_band(program: Any, module: torch.nn.Module | None, kind: str, name: str) -> Band | None:
    if kind == "constant":
        t = program.constants[name]
    elif module is None:  # (a non-persistent buffer is one of the program's constants)
        t = {**program.constants, **program.state_dict}[name]
    else:
        owner, _, attr = name.rpartition(".")
        t = getattr(module.get_submodule(owner), attr)
    return band_of(t) if isinstance(t, torch.Tensor) else None


def held_inputs(gm: torch.fx.GraphModule, sources: list[tuple[str, Any]], bands: dict) -> Held:
    """The buffers and constants among `gm`'s placeholders (`sources`: each one's (kind, qualified
    name), in order, as gjit/capture/export.py's CapturedProgram has them), with their `bands`."""
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    held = {name: source for name, source in zip(names, sources) if source[0] in ("buffer", "constant")}
    return Held(held, bands)


def bands_from_record(record: list) -> dict[tuple[str, str], Band]:
    return {(kind, name): Band.from_record(band) for kind, name, band in record}
