"""On a GPU: a graph's kernels built in parallel worker processes before their first launch.

Triton's launcher builds a kernel at its first launch, so a graph's first call builds its kernels
one after another. At that first call, before the wrapper runs:

1. the wrapper runs once on fake tensors (`FakeTensorMode`: shapes, strides and storage offsets,
   no memory, no kernel runs), each kernel launch recorded with its arguments: sizes as numbers,
   tensors as stand-ins with the dtype and the address alignment the real call will have (a graph
   input's own address, a buffer's allocation plus its storage offset);
2. Triton's own launcher says how each launch specializes (the binder and options of a real launch:
   16-byte aligned pointers, sizes divisible by 16 or equal to 1): `run(warmup=True)` with a
   `jit_cache_hook` that takes the serialized specialization instead of compiling;
3. a specialization already in Triton's on-disk cache is left to it; one the fleet's remote cache
   (GJIT_REMOTE_CACHE) holds is checked and installed there (gjit/runtime/triton_binaries.py); the
   others are built by `gjit.config.compile_workers` forked processes (`JITFunction.preload` of the
   serialization, for the GPU's target), which write Triton's on-disk cache, as TorchInductor's
   compile workers do, and each binary they build is shared to the remote cache;
4. the wrapper's name for each kernel being built is bound to `Awaiting`: a launch waits for its
   own kernel's build only, then Triton's launcher finds the binary in its cache.

Nothing here decides a result. A launch whose build failed, was mispredicted (another
specialization) or never started (the fake run stopped at an op fake tensors cannot run, such as
`.item()`) is built by Triton's launcher at the launch, as without this module.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import logging
import threading
import time
import types
from collections.abc import Callable
from typing import Any

import torch
import triton
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef

from gjit import logs, stats
from gjit.codegen.toolchain.compile_only import build_pool, finish_warm_up, quiet_forks
from gjit.codegen.toolchain.files import import_file
from gjit.config import config
from gjit.runtime import remote_cache, triton_binaries

log = logs.logger("cache")


class TargetDriver:
    """Triton's driver as far as building needs one: a device, a stream and the target. Set active
    in build workers, which are forked from a process that uses CUDA and so must not."""

    def __init__(self, target: Any):
        self.target = target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> Any:
        return self.target


@dataclasses.dataclass(frozen=True)
class Pointer:
    """A tensor argument as Triton's launcher specializes it: its dtype and address."""

    dtype: torch.dtype
    address: int

    def data_ptr(self) -> int:
        return self.address


@dataclasses.dataclass
class Launch:
    name: str
    grid: Any
    args: list[Any]
    kwargs: dict[str, Any]


@dataclasses.dataclass
class Build:
    """One specialization of one kernel: what a worker builds."""

    name: str  # the kernel's name in the wrapper (the first launch of this specialization)
    kernel: Any  # its JITFunction
    data: str  # Triton's serialized specialization
    entry: tuple[str, str] | None  # its entry in Triton's on-disk cache: (name, metadata file)
    cached: bool  # already there


@dataclasses.dataclass
class Prebuild:
    """What the first call's prebuild found and started (logged; tests read it)."""

    launches: list[Launch]
    builds: list[Build]
    stopped: str  # why the fake run stopped early ('' when it ran to the end)
    futures: dict[int, list[concurrent.futures.Future]]  # id(kernel) -> its builds
    fetched: list[Build] = dataclasses.field(default_factory=list)  # installed from the remote cache

    def wait(self) -> None:
        for futures in self.futures.values():
            _wait(futures, "")


class _Stop(Exception):
    pass


def record_launches(
    call: Callable, kernels: list[str], others: list[str], branches: list[str], inputs: list, sizes: tuple
):
    """Run the wrapper function `call` on fake copies of `inputs`, recording the launches of the
    `kernels` (the `others`, CUDA C ones, launch nothing): ([Launch], why it stopped early or '')."""
    launches: list[Launch] = []
    mode = FakeTensorMode()
    bases: dict[StorageWeakRef, int] = {}

    def fake(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        f = mode.from_tensor(x)
        bases[StorageWeakRef(f.untyped_storage())] = x.untyped_storage().data_ptr()
        return f

    def stand_in(a: Any) -> Any:
        if not isinstance(a, torch.Tensor):
            return a
        base = bases.get(StorageWeakRef(a.untyped_storage()), 0)  # a buffer: the allocator aligns it
        return Pointer(a.dtype, base + a.storage_offset() * a.element_size())

    class Recorder:
        def __init__(self, name: str):
            self.name = name

        def __getitem__(self, grid: Any) -> Callable:
            def launch(*args: Any, **kwargs: Any) -> None:
                if self.name:
                    launches.append(Launch(self.name, grid, [stand_in(a) for a in args], kwargs))

            return launch

    def stop(*args: Any) -> None:
        raise _Stop("a torch.cond branch (its predicate is data)")

    def alloc(size: tuple, stride: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty_strided(size, stride, dtype=dtype, device=device)

    overrides: dict[str, Any] = {name: Recorder(name) for name in kernels}
    overrides |= {name: Recorder("") for name in others}
    overrides |= {name: stop for name in branches}
    overrides |= {"gjit_alloc": alloc, "gjit_alloc_poisoned": alloc, "gjit_check": lambda *a: None}
    dry_run = types.FunctionType(call.__code__, {**call.__globals__, **overrides}, "dry_run")
    try:
        fakes = [fake(x) for x in inputs]
        with mode:
            dry_run(fakes, sizes)
    except Exception as e:  # an op fake tensors cannot run: the launches after it build at launch
        return launches, f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    return launches, ""


def specializations(launches: list[Launch], namespace: dict[str, Any]) -> list[Build]:
    """Each distinct specialization of the launches' kernels, as Triton's launcher computes it on
    this device, skipping those it has already compiled in this process."""
    builds: dict[tuple[int, str], Build] = {}
    me = threading.get_ident()
    previous = triton.knobs.runtime.jit_cache_hook
    current: list[str] = []

    def hook(*args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() != me:  # another thread's launch: as if this hook were not set
            return previous(*args, **kwargs) if previous is not None else None
        kernel, compile = kwargs["fn"].jit_function, kwargs["compile"]
        key = (id(kernel), str(kwargs["key"]))
        if key not in builds:
            data = compile["specialization_data"]
            entry = triton_binaries.entry_name(kernel, compile, data)
            cached = entry is not None and triton_binaries.is_cached(*entry)
            builds[key] = Build(current[-1], kernel, data, entry, cached)
        return True  # do not compile here

    triton.knobs.runtime.jit_cache_hook = hook
    try:
        for launch in launches:
            current.append(launch.name)
            kernel = namespace[launch.name]
            kernel = kernel.kernel if isinstance(kernel, Awaiting) else kernel
            kernel.run(*launch.args, grid=launch.grid, warmup=True, **launch.kwargs)
    finally:
        triton.knobs.runtime.jit_cache_hook = previous
    return list(builds.values())


def build_one(path: str, name: str, data: str) -> float:
    """In a worker: build one serialized specialization of the kernel defined as `name` in `path`
    into Triton's on-disk cache; returns the seconds it took."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    start = time.perf_counter()
    triton.knobs.runtime.jit_cache_hook = None  # the parent's, inherited by the fork
    driver.set_active(TargetDriver(GPUTarget(**json.loads(data)["target"])))
    kernel = getattr(import_file(path), name)  # the parent's module name: part of the serialization
    kernel.preload(data)
    return time.perf_counter() - start


class Awaiting:
    """A wrapper's kernel whose builds run in workers: its first launch waits for them (only),
    then the wrapper's name is bound to the kernel itself."""

    def __init__(self, kernel: Any, futures: list, namespace: dict[str, Any], name: str):
        self.kernel, self.futures, self.namespace, self.name = kernel, futures, namespace, name

    def __getitem__(self, grid: Any) -> Callable:
        _wait(self.futures, self.name)
        if self.namespace.get(self.name) is self:
            self.namespace[self.name] = self.kernel
        return self.kernel[grid]


_warned = False  # a failure is a warning once per process, then info


def note_failure(what: str, e: Exception) -> None:
    """`what` failed with `e`: the kernels concerned build at their launch, as without a prebuild."""
    global _warned
    level = logging.INFO if _warned else logging.WARNING
    _warned = True
    log.log(level, "gjit: %s failed (%s: %s); Triton builds at launch", what, type(e).__name__, e)


def _wait(futures: list, name: str) -> None:
    for future in futures:
        try:
            future.result()
        except Exception as e:  # the launch builds it and raises the real error if it fails there too
            note_failure(f"building {name} in a worker", e)


def start(
    call: Callable,
    paths: dict[str, str],
    others: list[str],
    branches: list[str],
    inputs: list[Any],
    sizes: tuple,
    workers: int | None = None,
) -> Prebuild | None:
    """Prebuild the kernels of the device wrapper `call` for its first call (`inputs`, `sizes`).
    `paths`: each Triton kernel's name in the wrapper -> its source file; `others`: the CUDA C
    kernels' names; `branches`: the torch.cond branch runners'. None when there is nothing to build
    in parallel."""
    workers = config.compile_workers if workers is None else workers
    missing = _missing_from_triton()
    if missing:
        if missing not in _NOTED:
            _NOTED.add(missing)
            log.info("gjit: kernels build at their launch: this Triton has no %s", missing)
        return None
    remote = remote_cache.current()
    parallel = workers >= 2 and len(set(paths.values())) >= 2
    if not parallel and remote is None:
        return None
    namespace = call.__globals__
    launches, stopped = record_launches(call, list(paths), others, branches, inputs, sizes)
    if stopped:
        log.info(
            "gjit: prebuilding kernels: the fake run stopped at %s; later kernels build at launch", stopped
        )
    builds = specializations(launches, namespace)
    todo = [b for b in builds if not b.cached]
    fetched = [b for b in todo if remote is not None and fetch(remote, b)]
    todo = [b for b in todo if b not in fetched]
    futures: dict[int, list[concurrent.futures.Future]] = {}
    # in parallel; or one build, in a worker still when a remote cache is there to share its binary
    wanted = todo and ((parallel and len(todo) >= 2) or remote is not None)
    pool = build_pool(max(1, min(workers, len(todo))), spawn=False) if wanted else None
    if pool is not None:
        finish_warm_up()  # Triton's one-time hashing, once, inherited by every worker
        with quiet_forks():  # the workers fork at the first submit
            for b in sorted(todo, key=lambda b: -len(b.kernel.src)):  # the longest first
                future = pool.submit(build_one, paths[b.name], b.kernel.fn.__name__, b.data)
                if remote is not None:
                    future.add_done_callback(functools.partial(publish, remote, b))
                futures.setdefault(id(b.kernel), []).append(future)
        pool.shutdown(wait=False)  # the queued builds still run; the workers exit after them
    for name in paths:
        kernel = namespace[name]
        if id(kernel) in futures:  # (an Awaiting already there has its builds: its id is not a key)
            namespace[name] = Awaiting(kernel, futures[id(kernel)], namespace, name)
    stats.COUNTERS["kernels_prebuilt"] += sum(map(len, futures.values()))
    log.info(
        "gjit: %d kernel launch(es), %d specialization(s): %d in Triton's cache, %d from the remote cache, "
        "%d building in %d worker(s)",
        len(launches),
        len(builds),
        sum(b.cached for b in builds),
        len(fetched),
        sum(map(len, futures.values())),
        workers,
    )
    return Prebuild(launches, builds, stopped, futures, fetched)


_NOTED: set[str] = set()


@functools.cache
def _missing_from_triton() -> str:
    """What this Triton lacks of the API the prebuild uses ('' when nothing)."""
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    if not hasattr(getattr(getattr(triton, "knobs", None), "runtime", None), "jit_cache_hook"):
        return "triton.knobs.runtime.jit_cache_hook"
    if not hasattr(JITFunction, "preload"):
        return "JITFunction.preload"
    if not hasattr(driver, "set_active"):
        return "triton.runtime.driver.set_active"
    return ""


REMOTE_PREFIX = "triton-binary-"  # then the name of Triton's cache entry (a sha256)


def fetch(remote: remote_cache.RemoteCache, build: Build) -> bool:
    """Install `build`'s binary from the fleet's remote cache into Triton's on-disk cache: whether
    it was there and checked out (gjit/runtime/triton_binaries.py)."""
    if build.entry is None:
        return False
    name = build.entry[0]
    files: dict[str, bytes] = {}

    def check(text: str) -> None:
        files.update(triton_binaries.unpack(text, name))

    if remote.get(REMOTE_PREFIX + name, check, counter="remote_binary") is None:
        return False
    try:
        triton_binaries.install(name, files)
    except OSError as e:  # an unwritable Triton cache: the workers build it, and cannot store it either
        log.info("gjit: could not install the remote binary of %s (%s)", build.name, e)
        return False
    return True


def publish(remote: remote_cache.RemoteCache, build: Build, future: concurrent.futures.Future) -> None:
    """After a worker built `build`: its binary to the remote cache (queued for the background
    writer; set if absent)."""
    if build.entry is None or future.cancelled() or future.exception() is not None:
        return
    try:
        text = triton_binaries.pack(*build.entry)
    except OSError as e:
        log.info("gjit: could not read the binary of %s to share it (%s)", build.name, e)
        return
    if text is not None:
        remote.put(REMOTE_PREFIX + build.entry[0], text)
