"""OUT_DIR's lock and leftovers, and the write failures a conversion meets at the end: two
conversions into one -o (the second refused, never a crash), a killed GGUF conversion's folders
removed by the next conversion, a full disk during a re-conversion, and -o a mount point."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from fuselm.converter.errors import UserError
from fuselm.converter.models.builtin import build_model
from fuselm.converter.out_dir import prepare, swap_in
from fuselm.converter.pipeline import ConvertOptions, convert
from fuselm.runtime_metal.artifact import read_manifest
from fuselm.runtime_metal.integrity import verify
from tests.cli_run import cli, one_error
from tests.export.test_safe_output import tree_digest


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("lock") / "ckpt", "qwen3", seed=7)


@pytest.fixture(scope="module")
def base(ckpt: Path) -> Path:
    out = ckpt.parent / "base"
    convert(ckpt, out, ConvertOptions(dtype="float32", optimize=False))
    return out


def test_a_second_conversion_into_a_locked_output_is_refused(capsys, ckpt: Path,  # noqa: ANN001
                                                              tmp_path: Path) -> None:
    out = tmp_path / "out"
    build = prepare(out)
    try:
        with pytest.raises(UserError, match=f"another fuselm convert \\(process {os.getpid()}\\)"):
            prepare(out)
        line = one_error(*cli(capsys, "convert", str(ckpt), "-o", str(out), "--quiet"))
        assert "is writing" in line and "choose another -o" in line
    finally:
        build.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # temp folder and lock file gone


# One process's rounds of the library's build-and-swap into one OUT: write a small artifact
# (fuselm.json with integrity records) into the temp folder, swap it in. Prints the outcomes.
_ROUNDS = """
import collections, json, sys
from pathlib import Path
from fuselm.converter.errors import UserError
from fuselm.converter.out_dir import prepare, swap_in
from fuselm.runtime_metal import integrity

out, rounds, tag = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
seen = collections.Counter()
for i in range(rounds):
    try:
        build = prepare(out)
    except UserError as e:
        seen["refused" if "another fuselm convert" in str(e) else str(e)] += 1
        continue
    try:
        (build.tmp / "model.onnx.data").write_bytes(f"{tag} {i}".encode() * 4096)
        raw = {"format": "fuselm", "integrity": integrity.record(build.tmp, ["model.onnx.data"])}
        (build.tmp / "fuselm.json").write_text(json.dumps(raw))
        swap_in(build)
        seen["swapped"] += 1
    finally:
        build.close()
print(json.dumps(seen))
"""


def test_two_processes_swapping_into_one_output(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "fuselm.json").write_text('{"format": "fuselm"}')
    (out / "notes.txt").write_text("mine")
    procs = [subprocess.Popen([sys.executable, "-c", _ROUNDS, str(out), "20", tag],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for tag in "ab"]
    results = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=120)
        assert p.returncode == 0 and not stderr.strip(), stderr  # no FileNotFoundError
        results.append(json.loads(stdout))
    assert all(set(r) <= {"swapped", "refused"} for r in results), results
    # Every round either swapped or was refused (how many of each depends on how the two
    # processes interleave, so only "some swapped" is certain), and the swapped-in data is
    # one round's whole.
    assert sum(r.get("swapped", 0) for r in results) >= 1
    assert sum(sum(r.values()) for r in results) == 40
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no .out.tmp/.old/.lock
    assert sorted(p.name for p in out.iterdir()) == ["fuselm.json", "model.onnx.data",
                                                     "notes.txt"]
    assert (out / "notes.txt").read_text() == "mine"
    data = (out / "model.onnx.data").read_bytes()  # one round's data, whole
    assert any(data == f"{tag} {i}".encode() * 4096 for tag in "ab" for i in range(20))


def _held_gguf_conversion(tmp_path: Path) -> tuple[subprocess.Popen, Path, Path]:
    """A tiny GGUF's conversion in a process of its own, held just before its swap (test_safe_
    output.HELD_CONVERT), its system temp folder `scratch`: (the process, its -o, that folder).
    Its stderr is a pipe (text)."""
    from tests.export.gguf_files import write_gguf
    from tests.export.test_safe_output import HELD_CONVERT

    gguf, _ = write_gguf(tmp_path / "src" / "tiny.gguf", "llama", {})
    scratch_root = tmp_path / "scratch"  # the system temp folder, for both processes
    scratch_root.mkdir()
    out = tmp_path / "art" / "out"
    signal_file = tmp_path / "held"
    p = subprocess.Popen([sys.executable, "-c", HELD_CONVERT, str(signal_file), str(gguf),
                          "-o", str(out), "--quiet"],
                         env={**os.environ, "TMPDIR": str(scratch_root)},
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and p.poll() is None and not signal_file.exists():
        time.sleep(0.05)
    if p.poll() is not None or not signal_file.exists():
        p.kill()
        _, err = p.communicate(timeout=60)
        pytest.fail(f"the conversion did not reach the swap: {err}")
    return p, out, scratch_root


def test_killed_gguf_conversion_leaves_nothing_the_next_one_keeps(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch
                                                                  ) -> None:
    p, out, scratch_root = _held_gguf_conversion(tmp_path)
    try:
        os.kill(p.pid, signal.SIGKILL)
    finally:
        p.kill()
        p.communicate(timeout=60)
    staged = list(scratch_root.iterdir())
    assert [s.name.startswith(f"fuselm-gguf-{p.pid}-") for s in staged] == [True]
    assert any(staged[0].iterdir())  # the staged metadata and tokenizer files
    left = sorted(x.name for x in out.parent.iterdir())  # the build and the lock file
    assert left[0] == ".out.lock" and left[1].startswith(f".out.tmp-{p.pid}-") and len(left) == 2
    monkeypatch.setattr(tempfile, "tempdir", str(scratch_root))
    other = tmp_path / "elsewhere" / "out"
    prepare(other).close()  # any conversion removes a dead process's scratch folder...
    assert list(scratch_root.iterdir()) == []
    prepare(out).close()  # ...and the next one into the same -o its temp build
    assert list(out.parent.iterdir()) == []


def test_terminated_gguf_conversion_removes_its_folders_and_lock(tmp_path: Path) -> None:
    """SIGTERM (kill, timeout, a service stopping) ends a conversion as Ctrl-C does: its temp
    build, its staged GGUF metadata and the lock go at once, not at the next conversion onto
    the same -o (a model-sized hidden folder until then)."""
    p, out, scratch_root = _held_gguf_conversion(tmp_path)
    try:
        p.terminate()
        _, err = p.communicate(timeout=60)
    finally:
        p.kill()
        p.wait(timeout=60)
    assert p.returncode == 128 + signal.SIGTERM and "Traceback" not in err, err
    assert list(scratch_root.iterdir()) == [] and list(out.parent.iterdir()) == []


def _namespace_mounts() -> bool:
    """Whether this process may mount a tmpfs in a private mount namespace (root, unshare)."""
    if not shutil.which("unshare") or not shutil.which("mount"):
        return False
    probe = subprocess.run(["unshare", "-m", "sh", "-c",
                            "mount -t tmpfs -o size=64k tmpfs /mnt 2>/dev/null"], check=False)
    return probe.returncode == 0


needs_mounts = pytest.mark.skipif(not _namespace_mounts(),
                                  reason="mounting a tmpfs needs a private mount namespace")

# Run inside `unshare -m` (the mounts vanish with the process): lay out a scenario on real
# mounts, run `fuselm convert` there, report the outcome as JSON.
_IN_NAMESPACE = """
import contextlib, hashlib, io, json, os, shutil, subprocess, sys, time
from pathlib import Path
from fuselm.converter.cli.main import main

scenario, ckpt, base, d = sys.argv[1], sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4])

def tree(root):
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}

def run(out):  # `fuselm convert` in this process (one import for every case)
    t, err, code = time.monotonic(), io.StringIO(), 0
    sys.argv = ["fuselm", "convert", ckpt, "-o", str(out), "--quiet", "--dtype", "float32",
                "--no-optimize"]
    with contextlib.redirect_stderr(err):
        try:
            main()
        except SystemExit as e:
            code = int(e.code or 0)
    return {"code": code, "err": err.getvalue(), "seconds": time.monotonic() - t}

def mount(*args):
    subprocess.run(["mount", *args], check=True)

d.mkdir(parents=True)
if scenario == "disk full":
    size = sum(p.stat().st_size for p in base.iterdir())
    mount("-t", "tmpfs", "-o", f"size={size + size // 2}", "tmpfs", str(d))
    shutil.copytree(base, d / "out")
    (d / "out" / "notes.txt").write_text("mine")
    before = tree(d / "out")
    result = run(d / "out")
    result["kept"] = tree(d / "out") == before
else:
    (d / "out").mkdir()
    mount("-t", "tmpfs", "-o", "size=64m", "tmpfs", str(d / "out"))
    (d / "src").mkdir()
    (d / "bound").mkdir()
    mount("--bind", str(d / "src"), str(d / "bound"))  # same file system: st_dev alike
    result = {"tmpfs": run(d / "out"), "bind": run(d / "bound"),
              "inside": run(d / "out" / "model")}
    result["inside"]["files"] = sorted(os.listdir(d / "out" / "model"))
result["left"] = sorted(os.listdir(d))
print(json.dumps(result))
"""


def _in_namespace(scenario: str, ckpt: Path, base: Path, tmp_path: Path) -> dict:
    r = subprocess.run(["unshare", "-m", sys.executable, "-c", _IN_NAMESPACE, scenario,
                        str(ckpt), str(base), str(tmp_path / "d")],
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


@needs_mounts
def test_disk_full_during_reconvert(ckpt: Path, base: Path, tmp_path: Path) -> None:
    """A real full file system: a tmpfs that holds the old artifact and half of another."""
    result = _in_namespace("disk full", ckpt, base, tmp_path)
    assert result["code"] == 2 and "disk is full" in _one_line(result["err"])
    assert "No space left on device" in result["err"]
    assert result["kept"]  # the old artifact and the user's file, byte for byte
    assert result["left"] == ["out"]  # no temp build, no lock file


# A file size limit (RLIMIT_FSIZE, EFBIG) is a real kernel refusal too, and needs no root.
_FSIZE_CONVERT = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
limit = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
from fuselm.converter.cli.main import main
sys.argv = ["fuselm", "convert", *sys.argv[2:]]
main()
"""


def test_file_size_limit_during_reconvert(ckpt: Path, base: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    shutil.copytree(base, out)
    (out / "notes.txt").write_text("mine")
    before = tree_digest(tmp_path)
    limit = (base / "model.onnx.data").stat().st_size // 2
    r = subprocess.run([sys.executable, "-c", _FSIZE_CONVERT, str(limit), str(ckpt), "-o",
                        str(out), "--quiet", "--dtype", "float32", "--no-optimize"],
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 2 and "disk is full (File too large" in _one_line(r.stderr)
    assert tree_digest(tmp_path) == before  # old artifact kept, nothing left beside it
    assert verify(out, read_manifest(out)).ok


@needs_mounts
def test_output_a_mount_point_is_refused_before_the_conversion(ckpt: Path, base: Path,
                                                               tmp_path: Path) -> None:
    result = _in_namespace("mount point", ckpt, base, tmp_path)
    for case in ("tmpfs", "bind"):
        line = _one_line(result[case]["err"])
        assert result[case]["code"] == 2 and "is a mount point" in line, case
        assert "cannot be renamed" in line and "/model" in line  # the fix, named
    assert result["inside"]["code"] == 0, result["inside"]["err"]  # the fix works
    assert "model.onnx" in result["inside"]["files"]
    assert sorted(result["left"]) == ["bound", "out", "src"]  # no temp build was started


def test_output_created_during_the_conversion_keeps_its_files(tmp_path: Path) -> None:
    out = tmp_path / "out"
    build = prepare(out)  # OUT does not exist yet...
    try:
        (build.tmp / "model.onnx.data").write_bytes(b"weights")
        (build.tmp / "fuselm.json").write_text('{"format": "fuselm"}')
        out.mkdir()  # ...and the user makes it, with a file, before the swap
        (out / "notes.txt").write_text("mine")
        swap_in(build)
    finally:
        build.close()
    assert sorted(p.name for p in out.iterdir()) == ["fuselm.json", "model.onnx.data",
                                                     "notes.txt"]
    assert (out / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# A re-conversion's swap in its own process, with a signal sent to itself from inside the
# swap's window: right after the first rename (OUT set aside, the new artifact not yet in).
SIGNAL_IN_SWAP = """
import os, signal, sys
from pathlib import Path
from fuselm.converter.out_dir import prepare, swap_in, terminate_as_exit

out, signum = Path(sys.argv[1]), int(sys.argv[2])
out.mkdir()
(out / "fuselm.json").write_text('{"format": "fuselm", "old": true}')
real_replace = os.replace

def replace_then_signal(src, dst):
    real_replace(src, dst)
    if Path(src) == out.resolve():
        os.kill(os.getpid(), signum)

with terminate_as_exit():
    build = prepare(out)
    try:
        (build.tmp / "fuselm.json").write_text('{"format": "fuselm", "new": true}')
        os.replace = replace_then_signal
        swap_in(build)
    finally:
        os.replace = real_replace
        build.close()
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_inside_the_swap_leaves_the_new_artifact(tmp_path: Path, signum: int) -> None:
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-c", SIGNAL_IN_SWAP, str(out), str(int(signum))],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0, "the signal was lost"  # it still ends the process, after the swap
    assert json.loads((out / "fuselm.json").read_text()).get("new"), p.stderr
    assert sorted(x.name for x in tmp_path.iterdir()) == ["out"]  # no old, tmp or lock left
