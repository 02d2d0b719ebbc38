"""Nothing valid is ever lost: refused -o paths, re-conversion beside the old artifact, the user's
own files kept, killed conversions repaired, demo and optimize never overwrite a model."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fuselm.converter.models.builtin import build_model
from fuselm.converter.out_dir import prepare, recover
from fuselm.converter.pipeline import ConvertOptions, convert
from fuselm.runtime_metal.artifact import read_manifest
from fuselm.runtime_metal.integrity import verify
from tests.cli_run import cli, one_error


def tree_digest(root: Path) -> dict[str, str]:
    """Every file under root (hidden ones too) -> sha256: 'nothing changed' made checkable."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("safe") / "ckpt", "qwen3", seed=5)


@pytest.fixture(scope="module")
def base(ckpt: Path) -> Path:
    out = ckpt.parent / "base"
    convert(ckpt, out, ConvertOptions(dtype="float32", optimize=False))
    return out


def test_output_is_the_input_with_a_stray_manifest(capsys, ckpt: Path, tmp_path: Path) -> None:  # noqa: ANN001
    model = tmp_path / "model"
    shutil.copytree(ckpt, model)
    (model / "fuselm.json").write_text("{}")  # a stray manifest must not make it "an artifact"
    before = tree_digest(tmp_path)
    line = one_error(*cli(capsys, "convert", str(model), "-o", str(model), "--quiet"))
    assert "input folder itself" in line
    assert tree_digest(tmp_path) == before


def test_output_inside_or_containing_the_input(capsys, ckpt: Path, tmp_path: Path) -> None:  # noqa: ANN001
    outer = tmp_path / "outer"
    model = outer / "model"
    shutil.copytree(ckpt, model)
    (outer / "fuselm.json").write_text("{}")
    before = tree_digest(tmp_path)
    line = one_error(*cli(capsys, "convert", str(model), "-o", str(model / "out"), "--quiet"))
    assert "inside the input folder" in line
    line = one_error(*cli(capsys, "convert", str(model), "-o", str(outer), "--quiet"))
    assert "lies inside -o" in line
    assert tree_digest(tmp_path) == before


def test_output_is_the_current_directory(capsys, ckpt: Path, base: Path, tmp_path: Path,  # noqa: ANN001
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    art = tmp_path / "art"
    shutil.copytree(base, art)
    before = tree_digest(tmp_path)
    monkeypatch.chdir(art)  # `-o .` inside an existing artifact
    line = one_error(*cli(capsys, "convert", str(ckpt), "-o", ".", "--quiet"))
    assert "current directory" in line
    line = one_error(*cli(capsys, "convert", str(ckpt), "-o", str(tmp_path), "--quiet"))
    assert "current directory" in line
    assert tree_digest(tmp_path) == before


def test_reconvert_keeps_the_users_files(capsys, ckpt: Path, base: Path, tmp_path: Path) -> None:  # noqa: ANN001
    out = tmp_path / "out"
    shutil.copytree(base, out)
    (out / "notes.txt").write_text("mine")
    (out / "evals").mkdir()
    (out / "evals" / "run1.json").write_text("{}")
    old_converted = read_manifest(out).source["converted"]
    time.sleep(1.1)  # the manifest's timestamp has one-second resolution
    code, _ = cli(capsys, "convert", str(ckpt), "-o", str(out), "--quiet", "--no-optimize",
                  "--dtype", "float32")
    assert code == 0
    manifest = read_manifest(out)
    assert manifest.source["converted"] != old_converted  # really replaced
    assert verify(out, manifest).ok
    assert (out / "notes.txt").read_text() == "mine"
    assert (out / "evals" / "run1.json").read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no .out.tmp / .out.old left


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_recover_after_a_kill_between_the_two_renames(base: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    pid = _dead_pid()
    aside = tmp_path / f".out.old-{pid}-abc123"
    shutil.copytree(base, aside)  # OUT was renamed aside, the new one never moved in
    (aside / "notes.txt").write_text("mine")
    new = tmp_path / f".out.tmp-{pid}-def456"
    shutil.copytree(base, new)
    want = tree_digest(aside)
    done = recover(out)
    assert tree_digest(out) == want and len(done) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_recover_merges_foreign_files_and_spares_live_or_unknown_folders(
        base: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    shutil.copytree(base, out)
    pid = _dead_pid()
    aside = tmp_path / f".out.old-{pid}-abc123"  # killed while moving the user's files across
    shutil.copytree(base, aside)
    (aside / "notes.txt").write_text("mine")
    live = tmp_path / f".out.tmp-{os.getpid()}-aaaaaa"  # a conversion still running
    live.mkdir()
    unknown = tmp_path / ".out.tmp-zzzzzz"  # no process id: not provably stale
    unknown.mkdir()
    recover(out)
    assert (out / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out", live.name, unknown.name])
    assert verify(out, read_manifest(out)).ok


# A conversion in its own process that stops right before swap_in, the new artifact complete
# in its temp folder beside OUT, and says so: the test then kills it there (no race with a
# build that a small model finishes between two polls of the folder).
HELD_CONVERT = """
import sys, time
from pathlib import Path
from fuselm.converter import out_dir

signal_file = Path(sys.argv[1])

def held(build):
    signal_file.write_text(str(build.tmp))
    time.sleep(600)

out_dir.swap_in = held
from fuselm.converter.cli.main import main
sys.argv = ["fuselm", "convert", *sys.argv[2:]]
main()
"""


def test_kill_during_reconvert_keeps_the_old_artifact(ckpt: Path, base: Path,
                                                      tmp_path: Path) -> None:
    out = tmp_path / "out"
    shutil.copytree(base, out)
    (out / "notes.txt").write_text("mine")
    before = tree_digest(out)
    signal_file = tmp_path.parent / f"{tmp_path.name}.held"
    p = subprocess.Popen([sys.executable, "-c", HELD_CONVERT, str(signal_file), str(ckpt),
                          "-o", str(out), "--quiet", "--dtype", "float32"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and p.poll() is None and not signal_file.exists():
            time.sleep(0.05)
        assert p.poll() is None and signal_file.exists(), "the conversion did not reach the swap"
        held = Path(signal_file.read_text())
        assert held.name.startswith(f".out.tmp-{p.pid}-") and any(held.iterdir())
        os.kill(p.pid, signal.SIGKILL)
    finally:
        p.kill()
        p.wait(timeout=60)
    assert tree_digest(out) == before  # untouched, byte for byte
    assert verify(out, read_manifest(out)).ok
    from fuselm.runtime_metal.engine import make_engine

    assert make_engine(out, "onnxruntime").forward([[1, 2]]).shape == (384,)
    assert list(tmp_path.glob(".out.tmp-*"))  # the killed build's folder and lock file...
    prepare(out).close()  # (what the next conversion does first)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # ...are cleaned next time


def test_demo_never_overwrites(capsys, tmp_path: Path) -> None:  # noqa: ANN001
    f = tmp_path / "file"
    f.write_text("x")
    line = one_error(*cli(capsys, "demo", "-o", str(f)))
    assert "not a directory" in line
    (tmp_path / "d" / "checkpoint").mkdir(parents=True)
    (tmp_path / "d" / "checkpoint" / "config.json").write_text('{"mine": 1}')
    line = one_error(*cli(capsys, "demo", "-o", str(tmp_path / "d")))
    assert "holds no fuselm artifact" in line
    assert json.loads((tmp_path / "d" / "checkpoint" / "config.json").read_text()) == {"mine": 1}


def test_optimize_to_a_directory(capsys, base: Path, tmp_path: Path) -> None:  # noqa: ANN001
    line = one_error(*cli(capsys, "optimize", str(base / "model.onnx"), "-o", str(tmp_path)))
    assert "is a directory" in line


def test_in_place_optimize_commits_with_one_rename(capsys, base: Path, tmp_path: Path) -> None:  # noqa: ANN001
    import onnx

    from fuselm.runtime_metal.integrity import tensor_ranges

    art = tmp_path / "art"
    shutil.copytree(base, art)
    model = art / "model.onnx"
    # an artifact's own model.onnx is refused as -o (its fuselm.json records it): a bare graph
    line = one_error(*cli(capsys, "optimize", str(model), "-o", str(model)))
    assert "part of the fuselm artifact" in line
    (art / "fuselm.json").unlink()
    for expect, gone in (("model.onnx.alt.data", "model.onnx.data"),
                         ("model.onnx.data", "model.onnx.alt.data")):
        code, _ = cli(capsys, "optimize", str(model), "-o", str(model), "--json")
        assert code == 0
        # The new model reads a data file the old model never used, so a kill before the
        # model's rename leaves old model + old data, and after it new model + new data.
        assert set(tensor_ranges(model)) == {expect}
        assert not (art / gone).exists()
        onnx.checker.check_model(str(model), full_check=False)


def _edit_manifest(art: Path, edit) -> None:  # noqa: ANN001
    raw = json.loads((art / "fuselm.json").read_text())
    edit(raw)
    (art / "fuselm.json").write_text(json.dumps(raw))


# Names a conversion may write, that this artifact (a builtin checkpoint's) never wrote: the
# user's, whatever an edited fuselm.json says.
USERS_NAMED_LIKE_OURS = ("merges.txt", "vocab.json", "added_tokens.json",
                         "special_tokens_map.json", "chat_template.json", "raw.onnx",
                         "raw.onnx.data", "notes.txt")


def test_reconvert_never_deletes_a_file_fuselm_did_not_record(ckpt: Path, base: Path,
                                                              tmp_path: Path) -> None:
    out = tmp_path / "out"
    shutil.copytree(base, out)
    for i, name in enumerate(USERS_NAMED_LIKE_OURS):
        (out / name).write_bytes(f"the user's {name} #{i}".encode())
    notes = hashlib.sha256((out / "notes.txt").read_bytes()).hexdigest()

    def claim(raw: dict) -> None:  # an edited manifest claiming the user's files as its own
        raw["files"]["tokenizer"] += list(USERS_NAMED_LIKE_OURS)
        raw["integrity"]["files"]["notes.txt"] = {"size": (out / "notes.txt").stat().st_size,
                                                  "sha256": notes}
        raw["integrity"]["files"]["vocab.json"] = {"size": 1, "sha256": "0" * 64}

    _edit_manifest(out, claim)
    users = {n: (out / n).read_bytes() for n in USERS_NAMED_LIKE_OURS}
    convert(ckpt, out, ConvertOptions(dtype="float32", optimize=False))
    assert {n: (out / n).read_bytes() for n in USERS_NAMED_LIKE_OURS} == users
    assert verify(out, read_manifest(out)).ok
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize("case", ["edited artifact file", "no integrity record"])
def test_reconvert_refuses_to_replace_a_users_file(capsys, ckpt: Path, base: Path,  # noqa: ANN001
                                                  tmp_path: Path, case: str) -> None:
    out = tmp_path / "out"
    shutil.copytree(base, out)
    if case == "edited artifact file":  # recorded once, but no longer what fuselm wrote
        (out / "tokenizer_config.json").write_text('{"the user": "edited this"}')
        name = "tokenizer_config.json"
    else:  # nothing proves any file is fuselm's (an older or foreign manifest)
        _edit_manifest(out, lambda raw: raw.pop("integrity"))
        name = "chat_template.jinja"
    before = tree_digest(tmp_path)
    line = one_error(*cli(capsys, "convert", str(ckpt), "-o", str(out), "--quiet",
                          "--dtype", "float32"))
    assert f"{out / name}" in line and "would replace your file" in line
    assert tree_digest(tmp_path) == before  # nothing written, no temp folder, no lock left


def test_a_folder_whose_fuselm_json_is_not_a_manifest_is_refused(capsys, ckpt: Path,  # noqa: ANN001
                                                                 tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "fuselm.json").write_text('{"files": {"data": "notes.txt"}}')
    (out / "notes.txt").write_text("mine")
    before = tree_digest(tmp_path)
    line = one_error(*cli(capsys, "convert", str(ckpt), "-o", str(out), "--quiet"))
    assert "not a fuselm manifest" in line
    assert tree_digest(tmp_path) == before
