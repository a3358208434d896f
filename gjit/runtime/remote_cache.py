"""The fleet tier of the compile cache: a Redis server that many machines share.

    GJIT_REMOTE_CACHE=redis://[user:password@]host:port/db     (rediss:// for TLS)

Lookup order: memory (the callable's entries), local disk (gjit/runtime/disk_cache.py), this
remote, compile. A remote hit is written to the local disk, so the next process on the machine
needs no network. A fresh compile's entry is written to the remote by a background thread
(a bounded queue, flushed at exit) with SET NX: the first writer of a key wins, a second process
that compiled the same graph at the same time only finds the key taken.

What is stored is exactly the disk entry (its first line the sha256 of the rest; the kernel and
wrapper sources are in it), compressed, behind a header of this format's magic and the sha256 of
the compressed bytes. Keys are the disk keys (every version and knob that changes generated
code) under a prefix. A value is accepted only if the header, the digest, the size limit, the
entry's own checksum and its key and format all check out; then it is parsed as gjit's entry
format, as a disk entry is. Nothing from the server is executed or unpickled before that, and
the generated sources it carries are rewritten to content-addressed files whose names are their
hashes.

Trust: whoever can write to the server can make every machine that reads it run their kernels
(a value with a valid checksum is indistinguishable from one gjit wrote). Use a server only your
deployment can write to: a password (or ACL user) and TLS (rediss://), and a key prefix per
deployment (GJIT_REMOTE_CACHE_PREFIX).

Faults never fail a call and never give a wrong kernel: a server that is down (at start or
mid-run), slow (short timeouts, GJIT_REMOTE_CACHE_TIMEOUT), full or read-only, a wrong password,
a value cut short, damaged or written by another format: each is logged once under `cache`,
counted in `gjit.stats()["remote_cache_errors"]`, and the call compiles locally. After a
connection failure the server is left alone for a while (`RETRY_SECONDS`), so a dead server
costs one timeout, not one per compile.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import queue
import re
import threading
import time
import zlib
from collections.abc import Callable
from typing import Any

from gjit import logs, stats
from gjit.config import config

cache_log = logs.logger("cache")

MAGIC = b"gjit-remote-entry-1\n"
RETRY_SECONDS = 30.0  # after a connection failure, how long lookups skip the server
QUEUE_SIZE = 64  # entries waiting to be written; more are dropped (counted), never block a call


class RemoteCacheError(Exception):
    """A package could not be written to or read from the server (the message says why)."""


class _Fault(Exception):
    """A value from the server that is not a gjit entry."""


class RemoteCache:
    """One server (one URL and prefix): get and background put of disk entries' text."""

    def __init__(self, url: str, prefix: str, timeout: float, max_bytes: int):
        import redis  # only with a remote cache configured (pip install redis)

        self.url, self.prefix, self.max_bytes = url, prefix, max_bytes
        self.client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        self.redis = redis
        self.down_until = 0.0
        self.logged: set[str] = set()
        self.pending: queue.Queue = queue.Queue(QUEUE_SIZE)
        self.writer: threading.Thread | None = None
        self.lock = threading.Lock()
        # keys whose value here failed verification: the next write replaces it (not SET NX), or
        # one damaged write would turn the tier off for that graph across the fleet
        self.damaged: set[str] = set()
        self.bulk_client: Any = None  # packages' client (bulk())

    # -- faults ------------------------------------------------------------------------------------

    def fault(self, kind: str, message: str, down: bool = False) -> None:
        """Count a fault; log its kind once per process; after a connection failure, skip the
        server for RETRY_SECONDS."""
        stats.count("remote_cache_errors")
        message = _masked(message, self.url)
        if down:
            self.down_until = time.monotonic() + RETRY_SECONDS
        if kind not in self.logged:
            self.logged.add(kind)
            cache_log.warning("gjit: remote cache %s: %s; compiling locally", _safe_url(self.url), message)

    def classify(self, e: Exception) -> tuple[str, bool]:
        """(the kind of a client error, whether the server counts as down)."""
        errors = self.redis.exceptions
        if isinstance(e, errors.AuthenticationError) or "NOAUTH" in str(e) or "WRONGPASS" in str(e):
            return "authentication failed", True
        if isinstance(e, errors.TimeoutError):
            return "timed out", True
        if isinstance(e, errors.ConnectionError):
            return "unreachable", True
        if isinstance(e, errors.ReadOnlyError) or "READONLY" in str(e):
            return "read-only", False
        if isinstance(e, getattr(errors, "OutOfMemoryError", ())) or "maxmemory" in str(e) or "OOM" in str(e):
            return "full (maxmemory)", False
        return f"error ({type(e).__name__})", False

    # -- reads -------------------------------------------------------------------------------------

    def get(self, key: str, check: Callable[[str], object], counter: str = "remote_cache") -> str | None:
        """The entry text stored under `key`, unpacked and accepted by `check` (which raises on an
        entry that is not gjit's); None on a miss or any fault. Hits and misses are counted as
        `counter`_hits and _misses (kernel binaries: remote_binary)."""
        if time.monotonic() < self.down_until:  # left alone after a connection failure
            stats.count(f"{counter}_misses")
            return None
        try:
            value = self.client.get(self.prefix + key)
        except Exception as e:  # noqa: BLE001 - any client failure is a miss, never a crash
            kind, down = self.classify(e)
            self.fault(kind, f"{kind} ({e})", down)
            return None
        if value is None:
            stats.count(f"{counter}_misses")
            cache_log.info("remote miss: %s", key)
            return None
        try:
            text = self.unpack(value)
            check(text)
        except Exception as e:  # noqa: BLE001 - a value that is not a gjit entry is a miss
            self.damaged.add(key)
            self.fault("damaged value", f"the value of {self.prefix + key} is not a gjit entry: {e}")
            return None
        stats.count(f"{counter}_hits")
        cache_log.info("remote hit: %s", key)
        return text

    def unpack(self, value: bytes) -> str:
        raw = self.unpack_bytes(value)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise _Fault("not UTF-8 text") from e

    def unpack_bytes(self, value: bytes) -> bytes:
        if len(value) > self.max_bytes + len(MAGIC) + 65:
            raise _Fault(f"{len(value)} bytes, over the limit of {self.max_bytes}")
        if not value.startswith(MAGIC):
            raise _Fault("no gjit header (another format or another program's key)")
        digest, _, packed = value[len(MAGIC) :].partition(b"\n")
        if hashlib.sha256(packed).hexdigest().encode() != digest:
            raise _Fault("checksum mismatch (cut short or modified)")
        inflate = zlib.decompressobj()
        try:
            raw = inflate.decompress(packed, self.max_bytes + 1)
        except zlib.error as e:
            raise _Fault(f"does not decompress ({e})") from e
        if len(raw) > self.max_bytes or not inflate.eof:
            raise _Fault(f"more than {self.max_bytes} bytes uncompressed")
        return raw

    # -- writes ------------------------------------------------------------------------------------

    def put(self, key: str, text: str, replace: bool = False) -> None:
        """Queue `text` for the background writer; never blocks the call. `replace`: written over
        what the server holds (else only where it holds nothing)."""
        raw = text.encode("utf-8")
        if len(raw) > self.max_bytes:
            self.fault(
                "value too large", f"an entry of {len(raw)} bytes is over the limit of {self.max_bytes}"
            )
            return
        value = _packed(raw)
        with self.lock:
            if self.writer is None or not self.writer.is_alive():
                self.writer = threading.Thread(target=self.write_loop, name="gjit-remote-cache", daemon=True)
                self.writer.start()
        try:
            self.pending.put_nowait((key, value, replace))
        except queue.Full:
            self.fault("write queue full", f"{QUEUE_SIZE} entries wait to be written; dropped one")

    def write_loop(self) -> None:
        while True:
            item = self.pending.get()
            try:
                if item is None:
                    return
                self.write(*item)
            finally:
                self.pending.task_done()

    def write(self, key: str, value: bytes, replace: bool = False) -> None:
        if time.monotonic() < self.down_until:  # left alone after a connection failure
            stats.count("remote_cache_writes_dropped")
            return
        try:
            written = self.client.set(self.prefix + key, value, nx=not replace and key not in self.damaged)
            self.damaged.discard(key)
        except Exception as e:  # noqa: BLE001 - a failed write costs only another machine's compile
            kind, down = self.classify(e)
            self.fault(kind, f"{kind} ({e})", down)
            return
        stats.count("remote_cache_writes" if written else "remote_cache_already_there")
        cache_log.info("remote store: %s (%s)", key, "written" if written else "already there")

    # -- what a user saves (gjit.save(compiled, "remote:<name>")): now, or an error -----------------

    BULK_TIMEOUT = 120.0  # seconds a package's transfer may take (the connect stays short)

    def bulk(self) -> Any:
        """A client for packages: the same server, a long read/write timeout (a package of tens of
        MB takes longer than an entry lookup's timeout), the same short connect timeout."""
        if self.bulk_client is None:
            timeout = self.client.connection_pool.connection_kwargs.get("socket_connect_timeout")
            self.bulk_client = self.redis.Redis.from_url(
                self.url, socket_timeout=self.BULK_TIMEOUT, socket_connect_timeout=timeout
            )
        return self.bulk_client

    def client_error(self, e: Exception) -> RemoteCacheError:
        """A client failure as an error to raise, the password masked; a server that is down is
        left alone by the lookups for a while, as after any connection failure."""
        kind, down = self.classify(e)
        if down:
            self.down_until = time.monotonic() + RETRY_SECONDS
        return RemoteCacheError(_masked(f"{_safe_url(self.url)}: {kind} ({e})", self.url))

    def store(self, key: str, data: bytes) -> None:
        """Write `data` under `key` at once, replacing what is there; RemoteCacheError on a fault."""
        value = _packed(data)
        if len(data) > self.max_bytes or len(value) > self.max_bytes + len(MAGIC) + 65:
            raise RemoteCacheError(
                f"{len(data)} bytes, over the limit of {self.max_bytes} (GJIT_REMOTE_CACHE_MAX_BYTES)"
            )
        try:
            self.bulk().set(self.prefix + key, value)
        except Exception as e:  # noqa: BLE001 - any client failure: said, with the password masked
            raise self.client_error(e) from None

    def load(self, key: str) -> bytes | None:
        """The bytes stored under `key` (None when nothing is); RemoteCacheError on a fault or a
        value that does not check out."""
        try:
            value = self.bulk().get(self.prefix + key)
        except Exception as e:  # noqa: BLE001
            raise self.client_error(e) from None
        if value is None:
            return None
        try:
            return self.unpack_bytes(value)
        except _Fault as e:  # damaged, or over this process's GJIT_REMOTE_CACHE_MAX_BYTES
            raise RemoteCacheError(f"the value of {self.prefix + key} does not check out: {e}") from None

    def flush(self, timeout: float = 5.0) -> None:
        """Wait (at most `timeout` seconds) for queued writes."""
        if self.writer is None or not self.writer.is_alive():
            return
        deadline = time.monotonic() + timeout
        while self.pending.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)


def _packed(raw: bytes) -> bytes:
    """A value: this format's header, the sha256 of the compressed bytes, the compressed bytes."""
    packed = zlib.compress(raw, 6)
    return MAGIC + hashlib.sha256(packed).hexdigest().encode() + b"\n" + packed


def _masked(text: str, url: str) -> str:
    """`text` (an error message) with the URL's password, wherever it appears, masked."""
    found = re.search(r"(?i)password=([^&#]+)", url) or re.search(r"^(?:[^/]*//)?[^:@/]*:([^@]+)@", url)
    return text.replace(found.group(1), "***") if found and found.group(1) else text


def _safe_url(url: str) -> str:
    """The URL without its password, for logs: user info before an '@' (with or without a
    scheme) keeps only the user name, and a `password=` query parameter is masked."""
    url = re.sub(r"(?i)(password=)[^&#]*", r"\1***", str(url))
    head, at, host = url.rpartition("@")
    if not at:
        return url
    scheme, sep, credentials = head.rpartition("//") if "//" in head else ("", "", head)
    user = credentials.split(":", 1)[0]
    return f"{scheme}{sep}{user}{':***' if ':' in credentials else ''}@{host}"


_REMOTES: dict[tuple, RemoteCache | None] = {}
_REMOTES_LOCK = threading.Lock()
_NOTED: set[str] = set()


def note_disabled(why: str) -> None:
    """Say once why a configured remote cache is not used."""
    if why not in _NOTED:
        _NOTED.add(why)
        cache_log.warning("gjit: the remote cache is not used: %s", why)


def _settings() -> tuple:
    """(url, prefix, timeout, max bytes) from the config; a bad value is said once, then the default."""
    try:
        timeout = float(config.remote_cache_timeout)
    except ValueError as e:
        note_disabled(f"GJIT_REMOTE_CACHE_TIMEOUT is not a number of seconds ({e}); using 0.5")
        timeout = 0.5
    if not timeout > 0:  # 0 would make the socket non-blocking, None would wait forever
        note_disabled(f"a remote cache timeout of {timeout} s is not used; using 0.5")
        timeout = 0.5
    try:
        max_bytes = int(config.remote_cache_max_bytes)
    except ValueError as e:
        note_disabled(f"GJIT_REMOTE_CACHE_MAX_BYTES is not a number ({e}); using 32 MB")
        max_bytes = 32 * 2**20
    return str(config.remote_cache), str(config.remote_cache_prefix), timeout, max_bytes


def current() -> RemoteCache | None:
    """The remote cache the config names (one client per URL and settings), or None."""
    if not config.remote_cache:
        return None
    settings = _settings()
    url = settings[0]
    with _REMOTES_LOCK:  # one client per settings: a second would have a writer flush_all misses
        if settings not in _REMOTES:
            try:
                _REMOTES[settings] = RemoteCache(*settings)
            except Exception as e:  # noqa: BLE001 - no client library, a malformed URL: no remote tier
                stats.count("remote_cache_errors")
                reason = _masked(f"{type(e).__name__}: {e}", url)
                cache_log.warning("gjit: remote cache %s not used: %s", _safe_url(url), reason)
                _REMOTES[settings] = None
        return _REMOTES[settings]


def _forget_after_fork() -> None:
    """A forked child starts with no clients: the parent's queue, writer thread and sockets are not
    its own (a queued item no thread will finish would hold its exit for the flush timeout)."""
    global _REMOTES_LOCK
    _REMOTES.clear()
    _REMOTES_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)


@atexit.register
def flush_all() -> None:
    """Queued writes go out before the process ends (each server at most a few seconds)."""
    for remote in list(_REMOTES.values()):
        if remote is not None:
            remote.flush()
