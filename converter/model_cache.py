"""The cache of converted GGUF files and HF folders (`$XDG_CACHE_HOME/fuselm/converted/`, else
under ~/.cache): where entries live, which source each came from, and which ones go.

An entry is `<name>-<key>/`, an artifact folder written by the ordinary pipeline; the key is a
digest of the source's resolved path and its files' size, modification time and inode (and
fuselm's version), so a changed source converts into a new entry. Beside each entry,
`.<entry>.source` records the source's path; its modification time is the entry's last use
(converter/model_path.py touches it on every use). `.<entry>.wait` is the lock one conversion
holds while others wait.

Eviction, after every conversion into the cache (and `fuselm cache prune`):
- an entry whose source no longer exists, or has changed (its key is not the source's key any
  more, fuselm upgrades included), is removed: no call would use it again;
- of the rest, the KEEP most recently used are kept and older ones removed.
An entry another process is converting into (its lock held) is never touched. A process
running an entry that is removed keeps running: its weights are in memory (and on POSIX an
open or mapped file outlives its name); the next call converts the source again.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from fuselm.config import cache_folder
from fuselm.runtime_metal.artifact import MANIFEST

CACHE_SUBDIR = "converted"
KEEP = 4  # converted models kept (most recently used first), besides stale ones removed


def conversion_folder() -> Path:
    """Where converted GGUF files and HF folders are kept."""
    return cache_folder() / CACHE_SUBDIR


def cache_key(path: Path) -> str:
    """A digest of the source's resolved path and its files' stat (size, mtime, inode): what
    changes when the file is rewritten, replaced or edited."""
    src = path.resolve()
    files = [src] if src.is_file() else sorted(p for p in src.iterdir() if p.is_file())
    stats = []
    for f in files:
        st = f.stat()
        stats.append([f.name, st.st_size, st.st_mtime_ns, st.st_ino])
    from fuselm import __version__

    record = json.dumps({"source": str(src), "files": stats, "fuselm": __version__})
    return hashlib.sha256(record.encode()).hexdigest()[:16]


def cache_entry(path: Path) -> Path:
    """The cache folder a GGUF file or an HF folder converts into."""
    name = path.resolve().name.removesuffix(".gguf") or "model"
    return conversion_folder() / f"{name}-{cache_key(path)}"


def _source_file(entry: Path) -> Path:
    return entry.parent / f".{entry.name}.source"


def _wait_file(entry: Path) -> Path:
    return entry.parent / f".{entry.name}.wait"


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@contextlib.contextmanager
def waiting_lock(entry: Path) -> Iterator[None]:
    """Hold `.ENTRY.wait` (flock): one process converts an entry, the others wait for it."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(_wait_file(entry), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"waiting for another fuselm process converting into {entry}")
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # the file stays: removing it could let two processes lock two inodes


def mark_used(entry: Path, source: Path) -> None:
    """Record `entry`'s source and that it was used now."""
    record = _source_file(entry)
    with contextlib.suppress(OSError):  # a read-only cache still serves its entries
        record.write_text(json.dumps({"source": str(source.resolve())}) + "\n")


@dataclass
class Entry:
    path: Path
    source: str | None  # the GGUF file or HF folder it was converted from (None: unknown)
    state: str  # "current" | "source missing" | "source changed" | "unknown source"
    last_used: float  # seconds since the epoch
    bytes: int

    def to_dict(self) -> dict[str, object]:
        return {"path": str(self.path), "source": self.source, "state": self.state,
                "last_used": round(self.last_used, 3), "bytes": self.bytes}


def _recorded_source(entry: Path) -> str | None:
    try:
        return str(json.loads(_source_file(entry).read_text())["source"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _state(entry: Path, source: str | None) -> str:
    if source is None:
        return "unknown source"
    src = Path(source)
    if not src.exists():
        return "source missing"
    try:
        same = entry.name.endswith("-" + cache_key(src))
    except OSError:
        return "source missing"
    return "current" if same else "source changed"


def _size(folder: Path) -> int:
    total = 0
    for p in folder.rglob("*"):
        with contextlib.suppress(OSError):
            if p.is_file() and not p.is_symlink():
                total += p.stat().st_size
    return total


def entries() -> list[Entry]:
    """The complete entries (those holding fuselm.json), most recently used first."""
    folder = conversion_folder()
    if not folder.is_dir():
        return []
    out = []
    for path in folder.iterdir():
        if path.name.startswith(".") or not (path / MANIFEST).is_file():
            continue  # a build in progress, a lock, a record
        source = _recorded_source(path)
        try:
            used = _source_file(path).stat().st_mtime
        except OSError:  # no record (written before records were): the conversion's time
            used = (path / MANIFEST).stat().st_mtime
        out.append(Entry(path, source, _state(path, source), used, _size(path)))
    return sorted(out, key=lambda e: e.last_used, reverse=True)


def remove(entry: Path) -> bool:
    """Remove an entry, its record and its lock file, unless a conversion holds its lock."""
    wait = _wait_file(entry)
    try:
        fd = os.open(wait, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # being converted into (or waited on) right now
        shutil.rmtree(entry, ignore_errors=True)
        _source_file(entry).unlink(missing_ok=True)
        wait.unlink(missing_ok=True)  # while held: nobody waits for a folder that is gone
        return not entry.exists()
    finally:
        os.close(fd)


STALE = ("source missing", "source changed")


def evict(keep: int = KEEP, spare: Path | None = None) -> list[tuple[Entry, str]]:
    """Remove stale entries (source missing or changed) and all but the `keep` most recently
    used of the others; `spare` (the entry just made or used) is never removed. Returns the
    entries removed, each with the reason."""
    removed = []
    kept = 0
    for e in entries():
        if spare is not None and e.path == spare:
            kept += 1
            continue
        if e.state in STALE or kept >= keep:
            if remove(e.path):
                removed.append((e, e.state if e.state in STALE else
                                f"beyond the {keep} most recently used"))
            continue
        kept += 1
    return removed


def drop_leftovers() -> None:
    """Remove what a conversion that failed or was killed leaves beside no entry: its lock
    file and its source record (unless a conversion holds that lock right now). Run by
    `cache prune` and `cache clear`, not after every conversion: a lock file removed while a
    conversion is opening it could let two conversions hold two files."""
    folder = conversion_folder()
    if not folder.is_dir():
        return
    for lock in folder.glob(".*.wait"):
        entry = folder / lock.name[1:-len(".wait")]
        if not (entry / MANIFEST).is_file():
            remove(entry)


def clear() -> list[Entry]:
    """Remove every entry (not those being converted into right now), and what failed
    conversions left."""
    removed = [e for e in entries() if remove(e.path)]
    drop_leftovers()
    return removed


def age(seconds: float) -> str:
    """'3 min ago', '2 h ago', '5 d ago' for a last-use time."""
    d = max(0.0, time.time() - seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if d >= size:
            return f"{int(d // size)} {unit} ago"
    return "just now"
