"""CUDA graphs for `gjit.compile(model, mode="reduce-overhead")`: an entry's launches recorded once
per concrete set of sizes and replayed.

An entry's calls arrive here with the graph inputs (live parameters and buffers, then the call's
own tensors) and the size symbols its guard bound. The first call of a set of sizes runs as usual
(it is the warm-up: kernels built and loaded, lazy state made); the second is run once more on a
side stream and recorded there in a `torch.cuda.CUDAGraph` with a private memory pool, as torch
documents; later calls of those sizes replay the graph on the caller's current stream.

What a graph reads and writes lives at the addresses it was recorded with:
- an input whose memory is the caller's: parameters, buffers, constants, any input the program
  writes (a static KV cache's `index_put_`) and tensors that are `nn.Parameter`s or marked with
  `torch._dynamo.mark_static_address` (torch.compile's parameters arrive as inputs) are
  *borrowed*: the graph reads them where they are, and a call replays a recording only when each
  is at the address it was recorded at (a replaced parameter or a new cache records anew);
- every other input is *owned*: the recording keeps a buffer of its own that a call's tensor is
  copied into before the replay, unless it is already there;
- outputs live in the graph's pool and are handed out as aliases. A recording whose outputs the
  caller still holds (an alias or a view of one is alive: the storages' use counts, as torch's
  cudagraph trees check them) is not replayed, since the replay would overwrite them: another
  recording is made, within the bound. Outputs that are (views of) borrowed inputs are handed out
  as (views of) the call's own tensors.

An entry holds at most `gjit.config.cuda_graph_limit` recordings; past it (and for what cannot be
recorded: CPU tensors, host syncs and data-dependent sizes, random numbers, torch.cond on data, the
cupy backend, GJIT_CHECK, a failed capture) calls run without a graph, each reason logged once
under GJIT_LOGS=cudagraphs and counted in gjit.stats() as `cuda_graph_skipped:<reason>`.

The graph API is injectable (`graph_api`): `TorchGraphs` on a GPU; the tests' stand-in records by
running the wrapper and replays by running it again into the recorded outputs, so the bookkeeping
here is tested on CPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
import re
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from gjit import logs, stats
from gjit.config import CUDA_GRAPH_MODES, MODES, config
from gjit.fusion.writes import draws
from gjit.wrapper import graph_device

log = logs.logger("cudagraphs")

Run = Callable[[list], list]  # the entry's graph run on a list of graph inputs

FIRST_CALL = "first call of these sizes (the warm-up)"
AT_LIMIT = "the entry holds gjit.config.cuda_graph_limit graphs"
SEEN_KEYS = 1024  # sizes remembered per entry for "seen before" (oldest forgotten first)
# a wrapper line binding a data-dependent size: torch names those symbols u0, u1 (floats zuf0)
UNBACKED = re.compile(r"^\s*(u|zuf)\d+ = ", re.MULTILINE)


def resolve_mode(mode: str | None) -> str:
    """torch.compile's `mode`, checked: None is gjit.config.mode (GJIT_MODE)."""
    mode = config.mode if mode is None else mode
    if mode not in MODES:
        raise ValueError(f"gjit.compile: unknown mode {mode!r}, expected one of {MODES}")
    return mode


class GraphAPI(Protocol):
    def refusal(self, graph: Any, inputs: list) -> str | None: ...
    def stream(self, device: torch.device) -> Any: ...
    def wait(self, stream: Any, other: Any) -> None: ...
    def warm_up(self, run: Run, inputs: list, device: torch.device) -> list: ...
    def capture(self, run: Run, inputs: list, device: torch.device) -> tuple[Any, list]: ...
    def replay(self, handle: Any, inputs: list) -> None: ...
    def wait_idle(self) -> None: ...


class TorchGraphs:
    """torch's CUDA graph API. One capture at a time in the process (torch's rule); captures use a
    side stream per device, in "thread_local" error mode so other threads' CUDA calls go on."""

    _capture_lock = threading.Lock()
    _side: dict[torch.device, torch.cuda.Stream] = {}

    def refusal(self, graph: Any, inputs: list) -> str | None:
        if not graph.on_cuda:
            return "the program runs on CPU tensors"
        if any(isinstance(t, torch.Tensor) and not t.is_cuda for t in inputs):
            return "a graph input is a CPU tensor"
        return None

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        return torch.cuda.current_stream(device)

    def wait(self, stream: torch.cuda.Stream, other: torch.cuda.Stream) -> None:
        stream.wait_stream(other)

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._side:
            self._side[device] = torch.cuda.Stream(device)
        return self._side[device]

    def warm_up(self, run: Run, inputs: list, device: torch.device) -> list:
        """One run on the side stream the capture uses (lazy per-stream state, cuBLAS workspaces,
        is made there, not inside the capture); its outputs are the call's."""
        caller, side = torch.cuda.current_stream(device), self._side_stream(device)
        with self._capture_lock, torch.cuda.device(device):
            side.wait_stream(caller)
            with torch.cuda.stream(side):
                out = run(inputs)
            caller.wait_stream(side)
        for t in out:
            if isinstance(t, torch.Tensor) and t.is_cuda:
                t.record_stream(caller)  # made on the side stream, used on the caller's
        return out

    def capture(self, run: Run, inputs: list, device: torch.device) -> tuple[torch.cuda.CUDAGraph, list]:
        graph = torch.cuda.CUDAGraph()
        with self._capture_lock, torch.cuda.device(device):
            caller, side = torch.cuda.current_stream(device), self._side_stream(device)
            try:
                # torch.cuda.graph ends the capture on the way out, also when the run raised
                with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
                    out = run(inputs)
            finally:  # where ending an invalidated capture raised, the side stream is still current
                torch.cuda.set_stream(caller)
        if any(isinstance(t, torch.Tensor) and not t.is_cuda for t in out):
            raise RuntimeError("an output is a CPU tensor, which a replay would not recompute")
        return graph, out

    def replay(self, handle: torch.cuda.CUDAGraph, inputs: list) -> None:
        handle.replay()  # on the current stream

    def wait_idle(self) -> None:
        torch.cuda.synchronize()  # a replay in flight still uses the graph and its memory


_API: list[GraphAPI] = [TorchGraphs()]


@contextlib.contextmanager
def graph_api(api: GraphAPI) -> Iterator[None]:
    """Entries created inside the block record with `api` (the tests' stand-in on CPU)."""
    _API.append(api)
    try:
        yield
    finally:
        _API.remove(api)


def unrecordable(graph: Any) -> str | None:
    """Why a compiled graph cannot be recorded whatever its inputs, or None."""
    if graph.checker is not None:
        return "GJIT_CHECK reads every kernel's outputs on the host"
    if any(k.backend == "cuda" for k in graph.all_kernels()):
        return "the cupy backend: its CuPy launches (on torch's stream) are not yet checked under capture"
    if any(UNBACKED.search(g.wrapper_source) for g in graph.all_graphs()):
        return "its wrapper reads a data-dependent size (a host sync: nonzero, a boolean mask, .item())"
    for module in graph.graph_module.modules():  # torch.cond branches and other subgraphs too
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.nodes:
            why = _node_refusal(node) if node.op == "call_function" else None
            if why is not None:
                return f"{node.name} ({node.target}) {why}"
    return None


def _node_refusal(node: torch.fx.Node) -> str | None:
    target = node.target
    if target is torch.ops.higher_order.cond and _is_tensor(node.args[0]):
        return "picks its branch on a tensor's value (a host sync)"
    if target is torch.ops.higher_order.while_loop:
        return "reads its condition on the host every iteration"
    if isinstance(target, torch._ops.OpOverload):
        tags = target.tags
        if draws(node):
            return "draws random numbers (gjit registers no generator state with CUDA graphs)"
        if torch.Tag.data_dependent_output in tags:
            return "reads tensor values on the host (a host sync)"
    return None


def _is_tensor(value: Any) -> bool:
    if not isinstance(value, torch.fx.Node):
        return isinstance(value, torch.Tensor)
    val = value.meta.get("val")
    if val is not None:
        return isinstance(val, torch.Tensor)
    if value.op == "placeholder":
        return True
    target = value.target
    return isinstance(target, torch._ops.OpOverload) and "Tensor" in str(target._schema.returns)


def _use_count(ref: StorageWeakRef) -> int:
    return torch._C._storage_Use_Count(ref.cdata)


@dataclasses.dataclass(eq=False)
class Recording:
    """One recorded graph: its sizes, the addresses it reads, its own buffers and outputs."""

    key: tuple
    handle: Any  # a torch.cuda.CUDAGraph (or the tests' stand-in)
    pointers: list[int]  # each borrowed input's data_ptr when recorded
    borrowed_refs: list[StorageWeakRef]  # their storages (expired: the recording is stale)
    buffers: list[torch.Tensor]  # an owned buffer per owned input
    # per graph output: ("static", tensor) in the pool or an owned buffer, handed out as an alias;
    # ("input", i, size, stride, offset, exact): (a view of) borrowed input i; ("value", v)
    outputs: list[tuple]
    watched: list[tuple[StorageWeakRef, int]] = dataclasses.field(default_factory=list)  # + own uses
    stream: Any = None  # the stream of its latest replay

    def outputs_held(self) -> bool:
        """Whether anything outside the recording still uses an output's memory."""
        return any(_use_count(ref) > own for ref, own in self.watched)

    def stale(self) -> bool:
        """A borrowed input it was recorded with is gone (a new cache, a replaced parameter)."""
        return any(ref.expired() for ref in self.borrowed_refs)

    def hand_out(self, inputs: list) -> list:
        out, aliases = [], {}
        for spec in self.outputs:
            kind = spec[0]
            if kind == "static":
                t = spec[1]
                if id(t) not in aliases:  # an output returned twice is one tensor, as in eager
                    aliases[id(t)] = t.detach()
                out.append(aliases[id(t)])
            elif kind == "input":
                _, i, size, stride, offset, exact = spec
                t = inputs[i]
                out.append(t if exact else t.as_strided(size, stride, t.storage_offset() + offset))
            else:
                out.append(spec[1])
        return out


class CudaGraphs:
    """The CUDA graphs of one entry (mode="reduce-overhead"): `run` is the entry's graph run."""

    def __init__(self, graph: Any, captured: Any, name: str):
        self.graph = graph  # the entry's CompiledGraph
        self.name = name
        self.api = _API[-1]
        written = {key for kind, key in captured.mutations.values() if kind == "user"}
        # graph inputs read (and written) where they are: parameters, buffers, constants, and the
        # call's tensors the program writes
        self.in_place = {
            i for i, (kind, key) in enumerate(captured.input_sources) if kind != "user" or key in written
        }
        self.recordings: list[Recording] = []
        self.seen: dict[tuple, None] = {}
        self.refused: str | None = None
        self.replays = 0
        self.skipped: Counter[str] = Counter()
        self._layout: tuple | None = None  # (borrowed, owned, values) graph input indices
        self._borrowed: Callable[[list], tuple] = _getter([])
        self._device = torch.device("cpu")
        self._logged: set[str] = set()
        self._lock = threading.Lock()  # one thread at a time picks, replays and hands out

    # -- the call path ---------------------------------------------------------------------------

    def run(self, inputs: list, sizes: tuple) -> list:
        if self.refused is None and self._layout is None:
            self._first_look(inputs)
        if self.refused is not None:
            return self._without(self.refused, inputs, sizes)
        borrowed, owned, values = self._layout
        key = (sizes, *[inputs[i] for i in values], torch.is_inference_mode_enabled())
        with self._lock:
            choice = self._choose(key, inputs)
            if isinstance(choice, Recording):
                return self._replay(choice, inputs)
            if choice is None:
                return self._record(key, inputs, sizes)
        return self._without(choice, inputs, sizes)

    def _first_look(self, inputs: list) -> None:
        """Whether this entry can record at all, and which inputs are borrowed, owned or values
        (the guards keep every later call's the same)."""
        self.refused = unrecordable(self.graph) or self.api.refusal(self.graph, inputs)
        if self.refused is not None:
            return
        tensors = [i for i, t in enumerate(inputs) if isinstance(t, torch.Tensor)]
        borrowed = [i for i in tensors if i in self.in_place or _static_address(inputs[i])]
        values = [i for i, t in enumerate(inputs) if not isinstance(t, torch.Tensor)]
        try:
            hash(tuple(inputs[i] for i in values))  # they are part of a recording's key
        except TypeError:
            kinds = sorted({type(inputs[i]).__name__ for i in values})
            self.refused = f"a graph input is a {', '.join(kinds)}, not a tensor or a hashable value"
            return
        self._borrowed = _getter(borrowed)
        self._device = graph_device(self.graph.graph_module.graph.nodes)
        self._layout = (borrowed, [i for i in tensors if i not in borrowed], values)

    def _choose(self, key: tuple, inputs: list) -> Recording | str | None:
        """A recording to replay; or why the call runs without a graph; or None: record one."""
        pointers = None
        why = FIRST_CALL
        for rec in self.recordings:
            if rec.key != key:
                continue
            if pointers is None:
                pointers = [t.data_ptr() for t in self._borrowed(inputs)]
            if pointers != rec.pointers:
                why = "a parameter, buffer or input it writes is at a new address"
            elif rec.outputs_held():
                why = "the caller still holds the outputs of its last replay"
            else:
                return rec
        if why == FIRST_CALL and key not in self.seen:
            self.seen[key] = None
            if len(self.seen) > SEEN_KEYS:
                del self.seen[next(iter(self.seen))]
            return FIRST_CALL
        self._drop_stale()
        if len(self.recordings) >= config.cuda_graph_limit:
            return AT_LIMIT if why == FIRST_CALL else f"{why}, and {AT_LIMIT}"
        if why != FIRST_CALL:
            log.info("%s: another graph for sizes %s: %s", self.name, key[0], why)
        return None

    def _drop_stale(self) -> None:
        """Drop the recordings that read a tensor which is gone (the cache of an earlier
        generate(), a replaced parameter): the address may come back, the tensor will not."""
        stale = [r for r in self.recordings if r.stale()]
        if stale:
            self.api.wait_idle()
            self.recordings = [r for r in self.recordings if r not in stale]
            sizes = ", ".join(str(r.key[0]) for r in stale)
            log.info("%s: dropped the graphs of sizes %s (an input they read is gone)", self.name, sizes)

    def _replay(self, rec: Recording, inputs: list) -> list:
        stream = self.api.stream(self._device)
        if rec.stream is not None and rec.stream != stream:
            self.api.wait(stream, rec.stream)  # the last replay's readers were on that stream
        _, owned, _ = self._layout
        moved = [(b, inputs[i]) for i, b in zip(owned, rec.buffers) if inputs[i].data_ptr() != b.data_ptr()]
        if moved:
            torch._foreach_copy_([b for b, _ in moved], [t for _, t in moved])
            stats.count("cuda_graph_input_copies", len(moved))
        self.api.replay(rec.handle, self._graph_inputs(inputs, rec.buffers))
        rec.stream = stream
        self.replays += 1
        stats.count("cuda_graph_replays")
        return rec.hand_out(inputs)

    def _without(self, why: str, inputs: list, sizes: tuple) -> list:
        self.skipped[why] += 1
        stats.count(f"cuda_graph_skipped:{why}")
        if why not in self._logged:
            self._logged.add(why)
            log.info("%s: calls run without a CUDA graph: %s", self.name, why)
        return self.graph.run(inputs, sizes)

    # -- recording -------------------------------------------------------------------------------

    def _graph_inputs(self, inputs: list, buffers: list[torch.Tensor]) -> list:
        """The call's graph inputs with each owned input replaced by its buffer."""
        _, owned, _ = self._layout
        static = list(inputs)
        for i, buffer in zip(owned, buffers):
            static[i] = buffer
        return static

    def _record(self, key: tuple, inputs: list, sizes: tuple) -> list:
        """Warm up and record a graph for this call; the warm-up's outputs are the call's."""
        _, owned, _ = self._layout
        if any(_overlaps(inputs[i]) for i in owned):
            why = "an input's elements overlap (an expanded tensor): no buffer of its layout holds it"
            return self._without(why, inputs, sizes)
        buffers = [_buffer_like(inputs[i]) for i in owned]
        static = self._graph_inputs(inputs, buffers)
        run = lambda graph_inputs: self.graph.run(graph_inputs, sizes)  # noqa: E731
        out = None
        try:
            out = self.api.warm_up(run, static, self._device)
            handle, recorded = self.api.capture(run, static, self._device)
            rec = self._recording(key, handle, static, buffers, recorded)
        except Exception as e:
            first_line = (str(e).splitlines() or [""])[0]
            self.refused = f"recording failed: {type(e).__name__}: {first_line}"
            log.warning(
                "gjit: %s: a CUDA graph could not be recorded (%s); its calls run without one",
                self.name,
                self.refused,
            )
            if out is None:
                return self._without(self.refused, inputs, sizes)
            return self._own_copies(out, buffers)
        self.recordings.append(rec)
        stats.count("cuda_graphs_recorded")
        log.info("%s: recorded a CUDA graph for sizes %s (%d held)", self.name, key[0], len(self.recordings))
        return self._own_copies(out, buffers)

    @staticmethod
    def _own_copies(out: list, buffers: list[torch.Tensor]) -> list:
        """The warm-up's outputs, with any that views an owned buffer copied: the next replay
        copies new inputs into those buffers, and the call's outputs must not change then."""
        mine = {b.untyped_storage().data_ptr() for b in buffers}
        return [
            t.clone() if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in mine else t
            for t in out
        ]

    def _recording(self, key: tuple, handle: Any, static: list, buffers: list, recorded: list) -> Recording:
        borrowed, _, _ = self._layout
        by_storage = {static[i].untyped_storage().data_ptr(): i for i in borrowed}
        outputs: list[tuple] = []
        for t in recorded:
            if not isinstance(t, torch.Tensor):
                outputs.append(("value", t))
                continue
            i = by_storage.get(t.untyped_storage().data_ptr())
            if i is None:
                outputs.append(("static", t))
                continue
            base = static[i]
            if t.dtype != base.dtype:
                raise RuntimeError(f"an output views graph input {i} as {t.dtype}")
            offset = t.storage_offset() - base.storage_offset()
            exact = offset == 0 and t.shape == base.shape and t.stride() == base.stride()
            outputs.append(("input", i, tuple(t.shape), t.stride(), offset, exact))
        rec = Recording(
            key,
            handle,
            [static[i].data_ptr() for i in borrowed],
            [StorageWeakRef(static[i].untyped_storage()) for i in borrowed],
            buffers,
            outputs,
        )
        storages = {s[1].untyped_storage().data_ptr(): s[1] for s in outputs if s[0] == "static"}
        refs = [StorageWeakRef(t.untyped_storage()) for t in storages.values()]
        # the recording's own tensors are all that use them now: more uses later are the caller's
        rec.watched = [(ref, _use_count(ref)) for ref in refs]
        return rec

    # -- invalidation and reports ------------------------------------------------------------------

    def clear(self) -> None:
        """Drop every recording (their memory) and the sizes seen; a refusal stays."""
        with self._lock:
            if self.recordings:
                self.api.wait_idle()
            self.recordings.clear()
            self.seen.clear()

    def describe(self) -> str:
        if self.refused is not None:
            return f"off: {self.refused}"
        held = ", ".join(str(r.key[0]) for r in self.recordings) or "none yet"
        skipped = "; ".join(f"{n} x {why}" for why, n in self.skipped.items()) or "none"
        return (
            f"{len(self.recordings)} graph(s) held (sizes {held}; at most {config.cuda_graph_limit}), "
            f"{self.replays} replay(s); runs without a graph: {skipped}"
        )


def _static_address(t: torch.Tensor) -> bool:
    """A tensor expected to stay where it is between calls: a parameter, or one marked with
    torch._dynamo.mark_static_address (as torch's cudagraph trees treat them)."""
    return isinstance(t, torch.nn.Parameter) or getattr(t, "_dynamo_static_input_type", None) is not None


def _overlaps(t: torch.Tensor) -> bool:
    """Elements sharing memory (an expanded dim): no buffer of that layout can be copied into."""
    return any(stride == 0 and size > 1 for size, stride in zip(t.shape, t.stride()))


def _buffer_like(t: torch.Tensor) -> torch.Tensor:
    """An owned buffer of `t`'s layout holding its values; a normal tensor, so that calls in and
    out of inference mode can copy into it."""
    with torch.inference_mode(False):
        buffer = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=t.device)
    buffer.copy_(t)
    return buffer


def _getter(indices: list[int]) -> Callable[[list], tuple]:
    """inputs -> the inputs at `indices`, as a tuple (operator.itemgetter, for any count)."""
    if not indices:
        return lambda inputs: ()
    if len(indices) == 1:
        i = indices[0]
        return lambda inputs: (inputs[i],)
    return operator.itemgetter(*indices)


def for_entry(mode: str, program: Any, name: str) -> CudaGraphs | None:
    """The CUDA graphs of a new entry when its callable's mode records them."""
    return CudaGraphs(program.graph, program.captured, name) if mode in CUDA_GRAPH_MODES else None


def release(entries: list) -> None:
    """Drop the recordings of these entries (a new entry, gjit.reset())."""
    for entry in entries:
        if entry.graphs is not None:
            entry.graphs.clear()
