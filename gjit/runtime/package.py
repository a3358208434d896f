"""The package file: one zip archive of JSON members (and safetensors weights), checked on read.

    manifest.json     format, versions (gjit's source hash, torch, triton, Python), what the package
                      was built for (model class, state names, shapes and dtypes), and the sha256 of
                      every other member
    entries/<k>.json  one compiled entry each (gjit/packaging.py writes and reads them)
    weights.safetensors   parameters and buffers, when saved with weights=True

Reading checks, before anything is used: the archive opens and every member's CRC holds, the
manifest parses and is of this format, every member it lists is there with its sha256 and nothing
else is, and the versions are this process's. Any failure is a PackageError saying what differs.
Nothing is unpickled or evaluated here.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import zipfile
from typing import Any

from gjit.codegen.toolchain.files import atomic_write
from gjit.runtime import remote_cache
from gjit.runtime.disk_cache import versions

FORMAT = 1
MANIFEST = "manifest.json"


class PackageError(Exception):
    """A package that cannot be written, or one that is refused on load (the message says why)."""


REMOTE = "remote:"  # a path naming a package in the fleet's remote cache (GJIT_REMOTE_CACHE)
_NAME = re.compile(r"^[A-Za-z0-9_.:/\-]{1,200}$")


def is_remote(path: Any) -> bool:
    """A "remote:<name>" string (a pathlib.Path is always a file, even one named so)."""
    return isinstance(path, str) and path.startswith(REMOTE)


def _remote(path: str) -> tuple[remote_cache.RemoteCache, str]:
    """(the configured remote cache, the key) of a "remote:<name>" path."""
    name = path[len(REMOTE) :]
    if not _NAME.fullmatch(name):
        raise PackageError(f"{path!r}: after 'remote:' a name of letters, digits and ._:/- is expected")
    remote = remote_cache.current()
    if remote is None:
        raise PackageError(
            f"{path}: no usable remote cache (set GJIT_REMOTE_CACHE=redis://... or gjit.config.remote_cache; "
            "a warning above says why a configured one is not used)"
        )
    return remote, "package-" + name


def write(path: str, manifest: dict, members: dict[str, bytes]) -> None:
    """Write the archive atomically, to a file or (path "remote:<name>") to the fleet's remote
    cache; `manifest` gets the format, versions and member hashes."""
    manifest = {
        **manifest,
        "format": FORMAT,
        "versions": versions(),
        "members": {name: hashlib.sha256(data).hexdigest() for name, data in sorted(members.items())},
    }
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=1) as archive:
        archive.writestr(MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
        for name, data in sorted(members.items()):
            archive.writestr(name, data)
    if is_remote(path):
        remote, key = _remote(path)
        try:
            remote.store(key, buffer.getvalue())
        except remote_cache.RemoteCacheError as e:
            raise PackageError(f"{path} could not be written: {e}") from None
        return
    atomic_write(os.path.abspath(os.fspath(path)), buffer.getvalue())


def read(path: str) -> tuple[dict, dict[str, bytes]]:
    """(manifest, members) of a package that passed every check above."""
    source: Any = os.fspath(path)
    if is_remote(path):
        remote, key = _remote(path)
        try:
            data = remote.load(key)
        except remote_cache.RemoteCacheError as e:
            raise PackageError(f"{path} could not be read: {e}") from None
        if data is None:
            raise PackageError(f"{path}: the remote cache holds no package of that name")
        source = io.BytesIO(data)
    try:
        with zipfile.ZipFile(source) as archive:
            names = archive.namelist()
            data = {name: archive.read(name) for name in names}  # checks each member's CRC
    except FileNotFoundError:
        raise
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
        raise PackageError(f"{path} is not a readable gjit package ({type(e).__name__}: {e})") from e
    if MANIFEST not in data:
        raise PackageError(f"{path} has no {MANIFEST}: not a gjit package")
    try:
        manifest = json.loads(data.pop(MANIFEST))
    except ValueError as e:
        raise PackageError(f"{path}: the manifest does not parse ({e})") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise PackageError(f"{path} is package format {found!r}; this gjit reads format {FORMAT}")
    _check_versions(path, manifest.get("versions", {}))
    listed = manifest.get("members", {})
    if set(listed) != set(data):
        missing, extra = sorted(set(listed) - set(data)), sorted(set(data) - set(listed))
        raise PackageError(f"{path} is damaged: members missing {missing}, unexpected {extra}")
    for name, digest in listed.items():
        if hashlib.sha256(data[name]).hexdigest() != digest:
            raise PackageError(f"{path} is damaged: {name} does not match its sha256 in the manifest")
    return manifest, data


def _check_versions(path: str, built: dict[str, Any]) -> None:
    here = versions()
    differ = [f"{k} {built.get(k)!r} (this process: {v!r})" for k, v in here.items() if built.get(k) != v]
    if differ:
        what = "; ".join(d if not d.startswith("gjit ") else "gjit's sources differ" for d in differ)
        raise PackageError(
            f"{path} was built by another version: {what}. Compile the model again (gjit.compile) "
            "and save a new package with this version."
        )
