"""Generated sources on disk: content-addressed files written atomically, and their import.

Triton's JIT and its interpreter read a kernel's source from a real file, so every generated
kernel and wrapper is a file under the cache dir, named after its content's hash.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile
import types
from typing import Any

from gjit import logs
from gjit.config import config

cache_log = logs.logger("cache")


def atomic_write(path: str, data: str | bytes) -> None:
    """Write through a temp file in the same folder, then rename: readers see all of it or nothing."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def write_source(kind: str, name: str, source: str, ext: str = ".py") -> str:
    """Write `source` under the cache dir, content-addressed, atomically. A file already there is
    reused only if its content still matches its name; a damaged one is logged and rewritten."""
    digest = _digest(source)
    path = os.path.join(config.cache_dir, kind, digest[:2], f"{name}_{digest}{ext}")
    try:
        with open(path, encoding="utf-8") as f:
            intact = _digest(f.read()) == digest
    except FileNotFoundError:
        cache_log.info("on-disk miss: writing %s %s to %s", kind, name, path)
    except (OSError, UnicodeDecodeError) as e:
        cache_log.warning("gjit: unreadable cached %s %s (%s); rewriting it", kind, path, e)
    else:
        if intact:
            cache_log.info("on-disk hit: %s %s is already at %s", kind, name, path)
            return path
        cache_log.warning("gjit: the cached %s %s does not match its content hash; rewriting it", kind, path)
    atomic_write(path, source)
    return path


def import_file(path: str, extra: dict[str, Any] | None = None, suffix: str = "") -> types.ModuleType:
    """Import a generated file as a module of its own (named after the file, plus `suffix`), with
    `extra` in its globals."""
    name = "gjit_generated_" + os.path.basename(path)[:-3] + suffix
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    module.__dict__.update(extra or {})
    sys.modules[name] = module  # inspect.getsource needs the module registered
    spec.loader.exec_module(module)
    return module
