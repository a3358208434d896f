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

import atexit
import concurrent.futures
import concurrent.futures.process
import dataclasses
import functools
import json
import logging
import os
import threading
import time
import types
from collections.abc import Callable
from typing import Any

import torch
import triton
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef

from gjit import logs, progress, stats
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
    target: tuple  # the GPU's (backend, arch, warp size)
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
        names = {id(b.kernel): b.name for b in self.builds}
        for kernel, futures in self.futures.items():
            _wait(futures, names.get(kernel, "a kernel"))


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
    # gjit_reinterpret makes a plain tensor on a fake tensor's storage, which the ops after it
    # refuse ("convert all Tensors to FakeTensors"); the checked as_strided is the same view, fake
    checked = call.__globals__.get("gjit_as_strided")
    if checked is not None:
        overrides["gjit_reinterpret"] = checked
    dry_run = types.FunctionType(call.__code__, {**call.__globals__, **overrides}, "dry_run")
    try:
        fakes = [fake(x) for x in inputs]
        with mode:
            dry_run(fakes, sizes)
    except Exception as e:  # an op fake tensors cannot run: the launches after it build at launch
        return launches, logs.error_line(e)
    return launches, ""


_HOOK_LOCK = threading.Lock()  # one prebuild at a time installs Triton's jit_cache_hook


def specializations(launches: list[Launch], kernels: dict[str, Any]) -> list[Build]:
    """Each distinct specialization of the launches' kernels (`kernels`: name -> JITFunction), as
    Triton's launcher computes it on this device, skipping those it has already compiled in this
    process. A launch Triton's launcher cannot specialize here is left to build at its launch."""
    builds: dict[tuple[int, str], Build] = {}
    me = threading.get_ident()
    target = triton_binaries.this_target()
    current: list[str] = []
    closed = False  # once this prebuild is done: another thread may have put the hook back

    def hook(*args: Any, **kwargs: Any) -> Any:
        if closed or threading.get_ident() != me:  # another launch: as if this hook were not set
            return previous(*args, **kwargs) if previous is not None else None
        kernel, compile = kwargs["fn"].jit_function, kwargs["compile"]
        key = (id(kernel), str(kwargs["key"]))
        if key not in builds:
            data = compile["specialization_data"]
            try:
                entry = (
                    None if _entry_names_wrong else triton_binaries.entry_name(kernel, compile, data, target)
                )
            except Exception as e:  # another Triton's cache key: unknown, so built (time only)
                log.debug("gjit: Triton's cache entry of %s unknown (%s)", current[-1], e)
                entry = None
            cached = entry is not None and triton_binaries.is_cached(*entry)
            builds[key] = Build(current[-1], kernel, data, target, entry, cached)
        return True  # do not compile here

    with _HOOK_LOCK:  # no other prebuild saves this hook as its `previous`, or restores under it
        previous = triton.knobs.runtime.jit_cache_hook
        triton.knobs.runtime.jit_cache_hook = hook
        try:
            for launch in launches:
                current.append(launch.name)
                try:
                    kernels[launch.name].run(*launch.args, grid=launch.grid, warmup=True, **launch.kwargs)
                except Exception as e:  # this launch builds at launch; the others still prebuild
                    log.info("gjit: prebuilding %s: %s: %s", launch.name, type(e).__name__, e)
        finally:
            closed = True
            if triton.knobs.runtime.jit_cache_hook is hook:
                triton.knobs.runtime.jit_cache_hook = previous
    return list(builds.values())


def build_one(path: str, name: str, data: str, target: tuple) -> float:
    """In a worker: build one serialized specialization of the kernel defined as `name` in `path`
    for `target` (backend, arch, warp size) into Triton's on-disk cache; returns the seconds it took."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    start = time.perf_counter()
    triton.knobs.runtime.jit_cache_hook = None  # the parent's, inherited by the fork
    triton.knobs.runtime.interpret = False  # set by an interpreted load in another thread at the fork
    gpu = GPUTarget(*target)
    driver.set_active(TargetDriver(gpu))
    spec = json.loads(data)
    spec.setdefault("target", dict(gpu.__dict__))  # Triton 3.4-3.6 serialize no target
    kernel = getattr(import_file(path), name)  # the parent's module name: part of the serialization
    kernel.preload(json.dumps(spec))
    return time.perf_counter() - start


class Awaiting:
    """A wrapper's kernel whose builds run in workers: its first launch waits for them (the builds
    of this kernel's specializations, no other kernel's), then the wrapper's name is bound to the
    kernel itself (or its pre-bound launcher)."""

    def __init__(self, kernel: Any, futures: list, namespace: dict[str, Any], name: str):
        self.kernel, self.futures, self.namespace, self.name = kernel, futures, namespace, name

    def __repr__(self) -> str:  # the kernel it stands for (an extern call's key: gjit/choice/library.py)
        return repr(self.kernel)

    def __getitem__(self, grid: Any) -> Callable:
        _wait(self.futures, self.name)
        if self.namespace.get(self.name) is self:
            self.namespace[self.name] = self.kernel
        return self.kernel[grid]


WAIT_SECONDS = 300.0  # a launch waits this long for its build (queue included), then builds it itself
MAX_WORKERS = 32  # as Inductor's compile workers: more cost memory and forks for little
_warned = False  # a failure is a warning once per process, then info
_off = ""  # why prebuilds are off for the rest of the process ('' while they are on)
_pending: set[concurrent.futures.Future] = set()  # builds not done: cancelled when the process exits
# the builds in workers not done yet, by their entry in Triton's cache: a prebuild that finds its
# specialization there (an early build, gjit/runtime/early_builds.py) waits for it, not builds it again
_building: dict[tuple[str, str], concurrent.futures.Future] = {}
_no_workers = ""  # why no build worker can start in this process ('' while they can)
_entry_names_wrong = False  # a worker's build was not where entry_name said: names are not used
_NOTED: set[str] = set()  # why prebuilds are not done, each said once


def _after_fork_in_child() -> None:
    """A fork (the user's, or a build worker) starts with no prebuild in flight: a lock another
    thread held at the fork would be held forever."""
    global _HOOK_LOCK
    _HOOK_LOCK = threading.Lock()
    _pending.clear()
    _building.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def note_failure(what: str, e: BaseException) -> None:
    """`what` failed with `e`: the kernels concerned build at their launch, as without a prebuild."""
    global _warned
    level = logging.INFO if _warned else logging.WARNING
    _warned = True
    log.log(level, "gjit: %s failed (%s: %s); Triton builds at launch", what, type(e).__name__, e)


def _turn_off(why: str) -> None:
    """No more prebuilds in this process (a worker died or hung, no worker could start)."""
    global _off
    if not _off:
        _off = why
        log.info("gjit: no more kernel prebuilds in this process: %s", why)


def _wait(futures: list, name: str) -> None:
    deadline = time.monotonic() + WAIT_SECONDS  # for all of the kernel's builds together
    for future in futures:
        try:
            future.result(timeout=max(0.0, deadline - time.monotonic()))
        except concurrent.futures.TimeoutError as e:
            _turn_off(f"building {name} took over {WAIT_SECONDS:.0f} s")
            note_failure(f"waiting for {name}'s build", e)
        except concurrent.futures.process.BrokenProcessPool as e:
            _turn_off("a build worker died")
            note_failure(f"building {name} in a worker", e)
        except (Exception, concurrent.futures.CancelledError) as e:  # the launch builds it (and raises)
            note_failure(f"building {name} in a worker", e)


def _cancel_pending() -> None:
    """At exit: builds not started are dropped (a running one finishes), so exit does not wait
    for a whole model's queue."""
    for future in list(_pending):
        future.cancel()


# before concurrent.futures' own exit handler joins the pools (threading runs these last first)
getattr(threading, "_register_atexit", atexit.register)(_cancel_pending)


def unavailable() -> str:
    """Why no kernel is built before its launch in this process ('' when they are)."""
    return _off or _missing_from_triton()


def is_building(entry: tuple[str, str]) -> bool:
    """Whether a worker is building the specialization of Triton's cache entry `entry`."""
    return entry in _building


def start(
    call: Callable,
    kernels: dict[str, Any],
    paths: dict[str, str],
    others: list[str],
    branches: list[str],
    inputs: list[Any],
    sizes: tuple,
    workers: int | None = None,
) -> Prebuild | None:
    """Prebuild the kernels of the device wrapper `call` for its first call (`inputs`, `sizes`).
    `kernels`: each Triton kernel's name in the wrapper -> its JITFunction, `paths` -> its source
    file; `others`: the CUDA C kernels' names; `branches`: the torch.cond branch runners'. None
    when there is nothing to build in parallel, to share or to wait for."""
    workers = min(config.compile_workers if workers is None else workers, MAX_WORKERS)
    missing = unavailable()
    if missing:
        if missing not in _NOTED:
            _NOTED.add(missing)
            log.info("gjit: kernels build at their launch: %s", missing)
        return None
    remote = remote_cache.current()
    parallel = workers >= 2 and len(set(paths.values())) >= 2 and not _no_workers
    # the builds in workers now (early builds of this compile), taken before Triton's cache is looked
    # at: one that ends in between (the pool's thread then drops it from `_building`) is waited
    # for, done, instead of built again; also by a graph of one kernel, which builds nothing here
    building = _building.copy()
    if not parallel and remote is None and not building:
        return None
    launches, stopped = record_launches(call, list(paths), others, branches, inputs, sizes)
    if stopped:
        log.info(
            "gjit: prebuilding kernels: the fake run stopped at %s; later kernels build at launch", stopped
        )
    builds = specializations(launches, kernels)
    todo = [b for b in builds if not b.cached]
    fetched = [
        b
        for b in todo
        if remote is not None and b.entry and triton_binaries.fetch(remote, *b.entry, b.target)
    ]
    # a build a worker is already making (an early build of this compile): waited for, not repeated
    joined = [(b, building[b.entry]) for b in todo if b.entry in building and b not in fetched]
    waited = {id(b) for b, _ in joined}
    todo = [b for b in todo if b not in fetched and id(b) not in waited]
    # in parallel; or one build, in a worker still when a remote cache is there to share its binary
    wanted = todo and ((parallel and len(todo) >= 2) or remote is not None)
    futures = _submit(todo, paths, max(1, min(workers, len(todo))), remote) if wanted else {}
    stats.count("kernels_prebuilt", sum(map(len, futures.values())))
    for b, future in joined:
        futures.setdefault(id(b.kernel), []).append(future)
    namespace = call.__globals__
    for name in paths:
        kernel, launched = kernels[name], namespace.get(name)
        # the kernel or its pre-bound launcher (gjit/runtime/launch.py), not while tuning wraps it
        if id(kernel) in futures and (launched is kernel or getattr(launched, "fn", None) is kernel):
            namespace[name] = Awaiting(launched, futures[id(kernel)], namespace, name)
    log.info(
        "gjit: %d kernel launch(es), %d specialization(s): %d in Triton's cache, %d from the remote cache, "
        "%d already building, %d building in %d worker(s)",
        len(launches),
        len(builds),
        sum(b.cached for b in builds),
        len(fetched),
        len(joined),
        sum(map(len, futures.values())) - len(joined),
        workers,
    )
    return Prebuild(launches, builds, stopped, futures, fetched)


def _submit(
    todo: list[Build], paths: dict[str, str], workers: int, remote: remote_cache.RemoteCache | None
) -> dict[int, list[concurrent.futures.Future]]:
    """`todo` handed to `workers` forked processes, the longest source first (so no worker is left
    with a big template at the end while the others idle: tiny Llama's first launches were ready
    in 1.52 s this way, 1.67 s in launch order, on 2 workers): id(kernel) -> its builds' futures.
    Nothing when no worker can start."""
    futures: dict[int, list[concurrent.futures.Future]] = {}
    pool = open_pool(workers)
    if pool is None:
        return {}
    for b in sorted(todo, key=lambda b: -len(b.kernel.src)):
        future = submit(pool, b, paths[b.name], remote)
        if future is None:
            break
        futures.setdefault(id(b.kernel), []).append(future)
    pool.shutdown(wait=False)  # the queued builds still run; the workers exit after them
    return futures


def open_pool(workers: int) -> concurrent.futures.ProcessPoolExecutor | None:
    """`workers` build processes (forked at the first `submit`), or None where none can start
    (said once; the remote cache's binaries still serve). The caller shuts it down, without
    waiting, once everything is submitted."""
    global _no_workers
    if _no_workers or _off:
        return None
    try:
        pool = build_pool(workers, spawn=False)
    except Exception as e:  # noqa: BLE001 - no process can start: the launches build
        _turn_off(f"no build worker could start ({type(e).__name__}: {e})")
        note_failure("starting build workers", e)
        return None
    if pool is None:
        _no_workers = "no fork here, or a daemonic process"
        log.info("gjit: kernels build at their launch: build workers cannot start (%s)", _no_workers)
        return None
    finish_warm_up()  # Triton's one-time hashing, once, inherited by every worker
    return pool


def submit(
    pool: concurrent.futures.ProcessPoolExecutor,
    b: Build,
    path: str,
    remote: remote_cache.RemoteCache | None,
) -> concurrent.futures.Future | None:
    """The build `b` (of the kernel in `path`) handed to `pool`: its future, counted by the progress
    line, cancelled at exit if not started, shared with the remote cache when done; None when the
    pool could not start (prebuilds are then off in this process)."""
    try:
        with quiet_forks():  # the workers fork at the first submit
            future = pool.submit(build_one, path, b.kernel.fn.__name__, b.data, b.target)
    except Exception as e:  # noqa: BLE001 - a fork that failed: what was submitted still runs
        _turn_off(f"starting build workers failed ({type(e).__name__}: {e})")
        note_failure("starting build workers", e)
        return None
    future.add_done_callback(functools.partial(_progress_built, progress.building(1)))
    _pending.add(future)
    future.add_done_callback(_pending.discard)
    if b.entry is not None:
        _building[b.entry] = future
        future.add_done_callback(functools.partial(_built, remote, b.entry))
    return future


def _progress_built(session: int, future: concurrent.futures.Future) -> None:
    progress.built(session)  # (in the pool's thread) the progress line counts it at its next tick


def _built(
    remote: remote_cache.RemoteCache | None, entry: tuple[str, str], future: concurrent.futures.Future
) -> None:
    """After a worker's build (in the pool's thread): the binary must be where entry_name said
    (else names are not used from then on, said once); with a remote cache, it is shared."""
    global _entry_names_wrong
    if _building.get(entry) is future:
        del _building[entry]
    if future.cancelled() or future.exception() is not None:
        return
    try:
        there = triton_binaries.is_cached(*entry)
    except Exception:  # noqa: BLE001
        there = False
    if not there:
        if not _entry_names_wrong:
            _entry_names_wrong = True
            log.info("gjit: a built kernel is not at the Triton cache entry predicted for it: not predicting")
        return
    if remote is not None:
        triton_binaries.publish(remote, *entry)


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
