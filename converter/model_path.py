"""What "a model" names on the command line and in `fuselm.load`: an artifact folder, a GGUF
file or an HF checkpoint folder, resolved to an artifact folder by one function.

A GGUF or an HF folder is converted once, with the default conversion, into fuselm's cache
(`$XDG_CACHE_HOME/fuselm/converted/<name>-<key>/`, else under ~/.cache); the key is made from
the source's path and its files' size, modification time and inode, so a changed file converts
again and an unchanged one is reused without a look at its contents. The cache folder is
printed to stderr either way. After a conversion, stale and least recently used entries are
removed (converter/model_cache.py says which).

A cache entry is written by the ordinary pipeline (converter/out_dir.py: built in a hidden
sibling, swapped in complete), so a killed conversion never leaves a half-written entry that
a later call would use; the next conversion removes what it left. Two processes asking for
the same entry at once are serialized on a lock file beside it: the second waits (it says so)
and then reuses what the first wrote.
"""

from __future__ import annotations

import errno
import re
from pathlib import Path

from fuselm.converter.errors import UserError
from fuselm.converter.model_cache import (
    cache_entry,
    conversion_folder,
    evict,
    mark_used,
    say,
    waiting_lock,
)
from fuselm.export.gguf.file import is_gguf
from fuselm.runtime_metal.artifact import MANIFEST


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


def model_name(artifact: Path) -> str:
    """The name to show for an artifact: its folder's, without the cache key of a conversion
    folder (`SmolLM2-135M-Instruct.Q4_1`, not `SmolLM2-135M-Instruct.Q4_1-418ba3ea126dbca9`)."""
    path = artifact.resolve()
    if path.parent == conversion_folder().resolve():
        return re.sub(r"-[0-9a-f]{16}$", "", path.name)
    return path.name


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
        mark_used(entry, src)
        return entry
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot make fuselm's cache folder {entry.parent} ({e.strerror}); set "
                        "XDG_CACHE_HOME to a writable folder, or convert it yourself: "
                        f"fuselm convert {path} -o OUT_DIR") from None
    with waiting_lock(entry):
        if (entry / MANIFEST).is_file():  # written by the process we waited for
            say(f"using {entry} (converted from {path})")
            mark_used(entry, src)
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
        mark_used(entry, src)
    for gone, reason in evict(spare=entry):
        say(f"removed {gone.path} from the cache ({reason})")
    return entry
