"""Results worked out from files, kept on disk under the files' fingerprints.

``treadle check`` reads every data row through the tokenizer, an answer that depends only on
files. This module keeps such an answer (JSON) under a key that holds the fingerprint of every
file it came from, so a second check of the same files reads it back in milliseconds, and a
changed file misses.

A file's fingerprint is its resolved path, device, inode, size, modification and change times
(``st_ctime`` moves on every write and on ``touch -d``, which a user cannot set back). Two
writes within one tick of the file system's clock could leave the same fingerprint, so a
fingerprint also says whether the file was settled when it was taken (last written at least
``SETTLE_S`` seconds before), and an answer is stored only when every file it read was: a write
after that has a later time, and a file written just before the check is read again next time.
Every key also holds treadle's own source (``code_fingerprint``: an edit of treadle misses) and
the versions of the libraries that read the files.

The store is ``$TREADLE_CHECK_CACHE`` (default ``~/.cache/treadle/check``; ``off`` turns it
off): one small JSON file per answer, written to a temporary name and renamed. Only answers
that passed are stored: a problem is always found again, with its own message.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

SETTLE_S = 2.0  # a file younger than this (its mtime or ctime) is not trusted to a stored answer
ENV = "TREADLE_CHECK_CACHE"
Fingerprint = list[Any]


def root() -> Path | None:
    """The store's folder, or None when turned off (``TREADLE_CHECK_CACHE=off``)."""
    value = os.environ.get(ENV, "")
    if value.lower() in ("off", "0", "false", "no"):
        return None
    return Path(value).expanduser() if value else Path.home() / ".cache" / "treadle" / "check"


def fingerprint(path: str | Path) -> Fingerprint:
    """``[resolved path, dev, inode, size, mtime_ns, ctime_ns, settled]`` of a file (OSError if
    none); ``settled``: last written ``SETTLE_S`` seconds ago or more."""
    real = os.path.realpath(path)
    return stat_fingerprint(real, os.stat(real))


def stat_fingerprint(path: str, st: os.stat_result) -> Fingerprint:
    """:func:`fingerprint` of ``path`` (already resolved) from its ``st``, taken by the caller
    (a ``scandir`` entry's, without a ``stat`` call of its own)."""
    settled = max(st.st_mtime_ns, st.st_ctime_ns) <= time.time_ns() - int(SETTLE_S * 1e9)
    return [path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, settled]


def folder_fingerprint(folder: str | Path, skip: tuple[str, ...] = ()) -> list[Fingerprint]:
    """The fingerprints of the files directly in ``folder`` (not those ending in ``skip``)."""
    names = sorted(os.listdir(folder))
    files = [Path(folder, n) for n in names if not n.endswith(skip)]
    return [fingerprint(f) for f in files if f.is_file()]


@functools.cache
def code_fingerprint() -> str:
    """A digest of treadle's own source files (every ``.py`` of the package)."""
    package = Path(__file__).resolve().parent.parent
    prints = [fingerprint(p) for p in sorted(package.rglob("*.py"))]
    return digest(prints)


@functools.cache
def versions(*names: str) -> list[str]:
    """``name==version`` of each installed distribution (``name==?`` when it is not)."""
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for name in names:
        try:
            out.append(f"{name}=={version(name)}")
        except PackageNotFoundError:
            out.append(f"{name}==?")
    return out


def lookup(kind: str, key: Any) -> Any | None:
    """The answer stored for ``key`` (JSON-able: it holds the files' fingerprints), or None."""
    path = _path(kind, key)
    if path is None:
        return None
    try:
        entry = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return (
        entry.get("value") if isinstance(entry, dict) and entry.get("key") == _plain(key) else None
    )


def store(kind: str, key: Any, value: Any, files: Iterable[Fingerprint]) -> None:
    """Keep ``value`` for ``key``, unless one of ``files`` (fingerprints, taken before the files
    were read) was not settled or the store cannot be written (then nothing is kept)."""
    path = _path(kind, key)
    if path is None or not all(fp[6] for fp in files):
        return
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"key": _plain(key), "value": value}), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):  # (its folder may be what could not be made)
            tmp.unlink(missing_ok=True)


def _plain(key: Any) -> Any:
    """``key`` as it reads back from JSON (tuples become lists)."""
    return json.loads(json.dumps(key, sort_keys=True))


def digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def _path(kind: str, key: Any) -> Path | None:
    folder = root()
    if folder is None:
        return None
    return folder / kind / f"{digest([code_fingerprint(), key])}.json"
