"""Kernel binaries as values: one built specialization's entry of Triton's on-disk cache, packed as
text to share (the fleet's remote cache) and checked before it is installed into another machine's
Triton cache, where Triton's launcher then finds it.

Triton's cache names an entry by the sha256 of its key: the kernel's source and dependencies, its
specialization (signature, constants, divisibility), the target (`cuda`, arch, warp size), the
compile options, Triton's own version hash and the environment variables that change codegen. So a
value filed under that name is only ever found by a launch that would have built the same binary.

A value holds the entry's metadata (JSON) and its binary (a cubin on NVIDIA), base64, in a JSON
object with this format's name and the entry's name. It is installed only if it parses as that,
names the entry it is filed under, holds exactly the metadata and binary files under plain names,
and its metadata is a JSON object naming the same kernel. What a launch then loads is machine code:
whoever can write the values can run code on the machines that read them (gjit/runtime/remote_cache.py
says how to keep such a server private).
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import re
from typing import Any

import triton

from gjit import logs

log = logs.logger("cache")

FORMAT = "gjit-triton-binary-1"
_PLAIN_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,200}$")


def entry_name(kernel: Any, compile: dict[str, Any], data: str, target: tuple) -> tuple[str, str] | None:
    """(the name of Triton's cache entry, its metadata file's name) for this specialization of
    `kernel` (Triton's launcher's `compile` hook arguments and serialization) on `target` (backend,
    arch, warp size), as `triton.compile` computes them; None where this Triton's cache cannot be
    predicted (an inspection hook changes the key, or it always compiles)."""
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.cache import get_cache_key

    knobs = triton.knobs
    if knobs.compilation.always_compile or knobs.runtime.add_stages_inspection_hook is not None:
        return None
    spec = json.loads(data)
    backend = make_backend(GPUTarget(*target))
    src = ASTSource(kernel, compile["signature"], compile["constants"], compile["configs"][0])
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in spec["options"].items()}
    options = backend.parse_options(dict(options, **src.parse_options()))
    key = get_cache_key(src, backend, options, env_vars=get_cache_invalidating_env_vars())
    return hashlib.sha256(key.encode("utf-8")).hexdigest(), f"{src.name[:150]}.json"


def is_cached(name: str, metadata: str) -> bool:
    """Whether Triton's on-disk cache holds the entry `name` (with its metadata file)."""
    from triton.runtime.cache import get_cache_manager

    return metadata in (get_cache_manager(name).get_group(metadata) or {})


def pack(name: str, metadata: str) -> str | None:
    """The entry `name` of Triton's on-disk cache as a value (its metadata and binary), or None when
    the cache does not hold it."""
    from triton.runtime.cache import get_cache_manager

    group = get_cache_manager(name).get_group(metadata) or {}
    if metadata not in group:
        return None
    binary = _binary_file(group, metadata)
    files = {}
    for file in (metadata, binary):
        with open(group[file], "rb") as f:
            files[file] = base64.b64encode(f.read()).decode("ascii")
    return json.dumps({"format": FORMAT, "entry": name, "metadata": metadata, "files": files}, sort_keys=True)


def this_target() -> tuple:
    """(backend, arch, warp size) of the GPU Triton's active driver launches on; raises without one."""
    from triton.runtime.driver import driver

    target = driver.active.get_current_target()
    return (target.backend, target.arch, target.warp_size)


def _binary_name(stem: str, target: dict) -> str:
    """The binary's file name in an entry built for `target` (metadata's form): its extension is
    the target's (cubin, hsaco, ...)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    ext = make_backend(GPUTarget(target["backend"], target["arch"], target["warp_size"])).binary_ext
    return f"{stem}.{ext}"


def _binary_file(group: dict[str, str], metadata: str) -> str:
    """The binary's file in a group of Triton's cache, from its metadata's target."""
    with open(group[metadata], encoding="utf-8") as f:
        target = json.load(f)["target"]
    return _binary_name(metadata[: -len(".json")], target)


@dataclasses.dataclass
class Binary:
    """A checked value: its metadata file's name, its files, and the target it was built for."""

    metadata: str
    files: dict[str, bytes]
    target: tuple  # (backend, arch, warp size)


def unpack(text: str, name: str) -> Binary:
    """The files of a value filed under entry `name`: exactly Triton's metadata of that entry (its
    `hash` is the entry's name) and one binary of its target's kind, under plain names. Raises
    ValueError on anything else."""
    value = json.loads(text)
    if not isinstance(value, dict) or value.get("format") != FORMAT:
        raise ValueError(f"not a {FORMAT} value")
    if value.get("entry") != name:
        raise ValueError(f"a value of entry {value.get('entry')!r} filed under {name!r}")
    metadata, files = value.get("metadata"), value.get("files")
    if not isinstance(metadata, str) or not metadata.endswith(".json") or not _PLAIN_NAME.fullmatch(metadata):
        raise ValueError("no metadata file of a plain name")
    if not isinstance(files, dict) or metadata not in files or len(files) != 2:
        listed = sorted(files) if isinstance(files, dict) else files
        raise ValueError(f"files {listed}: the metadata and one binary expected")
    if not all(isinstance(v, str) for v in files.values()):
        raise ValueError("a file that is not base64 text")
    out = {f: base64.b64decode(v.encode("ascii"), validate=True) for f, v in files.items()}
    meta = json.loads(out[metadata].decode("utf-8"))
    stem = metadata[: -len(".json")]
    if not isinstance(meta, dict) or meta.get("hash") != name or str(meta.get("name"))[:150] != stem:
        raise ValueError("its metadata is not the entry's it is filed under")
    target = meta.get("target")
    if not isinstance(target, dict) or not {"backend", "arch", "warp_size"} <= set(target):
        raise ValueError("its metadata names no target")
    built_for = (target["backend"], target["arch"], target["warp_size"])
    try:
        expected = _binary_name(stem, target)
    except Exception as e:  # noqa: BLE001 - a target this Triton has no backend for
        raise ValueError(f"a target this Triton cannot build for: {built_for}") from e
    binary = next(f for f in out if f != metadata)
    if binary != expected:
        raise ValueError(f"its binary {binary!r} is not {expected}")
    return Binary(metadata, out, built_for)


def install(name: str, binary: Binary) -> None:
    """Write a checked value (`unpack`) as entry `name` of Triton's on-disk cache."""
    from triton.runtime.cache import get_cache_manager

    manager = get_cache_manager(name)
    paths = {file: manager.put(data, file, binary=True) for file, data in binary.files.items()}
    manager.put_group(binary.metadata, paths)


REMOTE_PREFIX = "triton-binary-"  # then the name of Triton's cache entry (a sha256)


def fetch(remote: Any, name: str, metadata: str, target: tuple) -> bool:
    """Install entry `name` (for `target`) from the fleet's remote cache (gjit/runtime/remote_cache.py)
    into Triton's on-disk cache: whether the server had it and it checked out."""
    found: list[Binary] = []

    def check(text: str) -> None:
        binary = unpack(text, name)
        if binary.target != tuple(target):
            raise ValueError(f"built for {binary.target}, not {tuple(target)}")
        found.append(binary)

    if remote.get(REMOTE_PREFIX + name, check, counter="remote_binary") is None:
        return False
    try:
        install(name, found[0])
    except OSError as e:  # an unwritable Triton cache: it is built, and cannot be stored either
        log.info("gjit: could not install the remote binary %s (%s)", name, e)
        return False
    return True


def publish(remote: Any, name: str, metadata: str) -> None:
    """Entry `name` of Triton's on-disk cache to the remote cache (queued for its background writer,
    set if absent)."""
    try:
        text = pack(name, metadata)
    except Exception as e:  # noqa: BLE001 - an unreadable or odd cache entry: not shared
        log.info("gjit: could not read the binary %s to share it (%s)", name, e)
        return
    if text is not None:
        remote.put(REMOTE_PREFIX + name, text)
