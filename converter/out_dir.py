"""Safe output folders for `fuselm convert`: refuse a dangerous -o, build beside, swap, recover.

A conversion never writes into OUT_DIR. It builds the new artifact in a hidden sibling and
swaps it in only when complete:

    .OUT.tmp-<pid>-<rand>/   the new artifact being built
    .OUT.old-<pid>-<rand>/   the previous OUT, set aside for the moment of the swap

The swap is rename(OUT → old), rename(tmp → OUT), then every entry of the old folder that the
old artifact does not own (the user's own files) is moved into the new OUT, and the rest of the
old folder is removed. Nothing the artifact does not own is ever deleted.

A conversion killed part-way leaves these folders behind with a dead process id in their name.
The next conversion onto the same OUT repairs what was left (`recover`): an `old` folder whose
OUT is missing is renamed back (the kill fell between the two renames), otherwise its foreign
files are moved into OUT; then the dead process's folders are removed. A folder whose process is
alive (or whose name carries no id) is never touched. Process ids are only meaningful on this
host: a folder on a shared file system written by another host's process is left alone unless
the same id happens to be dead here too (the worst case is a removed temp build, never OUT).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from pathlib import Path

from fuselm.converter.errors import UserError
from fuselm.runtime_metal import artifact

# Names an artifact owns whatever its manifest says (older manifests listed fewer files).
_ALWAYS_OWNED = {
    artifact.MANIFEST,
    artifact.MODEL_FILE,
    artifact.DATA_FILE,
    artifact.GENERATION_CONFIG,
    *artifact.TOKENIZER_FILES,
    "raw.onnx",  # --keep-intermediate
    "raw.onnx.data",
}


def check_paths(model_dir: Path, out_dir: Path) -> None:
    """Refuse an -o that would replace or swallow the input, or the folder we stand in."""
    src, out, cwd = model_dir.resolve(), out_dir.resolve(), Path.cwd().resolve()
    if out == src:
        raise UserError(
            f"-o {out_dir} is the input folder itself; converting in place would replace the "
            "checkpoint. Choose a new output folder")
    if src in out.parents:
        raise UserError(
            f"-o {out_dir} lies inside the input folder {model_dir}; choose an output folder "
            "outside the checkpoint")
    if out in src.parents:
        raise UserError(
            f"the input folder {model_dir} lies inside -o {out_dir}; a conversion replaces "
            "OUT_DIR as a whole, so choose an output folder that does not contain the checkpoint")
    if out == cwd or out in cwd.parents:
        raise UserError(
            f"-o {out_dir} is the current directory (or contains it); a conversion replaces "
            "OUT_DIR as a whole. Choose a new folder, e.g. -o ./artifact")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _pattern(name: str) -> re.Pattern[str]:
    return re.compile(rf"^\.{re.escape(name)}\.(tmp|old)-(\d+)-[A-Za-z0-9_]+$")


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def owned_names(folder: Path) -> set[str]:
    """The entries of an artifact folder that belong to the artifact (its manifest's files)."""
    names = set(_ALWAYS_OWNED)
    with contextlib.suppress(Exception):  # an unreadable manifest owns the usual names only
        files = artifact.read_manifest(folder).files
        for value in files.values():
            if isinstance(value, str):
                names.add(value)
            elif isinstance(value, list):
                names.update(v for v in value if isinstance(v, str))
    return names


def _move_foreign(old: Path, new: Path) -> None:
    """Move the user's own entries from the set-aside folder into the new OUT."""
    owned = owned_names(old)
    for entry in sorted(old.iterdir()):
        if entry.name in owned or (new / entry.name).exists():
            continue
        os.replace(entry, new / entry.name)


def recover(out_dir: Path) -> list[str]:
    """Repair what killed conversions onto `out_dir` left behind; return what was done."""
    out = out_dir.resolve()
    parent, pattern, done = out.parent, _pattern(out.name), []
    if not parent.is_dir():
        return done
    leftovers = []
    for entry in parent.iterdir():
        m = pattern.match(entry.name)
        if m and entry.is_dir() and not entry.is_symlink() and not _alive(int(m.group(2))):
            leftovers.append((m.group(1), entry))
    # The set-aside old folders first: they decide whether OUT must be restored.
    for kind, entry in sorted(leftovers, key=lambda x: x[0] != "old"):
        if kind == "old":
            if not out.exists():
                os.replace(entry, out)
                done.append(f"restored {out} from {entry.name}")
                continue
            _move_foreign(entry, out)
            done.append(f"merged and removed {entry.name}")
        else:
            done.append(f"removed {entry.name}")
        shutil.rmtree(entry, ignore_errors=True)
    return done


def check_target(out_dir: Path) -> None:
    """Refuse an OUT_DIR that is a file, holds a model checkpoint, or holds other files but no
    fuselm artifact (a conversion replaces OUT_DIR as a whole)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"output path {out_dir} exists and is not a directory; choose another -o")
    if not out_dir.is_dir():
        return
    entries = list(out_dir.iterdir())
    held = sorted(p.name for p in entries
                  if p.name == "config.json" or p.suffix in (".safetensors", ".gguf"))
    if held:  # a checkpoint with a stray fuselm.json: its tokenizer files would be replaced
        raise UserError(
            f"output directory {out_dir} holds a model checkpoint ({', '.join(held)}); a "
            "conversion would replace its tokenizer files. Choose another -o")
    if entries and not (out_dir / artifact.MANIFEST).is_file():
        raise UserError(
            f"output directory {out_dir} is not empty and holds no fuselm artifact; "
            "choose an empty or new directory")


def prepare(out_dir: Path) -> Path:
    """Check OUT_DIR can be (re)written, repair leftovers; return a fresh temp folder beside it."""
    check_target(out_dir)
    out = out_dir.resolve()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        recover(out)
        check_target(out)  # what recovery restored is checked too
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{os.getpid()}-", dir=out.parent))
    except OSError as e:
        raise UserError(
            f"output path {out_dir} is not writable ({e.strerror}); choose another -o"
        ) from None
    tmp.chmod(0o777 & ~_umask())  # mkdtemp makes it private; the artifact is not
    return tmp


def swap_in(tmp: Path, out_dir: Path) -> None:
    """Make the complete artifact in `tmp` the new OUT_DIR, keeping the user's own files."""
    out = out_dir.resolve()
    if not out.exists():
        os.replace(tmp, out)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-{os.getpid()}-", dir=out.parent))
    old.rmdir()  # only the unique name is wanted: rename needs a free target
    os.replace(out, old)
    try:
        os.replace(tmp, out)
    except BaseException:
        os.replace(old, out)  # put the previous artifact back before reporting the failure
        raise
    _move_foreign(old, out)
    shutil.rmtree(old, ignore_errors=True)
