"""On a GPU: a compiled graph's kernel launches through pre-bound compiled kernels.

Triton's launcher (`kernel[grid](*args)`, `JITFunction.run`) works out on every launch how the
arguments specialize the kernel (a pointer 16-byte aligned or not, an int equal to 1, divisible by
16, 32- or 64-bit), formats that into a string key, looks the compiled kernel up, checks the globals
it read, builds launch metadata, then calls the compiled kernel's own launcher: about 8 us of host
time a launch on the development machine, of which the launcher is 1.6 (`bench/launch_overhead.py`).

A `Launcher` stands for one kernel in a device wrapper's namespace (the wrapper still writes
`name[grid](*args, **constexprs)`). Its variants are keyed on what Triton's binder specializes on,
or finer: per tensor argument whether its address is 16-byte aligned, per int argument whether it
is 1, whether it is divisible by 16, whether it fits an int32; the keyword arguments (constexprs,
num_warps, num_stages) by value; the device. The first launch of a variant goes through
`JITFunction.run` (its binder, compile, on-disk cache and hooks, and gjit's prebuild), which returns
the compiled kernel it launched; later launches of the variant call that kernel's launcher
(`CompiledKernel.run`, Triton's own) directly on the current device's current stream. The key is a
tuple built by a function generated once per launch signature, so a cached launch costs the key,
one dict lookup and Triton's launcher.

What the fast path leaves out, because gjit's generated kernels never need it: Triton's check that
the globals a kernel read have not changed (a generated module's globals are its imports), pre-run
hooks and the stage-inspection hook (a kernel or a process that has them launches every time
through `JITFunction.run`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
import triton
from triton.runtime.driver import driver

INT32 = (-(2**31), 2**31 - 1)


def _key_source(kinds: tuple[str, ...], keywords: tuple[str, ...]) -> str:
    """A key function's source for launches whose positional arguments are of `kinds` ('t': a
    tensor, 'i': an int, 'v': anything else, keyed by value) and whose keyword arguments are
    `keywords`: `key(device, args, kwargs)` -> the variant's key. A launch of another signature or
    kind raises (a wrong count, a missing name, an int where a tensor was) and takes Triton's path."""
    names = [f"a{i}" for i in range(len(kinds))]
    parts = ["device"]
    for a, kind in zip(names, kinds):
        if kind == "t":
            parts.append(f"{a}.data_ptr() & 15 == 0")
        elif kind == "i":
            parts.append(f"(3 if {a} == 1 else ({a} & 15 == 0) + 4 * ({a} < {INT32[0]} or {a} > {INT32[1]}))")
        else:
            parts.append(a)
    parts += [f"kwargs[{k!r}]" for k in keywords] + ["len(kwargs)"]
    unpack = f"    {', '.join(names)}{',' if len(names) == 1 else ''} = args\n" if names else ""
    return f"def key(device, args, kwargs):\n{unpack}    return ({', '.join(parts)})\n"


def _kind(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return "t"
    if type(value) is int:
        return "i"
    return "v"


class _Variant:
    """One specialization's compiled kernel, bound: its launcher, function handle, metadata, and
    the constexpr arguments a launch passes after the positional ones."""

    __slots__ = ("kernel", "run", "function", "metadata", "tail")

    def __init__(self, kernel: Any, tail: tuple):
        self.kernel = kernel
        self.run = kernel.run  # the launcher (its handles are loaded here, once)
        self.function = kernel.function
        self.metadata = kernel.packed_metadata
        self.tail = tail


class Launcher:
    """One kernel of a device wrapper (`JITFunction` `fn`), launched as `launcher[grid](*args,
    **kwargs)`: pre-bound after the first launch of each specialization (see the module's doc)."""

    def __init__(self, fn: Any):
        self.fn = fn
        self.variants: dict[tuple, _Variant | None] = {}  # None: this key always takes Triton's path
        self.key: Callable = _no_key  # the key function of the first launch's signature
        self.driver: Any = None  # the Triton driver the variants were bound on
        self.lock = threading.Lock()
        self.triton_launches = 0  # launches that took Triton's path (tests and benches read it)

    def __getitem__(self, grid: tuple) -> Callable:
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def run(self, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        """Triton's own entry point, for callers that speak it (the prebuild's specializations)."""
        return self.fn.run(*args, grid=grid, warmup=warmup, **kwargs)

    def launch(self, grid: tuple, args: tuple, kwargs: dict) -> None:
        active = driver.active
        device = active.get_current_device()
        try:
            variant = self.variants[self.key(device, args, kwargs)] if active is self.driver else None
        except (KeyError, AttributeError, TypeError, ValueError):  # a new variant, signature or kind
            variant = None
        if variant is None:
            return self.first_launch(active, device, grid, args, kwargs)
        stream = active.get_current_stream(device)
        enter, leave = _hooks()
        metadata = None
        if enter is not None:  # a profiler's hook: the metadata Triton's path gives it
            metadata = variant.kernel.launch_metadata(grid, stream, *args, *variant.tail)
        dims = len(grid)
        variant.run(
            grid[0],
            grid[1] if dims > 1 else 1,
            grid[2] if dims > 2 else 1,
            stream,
            variant.function,
            variant.metadata,
            metadata,
            enter,
            leave,
            *args,
            *variant.tail,
        )

    def first_launch(self, active: Any, device: int, grid: tuple, args: tuple, kwargs: dict) -> None:
        """Through Triton's launcher; the compiled kernel it launched becomes the variant's. A
        launcher keys the signature (argument count, kinds, keyword names) of its first launch; a
        launch of another (no wrapper has one) always takes Triton's path."""
        self.triton_launches += 1
        kernel = self.fn.run(*args, grid=grid, warmup=False, **kwargs)
        if kernel is None:  # a jit_cache_hook took the launch (another thread's prebuild): not bound
            return
        with self.lock:
            if active is not self.driver:
                self.variants.clear()
                self.driver = active
            if self.key is _no_key:
                self.key = _compile_key(tuple(_kind(a) for a in args), tuple(kwargs))
            try:
                key = self.key(device, args, kwargs)
            except (KeyError, AttributeError, TypeError, ValueError):  # another signature
                return
            self.variants[key] = self.bind(kernel, len(args), kwargs)

    def bind(self, kernel: Any, positional: int, kwargs: dict) -> _Variant | None:
        """The variant of a compiled kernel `JITFunction.run` just launched, or None where a launch
        must keep taking Triton's path (hooks that run per launch, a kernel of another kind)."""
        if self.fn.pre_run_hooks or triton.knobs.runtime.add_stages_inspection_hook is not None:
            return None
        if not all(hasattr(kernel, a) for a in ("run", "function", "packed_metadata", "launch_metadata")):
            return None
        names = [p.name for p in self.fn.params][positional:]
        if any(n not in kwargs for n in names):  # a default value: not worth a variant
            return None
        return _Variant(kernel, tuple(kwargs[n] for n in names))


_KEYS: dict[tuple, Callable] = {}  # key functions by (kinds, keywords): shared by every launcher


def _compile_key(kinds: tuple[str, ...], keywords: tuple[str, ...]) -> Callable:
    if (kinds, keywords) not in _KEYS:
        namespace: dict[str, Any] = {}
        exec(_key_source(kinds, keywords), namespace)
        _KEYS[kinds, keywords] = namespace["key"]
    return _KEYS[kinds, keywords]


def _no_key(device: int, args: tuple, kwargs: dict) -> tuple:
    raise KeyError("no launch yet")


_RUNTIME = triton.knobs.runtime
_CHAINS = hasattr(_RUNTIME.launch_enter_hook, "calls")  # Triton 3.7 and later: HookChains, never None


def _hooks() -> tuple[Any, Any]:
    """Triton's launch hooks (a profiler's), None where none is set: an empty HookChain is not
    called, and its launch needs no metadata."""
    enter, leave = _RUNTIME.launch_enter_hook, _RUNTIME.launch_exit_hook
    if _CHAINS:
        return (enter if enter.calls else None), (leave if leave.calls else None)
    return enter, leave
