"""What "a model" names on the command line and in `fuselm.load`: an artifact folder, a GGUF
file or an HF checkpoint folder, resolved to an artifact folder by one function.

A GGUF or an HF folder is converted once, with the default conversion, into fuselm's cache
(`$XDG_CACHE_HOME/fuselm/converted/<name>-<key>/`, else under ~/.cache); the key is made from
the source's path and its files' size, modification time and inode, so a changed file converts
again and an unchanged one is reused without a look at its contents. The cache folder is
printed to stderr either way.

A cache entry is written by the ordinary pipeline (converter/out_dir.py: built in a hidden
sibling, swapped in complete), so a killed conversion never leaves a half-written entry that
a later call would use; the next conversion removes what it left. Two processes asking for
the same entry at once are serialized on a lock file beside it: the second waits (it says so)
and then reuses what the first wrote.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

from fuselm.config import cache_folder
from fuselm.converter.errors import UserError
from fuselm.export.gguf.file import is_gguf
from fuselm.runtime_metal.artifact import MANIFEST

CACHE_SUBDIR = "converted"


def conversion_folder() -> Path:
    """Where converted GGUF files and HF folders are kept."""
    return cache_folder() / CACHE_SUBDIR


def source_kind(path: Path) -> str | None:
    """"artifact", "gguf", "hf" for what `path` holds; None when it is none of them (the
    caller's own error names what is missing)."""
    if path.is_dir():
        if (path / MANIFEST).is_file():
            return "artifact"
        if (path / "config.json").is_file():
            return "hf"
        return None
    if path.is_file() and is_gguf(path):
        return "gguf"
    return None


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


def model_name(artifact: Path) -> str:
    """The name to show for an artifact: its folder's, without the cache key of a conversion
    folder (`SmolLM2-135M-Instruct.Q4_1`, not `SmolLM2-135M-Instruct.Q4_1-418ba3ea126dbca9`)."""
    path = artifact.resolve()
    if path.parent == conversion_folder().resolve():
        return re.sub(r"-[0-9a-f]{16}$", "", path.name)
    return path.name


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@contextlib.contextmanager
def waiting_lock(entry: Path) -> Iterator[None]:
    """Hold `.ENTRY.wait` (flock): one process converts an entry, the others wait for it."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(entry.parent / f".{entry.name}.wait", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"waiting for another fuselm process converting into {entry}")
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # the file stays: removing it could let two processes lock two inodes


def resolve_model(path: str | Path, progress: bool = True) -> Path:
    """The artifact folder for `path`: an artifact folder as is; a GGUF file or an HF folder
    converted into the cache on first use (the default conversion) and reused after; anything
    else as is (opening it then names what is missing). `progress`: the conversion's stage
    bars on stderr (converter/progress.py)."""
    src = Path(path)
    kind = source_kind(src)
    if kind is None and src.suffix.lower() == ".gguf" and not src.exists():
        raise UserError(f"{path}: no such file")
    if kind in (None, "artifact"):
        return src
    entry = cache_entry(src)
    if (entry / MANIFEST).is_file():
        say(f"using {entry} (converted from {path})")
        return entry
    with waiting_lock(entry):
        if (entry / MANIFEST).is_file():  # written by the process we waited for
            say(f"using {entry} (converted from {path})")
            return entry
        say(f"converting {path} ({'GGUF' if kind == 'gguf' else 'HF folder'}) once into "
            f"{entry}; later calls reuse it")
        from fuselm.converter.pipeline import ConvertOptions, convert
        from fuselm.converter.progress import stage_progress

        try:
            with stage_progress(progress) as bar:
                convert(src, entry, ConvertOptions(), bar)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise UserError(f"no space left converting {path} into {entry}: free some, or "
                                "remove old entries of "
                                f"{conversion_folder()}") from None
            raise
    return entry
