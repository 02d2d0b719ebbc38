"""Safe output folders for `fuselm convert`: refuse a dangerous -o, build beside, swap, recover.

A conversion never writes into OUT_DIR. It takes OUT_DIR's lock, builds the new artifact in a
hidden sibling and swaps it in only when complete:

    .OUT.lock                the lock (fcntl.flock) held from `prepare` to the end of the swap
    .OUT.tmp-<pid>-<rand>/   the new artifact being built
    .OUT.old-<pid>-<rand>/   the previous OUT, set aside for the moment of the swap

The swap is rename(OUT → old), rename(tmp → OUT), then every entry of the old folder that is
not fuselm's (the user's) is moved into the new OUT, and the rest of the old folder is removed.
A file is fuselm's only if the old fuselm.json recorded it (integrity: size and SHA-256), its
content still matches that record, and it bears a name a conversion writes; everything else is
the user's, whatever its name, and is never deleted. A user's file whose name the new artifact
also writes is refused before any work (one error line naming it), not replaced.

Two conversions into one OUT: the second is refused at once (`flock` with LOCK_NB), not queued.
A conversion takes minutes to hours; a queued one would wait without a word and then replace
the first one's result, while a refusal tells the user at once that OUT is busy.

A conversion killed part-way leaves these folders behind with a dead process id in their name.
The next conversion onto the same OUT repairs what was left (`recover`): an `old` folder whose
OUT is missing is renamed back (the kill fell between the two renames), otherwise its user files
are moved into OUT; then the dead process's folders are removed. A folder whose process is
alive (or whose name carries no id) is never touched. Process ids are only meaningful on this
host: a folder on a shared file system written by another host's process is left alone unless
the same id happens to be dead here too (the worst case is a removed temp build, never OUT).
Scratch folders in the system temp folder (`scratch`, e.g. a GGUF's staged metadata) carry the
process id too, and every conversion removes those of dead processes. SIGTERM is not a kill:
while a conversion runs it ends the process as Ctrl-C does (`terminate_as_exit`), removing its
own folders and lock at once. The swap itself (`swap_in`) holds SIGTERM and SIGINT until its
renames are done (`signals_deferred`), so a signal never leaves OUT missing.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import signal
import stat
import tempfile
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from fuselm.converter.errors import UserError
from fuselm.runtime_metal import artifact
from fuselm.runtime_metal.integrity import file_digest

# Every name a conversion writes into an artifact: only these can be fuselm's.
ARTIFACT_NAMES = frozenset({
    artifact.MANIFEST,
    artifact.MODEL_FILE,
    artifact.DATA_FILE,
    artifact.GENERATION_CONFIG,
    *artifact.TOKENIZER_FILES,
    *artifact.INTERMEDIATE_FILES,
})
# Write errors that mean the disk (or the user's quota or file size limit) is full.
NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_SCRATCH = re.compile(r"^fuselm-([a-z]+)-(\d+)-[A-Za-z0-9_]+$")


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
    refuse_mount_point(out_dir)


def _mount_points() -> set[Path]:
    """Every mount point this process sees (Linux: /proc/self/mountinfo; elsewhere none, and
    os.path.ismount alone decides)."""
    points = set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            fields_ = line.split()
            if len(fields_) > 4:  # field 5 is the mount point, spaces written as \040
                points.add(Path(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)),
                                       fields_[4])))
    return points


def refuse_mount_point(out_dir: Path) -> None:
    """Refuse an OUT_DIR that is a mount point, before any work: the swap renames OUT_DIR, and
    a mount point cannot be renamed (EBUSY), which would only show after the whole conversion.
    A bind mount from the same file system is found through the mount table."""
    if not out_dir.is_dir():
        return
    out = out_dir.resolve()
    if os.path.ismount(out) or out in _mount_points():
        raise UserError(
            f"-o {out_dir} is a mount point; a conversion builds the new artifact beside "
            "OUT_DIR and swaps it in by renaming, and a mount point cannot be renamed. Convert "
            f"into a folder inside it instead, e.g. -o {out_dir / 'model'}")


def no_space(e: OSError, out: Path, where: Path | None = None) -> UserError:
    """The one error line for a write that failed for lack of space (`e.errno` in NO_SPACE)."""
    at = f" writing {e.filename}" if e.filename else ""
    return UserError(
        f"the disk is full ({e.strerror}{at}); {out} is unchanged and the partial build was "
        f"removed. Free space on the file system of {where or out.parent}, or choose another -o")


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


Fingerprint = tuple[int, int, int, int, int]


def _fingerprint(path: Path) -> Fingerprint | None:
    """(device, inode, size, mtime, ctime) of a regular file (not a symlink), else None: equal
    fingerprints mean untouched content (ctime moves on every write and cannot be set back)."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _manifest_record(folder: Path) -> dict | None:
    """The old fuselm.json as JSON if it is a fuselm manifest (its `format`), else None."""
    try:
        raw = json.loads((folder / artifact.MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    return raw if isinstance(raw, dict) and raw.get("format") == artifact.FORMAT else None


def recorded_files(folder: Path) -> set[str]:
    """The names of the files the fuselm artifact in `folder` records (its fuselm.json's
    integrity and files sections; none where there is no fuselm manifest), unhashed."""
    raw = _manifest_record(folder)
    if raw is None:
        return set()
    integrity = raw.get("integrity")
    records = integrity.get("files") if isinstance(integrity, dict) else None
    files = raw.get("files")
    return {*(records if isinstance(records, dict) else ()),
            *(v for v in (files.values() if isinstance(files, dict) else ())
              if isinstance(v, str))}


def owned_files(folder: Path) -> dict[str, Fingerprint]:
    """The files of an artifact folder that are fuselm's, with their fingerprints: fuselm.json
    itself (a fuselm manifest), and each file it records in `integrity.files` that bears a name a
    conversion writes and still has the recorded size and SHA-256. Everything else is the
    user's. Costs one read of every recorded file (a re-convert reads the old artifact once)."""
    raw = _manifest_record(folder)
    if raw is None:
        return {}
    owned = {}
    if (fp := _fingerprint(folder / artifact.MANIFEST)) is not None:
        owned[artifact.MANIFEST] = fp
    integrity = raw.get("integrity")
    records = integrity.get("files") if isinstance(integrity, dict) else None
    for name, rec in (records.items() if isinstance(records, dict) else ()):
        if name not in ARTIFACT_NAMES or name == artifact.MANIFEST or not isinstance(rec, dict):
            continue
        path = folder / name
        fp = _fingerprint(path)
        if fp is None or fp[2] != rec.get("size"):
            continue
        with contextlib.suppress(OSError, artifact.ArtifactError):
            if file_digest(path) == rec.get("sha256") and _fingerprint(path) == fp:
                owned[name] = fp
    return owned


def _clash_error(out: Path, clash: list[str], when: str) -> UserError:
    more = f" (and {len(clash) - 1} more: {', '.join(clash[1:])})" if len(clash) > 1 else ""
    return UserError(
        f"{out / clash[0]}{more} is not a file fuselm recorded in {out}/{artifact.MANIFEST} "
        f"({when}), and the new artifact writes that name: converting would replace your file. "
        f"Move it out of {out}, or choose another -o")


def _move_users_files(old: Path, new: Path, owned: Iterable[str]) -> list[str]:
    """Move every entry of `old` that is not in `owned` into `new`; return those that could not
    be moved because `new` holds that name (they stay in `old`)."""
    owned, stuck = set(owned), []
    for entry in sorted(old.iterdir()):
        if entry.name in owned:
            continue
        if os.path.lexists(new / entry.name):
            stuck.append(entry.name)
            continue
        os.replace(entry, new / entry.name)
    return stuck


def recover(out_dir: Path) -> list[str]:
    """Repair what killed conversions onto `out_dir` left behind; return what was done.
    Call it holding OUT_DIR's lock (`prepare` does)."""
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
            stuck = _move_users_files(entry, out, owned_files(entry))
            if stuck:  # never deleted: the folder stays, and the next conversion tries again
                done.append(f"kept {entry.name}: {', '.join(stuck)} also exist in {out}")
                continue
            done.append(f"merged and removed {entry.name}")
        else:
            done.append(f"removed {entry.name}")
        shutil.rmtree(entry, ignore_errors=True)
    return done


@contextlib.contextmanager
def terminate_as_exit() -> Iterator[None]:
    """SIGTERM (`kill`, `timeout`, a service stopping) raises SystemExit(143) while the block
    runs, so a conversion's cleanup (its temp build, scratch folders, the lock) runs as on
    Ctrl-C instead of leaving them for the next conversion onto the same OUT_DIR. Only in the
    main thread and where SIGTERM still has its default action: a host program's handler wins."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL):
        yield
        return

    def stop(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """SIGTERM and SIGINT arriving while the block runs are held and delivered when it ends:
    the swap's renames run to their end, so a signal leaves the old artifact or the new one in
    OUT_DIR, never none. Only in the main thread (where Python runs signal handlers); a handler
    installed from C (getsignal None) is left alone."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = {}
    for signum in (signal.SIGTERM, signal.SIGINT):
        if (handler := signal.getsignal(signum)) is not None:
            previous[signum] = handler
            signal.signal(signum, lambda s, _frame: held.append(s))
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for signum in dict.fromkeys(held):  # each once, to the handler it was meant for
            signal.raise_signal(signum)


@contextlib.contextmanager
def scratch(label: str) -> Iterator[Path]:
    """A temporary folder in the system temp folder, named with this process's id so that a
    conversion killed while it existed leaves something `remove_dead_scratch` can remove."""
    path = Path(tempfile.mkdtemp(prefix=f"fuselm-{label}-{os.getpid()}-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def remove_dead_scratch() -> list[str]:
    """Remove `scratch` folders whose process is dead (our own user's only)."""
    done = []
    with contextlib.suppress(OSError):
        for entry in Path(tempfile.gettempdir()).iterdir():
            m = _SCRATCH.match(entry.name)
            if not m or _alive(int(m.group(2))):
                continue
            with contextlib.suppress(OSError):
                st = entry.lstat()
                if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid():
                    shutil.rmtree(entry)
                    done.append(f"removed {entry}")
    return done


def check_target(out_dir: Path) -> None:
    """Refuse an OUT_DIR that is a file, a mount point, holds a model checkpoint, or holds other
    files but no fuselm artifact (a conversion replaces OUT_DIR as a whole)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"output path {out_dir} exists and is not a directory; choose another -o")
    if not out_dir.is_dir():
        return
    refuse_mount_point(out_dir)
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
    if entries and _manifest_record(out_dir) is None:
        raise UserError(
            f"{out_dir / artifact.MANIFEST} is not a fuselm manifest (no \"format\": "
            f"\"{artifact.FORMAT}\"), so {out_dir} is not a fuselm artifact a conversion may "
            "replace; choose an empty or new directory")


class _Lock:
    """OUT_DIR's advisory lock: `.OUT.lock` beside it, held with flock by one conversion.

    The file is removed on release. A process that opened it just before the removal would
    lock an orphan inode, so after locking, the path must still name the inode we hold."""

    def __init__(self, out: Path) -> None:
        self.path = out.parent / f".{out.name}.lock"
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                os.close(fd)
                raise UserError(
                    f"another fuselm convert (process {holder}) is writing {out}; wait for it to "
                    "finish, or choose another -o") from None
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd: int | None = fd

    def release(self) -> None:
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            self.path.unlink()  # while still held: no one can lock this inode any more
        os.close(self.fd)
        self.fd = None


@dataclass
class Build:
    """One conversion's hold on OUT_DIR: its lock, its temp folder, and which of OUT_DIR's files
    are fuselm's (fingerprinted when `prepare` hashed them)."""

    out: Path
    tmp: Path
    owned: dict[str, Fingerprint] = field(default_factory=dict)
    lock: _Lock | None = None

    def close(self) -> None:
        """Remove what is left of the temp folder and release the lock (after the swap or a
        failure alike)."""
        shutil.rmtree(self.tmp, ignore_errors=True)
        if self.lock is not None:
            self.lock.release()


def prepare(out_dir: Path, writes: Iterable[str] = ARTIFACT_NAMES) -> Build:
    """Check OUT_DIR can be (re)written, lock it, repair leftovers, refuse a user's file whose
    name the new artifact `writes`; return the Build with a fresh temp folder beside OUT_DIR.
    Every check runs under the lock: unlocked, it could see another conversion's swap midway."""
    out = out_dir.resolve()
    above = next((p for p in out.parents if p.exists()), None)
    if above is not None and not above.is_dir():  # mkdir would say only "File exists"
        raise UserError(f"output path {out_dir}: {above} is a file, not a folder; choose "
                        "another -o")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        lock = _Lock(out)
    except OSError as e:
        raise UserError(
            f"output path {out_dir} is not writable ({e.strerror}); choose another -o"
        ) from None
    try:
        check_target(out_dir)
        recover(out)
        remove_dead_scratch()
        check_target(out)  # what recovery restored is checked too
        owned = owned_files(out) if out.is_dir() else {}
        names = {p.name for p in out.iterdir()} if out.is_dir() else set()
        clash = sorted((names - set(owned)) & set(writes))
        if clash:
            raise _clash_error(out, clash, "or it changed since")
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{os.getpid()}-", dir=out.parent))
        tmp.chmod(0o777 & ~_umask())  # mkdtemp makes it private; the artifact is not
    except OSError as e:
        lock.release()
        raise UserError(
            f"output path {out_dir} is not writable ({e.strerror}); choose another -o"
        ) from None
    except BaseException:
        lock.release()
        raise
    return Build(out, tmp, owned, lock)


def swap_in(build: Build) -> None:
    """Make the complete artifact in build.tmp the new OUT_DIR, moving the user's files across.

    A file `prepare` found to be fuselm's but that changed since is the user's now; if the new
    artifact writes its name, nothing is swapped (one error line) and OUT_DIR stays as it was."""
    out, tmp = build.out, build.tmp
    if not out.exists():
        try:
            os.replace(tmp, out)
            return
        except OSError as e:  # OUT appeared meanwhile, with files in it: they are the user's
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
    owned = {n for n, fp in build.owned.items() if _fingerprint(out / n) == fp}
    clash = sorted(p.name for p in out.iterdir()
                   if p.name not in owned and os.path.lexists(tmp / p.name))
    if clash:
        raise _clash_error(out, clash, "it changed during the conversion")
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-{os.getpid()}-", dir=out.parent))
    old.rmdir()  # only the unique name is wanted: rename needs a free target
    with signals_deferred():  # between the two renames OUT is missing: no signal ends us there
        try:
            os.replace(out, old)
        except OSError as e:  # a mount point the mount table did not show (refuse_mount_point)
            if e.errno != errno.EBUSY:
                raise
            raise UserError(f"-o {out} cannot be renamed ({e.strerror}): is it a mount point? "
                            f"Convert into a folder inside it, e.g. -o {out / 'model'}") from None
        try:
            os.replace(tmp, out)
        except BaseException:
            os.replace(old, out)  # put the previous artifact back before reporting the failure
            raise
        stuck = _move_users_files(old, out, owned)
        if not stuck:  # (none can be: names were checked under the lock) else `recover` retries
            shutil.rmtree(old, ignore_errors=True)
