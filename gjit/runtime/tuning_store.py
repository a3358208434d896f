"""What tuning measured, kept so that no compile on this machine or another measures it again.

A record is one template kernel's measurements (gjit/tuning.py, gjit/choice/): its best tile
configuration so far, how many of its configurations were tried, and, where the region was weighed
against the library, the library's time. Its key is the kernel as tuning groups kernels (the code,
comments and names aside: `tuning.same_kernel_key`), its size arguments rounded up to powers of two
(a size bucket: a batch of 60 takes what a batch of 64 measured), the GPU's name, and the versions
of gjit, torch and Triton. A record left short by a tuning budget says how far it got; a later
compile with budget left goes on from there and stores the record again.

Tiers, as for compiled entries and only while the disk cache is on (`GJIT_CACHE`): this process's
memory, the disk (`<cache_dir>/tuning/`), the remote cache (GJIT_REMOTE_CACHE, as
`tuning-<key>`, written by the background writer: a first record with SET NX, one that goes
further than the record it started from in its place). A record that does not check out
(another format, a value that is not a record) is a miss: logged, and from the remote cache
counted as its faults are. A disk record that is short of complete, or has no library time, is
checked against the remote one, and the one that goes further is used. Two machines that go on
from one record at once both write it: the last write stays (each is a valid record).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import threading

from gjit import logs, stats
from gjit.codegen.toolchain.files import atomic_write
from gjit.config import config
from gjit.runtime import disk_cache, remote_cache

log = logs.logger("tuning")

FORMAT = 1


@dataclasses.dataclass(frozen=True)
class Tuned:
    """One template kernel's measurements at a size bucket on one kind of GPU."""

    config: int  # the fastest configuration tried
    template_ms: float  # its time
    tried: int  # configurations 0 .. tried-1 were tried (all of them: tried == configs)
    configs: int
    line: str  # the configurations' figures, as tuning logged them
    library_ms: float | None = None  # the library's time for what the region computes
    library: str = ""  # its pieces; "" with library_ms None: not weighed against the library

    @property
    def complete(self) -> bool:
        return self.tried >= self.configs

    @property
    def compared(self) -> bool:
        return self.library_ms is not None


def bucket(size: int) -> int:
    """A size rounded up to a power of two (0 and 1 as they are)."""
    return size if size <= 1 else 1 << (size - 1).bit_length()


def record_key(code: str, sizes: list[int], device: str) -> str:
    """The key of a kernel's record: its code (tuning.same_kernel_key's, without the sizes), its size
    arguments' buckets, the GPU's name, the versions of what runs it."""
    versions = disk_cache.versions()
    text = json.dumps([FORMAT, code, [bucket(s) for s in sizes], device, versions], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


_memory: dict[str, Tuned] = {}
_lock = threading.Lock()


def forget() -> None:
    """The records of this process's memory (gjit.reset()); the disk and remote tiers keep theirs."""
    with _lock:
        _memory.clear()


def record_path(key: str) -> str:
    return os.path.join(config.cache_dir, "tuning", key[:2], f"{key}.json")


def encoded(key: str, tuned: Tuned) -> str:
    return json.dumps({"format": FORMAT, "key": key, **dataclasses.asdict(tuned)}, sort_keys=True)


def decoded(text: str, key: str) -> Tuned:
    """The record in `text`, checked field by field (ValueError: not one of gjit's, or another key's)."""
    value = json.loads(text)
    if not isinstance(value, dict) or value.get("format") != FORMAT or value.get("key") != key:
        raise ValueError("not a tuning record of this format and key")
    fields = {f.name: value.get(f.name) for f in dataclasses.fields(Tuned)}
    ints = ("config", "tried", "configs")
    counts = all(type(fields[n]) is int and fields[n] >= 0 for n in ints)
    if not counts or not fields["config"] < fields["tried"] <= fields["configs"]:
        raise ValueError("a configuration count or index that is not one")
    numbers = [fields["template_ms"]] + ([] if fields["library_ms"] is None else [fields["library_ms"]])
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for v in numbers):
        raise ValueError("a time that is not one")
    if not isinstance(fields["line"], str) or not isinstance(fields["library"], str):
        raise ValueError("a text that is not one")
    return Tuned(**fields)


def lookup(key: str) -> Tuned | None:
    """The record of `key` from memory, the disk or the remote cache (kept in the nearer tiers),
    or None (the disk cache off, or no tier has one that checks out)."""
    if not config.cache:
        return None
    with _lock:
        found = _memory.get(key)
    if found is not None:
        return found
    path = record_path(key)
    try:
        with open(path, encoding="utf-8") as f:
            found = decoded(f.read(), key)
    except FileNotFoundError:
        found = None
    except Exception as e:  # noqa: BLE001 - unreadable, not JSON, not a record: measured again
        log.info("tuning record %s not used: %s", path, e)
        found = None
    if found is None or not (found.complete and found.compared):  # the fleet may have gone further
        remote = from_remote(key, path, found)
        found = remote if remote is not None else found
    if found is not None:
        with _lock:
            _memory[key] = found
    return found


def from_remote(key: str, path: str, local: Tuned | None) -> Tuned | None:
    """The remote cache's record of `key` where it goes further than `local` (kept on disk), else None."""
    remote = remote_cache.current()
    if remote is None:
        return None
    text = remote.get(f"tuning-{key}", lambda text: decoded(text, key), counter="remote_tuning")
    if text is None:
        return None
    found = decoded(text, key)
    if local is not None and (found.tried, found.compared) <= (local.tried, local.compared):
        return None
    try:
        atomic_write(path, text)
    except OSError as e:  # this machine's next process measures again; this one is served
        log.info("tuning record not written to %s: %s", path, e)
    return found


def store(key: str, tuned: Tuned, replace: bool = False) -> None:
    """Keep `tuned` in every tier (nothing with the disk cache off); `replace`: it goes further
    than the record found, which the remote cache holds."""
    if not config.cache:
        return
    with _lock:
        _memory[key] = tuned
    text = encoded(key, tuned)
    try:
        atomic_write(record_path(key), text)
    except OSError as e:
        log.info("tuning record not written: %s", e)
    remote = remote_cache.current()
    if remote is not None:
        remote.put(f"tuning-{key}", text, replace=replace)
    stats.count("tuning_records_stored")
