"""Artifact integrity and fuselm.json's schema: hashes, sizes, typed fields, graph agreement.

Every bad case ends in one `error:` line and exit code 2 (the CLI's user-error path), on both
engines where the engine matters.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from fuselm.runtime_metal.integrity import tensor_ranges
from tests.cli_run import cli, one_error
from tests.runtime.conftest import edit_manifest

ENGINES = ("mlx", "onnxruntime")




def test_verify_ok(capsys, art: Path) -> None:  # noqa: ANN001
    code, err = cli(capsys, "verify", str(art))
    assert code == 0 and err.startswith("ok: ")
    code, _ = cli(capsys, "run", str(art), "--prompt-ids", "1,2", "-n", "2", "--verify",
                  "--engine", "onnxruntime")
    assert code == 0


def test_random_bytes_of_the_right_size_caught_by_verify(capsys, art: Path) -> None:  # noqa: ANN001
    data = art / "model.onnx.data"
    data.write_bytes(np.random.default_rng(0).bytes(data.stat().st_size))
    first = tensor_ranges(art / "model.onnx")["model.onnx.data"][0][2]
    line = one_error(*cli(capsys, "verify", str(art)))
    assert "model.onnx.data" in line and f"tensor {first!r}" in line
    line = one_error(*cli(capsys, "run", str(art), "--prompt-ids", "1,2", "--verify"))
    assert "failed verification" in line


def test_verify_names_the_damaged_tensor(capsys, art: Path) -> None:  # noqa: ANN001
    spans = tensor_ranges(art / "model.onnx")["model.onnx.data"]
    offset, length, name = spans[len(spans) // 2]
    with (art / "model.onnx.data").open("r+b") as f:
        f.seek(offset + length - 1)
        byte = f.read(1)
        f.seek(offset + length - 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    line = one_error(*cli(capsys, "verify", str(art)))
    assert f"tensor {name!r}" in line and f"bytes {offset}..{offset + length}" in line


def test_verify_without_hashes(capsys, art: Path) -> None:  # noqa: ANN001
    edit_manifest(art, lambda raw: raw.pop("integrity"))
    line = one_error(*cli(capsys, "verify", str(art)))
    assert "records no file hashes" in line


@pytest.mark.parametrize("engine", ENGINES)
def test_zero_byte_data_file(capsys, art: Path, engine: str) -> None:  # noqa: ANN001
    (art / "model.onnx.data").write_bytes(b"")
    line = one_error(*cli(capsys, "run", str(art), "--prompt-ids", "1,2", "--engine", engine))
    assert "model.onnx.data" in line and "empty" in line
    edit_manifest(art, lambda raw: raw.pop("integrity"))  # an artifact without a record
    line = one_error(*cli(capsys, "run", str(art), "--prompt-ids", "1,2", "--engine", engine))
    assert "model.onnx.data" in line and "empty" in line


@pytest.mark.parametrize("engine", ENGINES)
def test_truncated_data_file_caught_at_load(capsys, art: Path, engine: str) -> None:  # noqa: ANN001
    data = art / "model.onnx.data"
    data.write_bytes(data.read_bytes()[:-64])
    line = one_error(*cli(capsys, "run", str(art), "--prompt-ids", "1,2", "--engine", engine))
    assert "model.onnx.data" in line and "fuselm.json records" in line


def _set(path: str, value: object):  # noqa: ANN202
    def edit(raw: dict) -> None:
        *parents, last = path.split(".")
        node = raw
        for p in parents:
            node = node[p]
        node[last] = value

    return edit


SCHEMA_CASES = {
    "kv heads as a string": ("model.num_kv_heads", "2", "model.num_kv_heads", "'2'"),
    "kv heads not dividing heads": ("model.num_kv_heads", 3, "model.num_kv_heads", "divisor"),
    "head_dim zero": ("model.head_dim", 0, "model.head_dim", ">= 1"),
    "head_dim a float": ("model.head_dim", 24.5, "model.head_dim", "an integer"),
    "dtype unknown": ("dtype", "bfloat8", "dtype", "float32 or float16"),
    "eos as a string": ("special_tokens.eos", "2", "special_tokens.eos", "'2'"),
    "bos as a list": ("special_tokens.bos", [1, 2], "special_tokens.bos", "null or an integer"),
    "eos outside vocab": ("special_tokens.eos", [10**6], "special_tokens.eos", "[0, 384)"),
    "format_version a string": ("format_version", "1", "format_version", "the integer 1"),
    "layers negative": ("model.num_layers", -1, "model.num_layers", ">= 1"),
    "eps a string": ("model.rms_norm_eps", "1e-6", "model.rms_norm_eps", "a number"),
    "model a list": ("model", [], "model", "an object"),
    "tied as an int": ("model.tie_word_embeddings", 1, "tie_word_embeddings", "true/false"),
    "bad digest": ("integrity.files.model.onnx.data", {"size": 1, "sha256": "x"}, "sha256",
                   "64 lowercase hex"),
}


@pytest.mark.parametrize("case", list(SCHEMA_CASES))
def test_manifest_field_errors(capsys, art: Path, case: str) -> None:  # noqa: ANN001
    field, value, needle, allowed = SCHEMA_CASES[case]
    if field.startswith("integrity.files."):
        edit_manifest(art, lambda raw: raw["integrity"]["files"].__setitem__(
            "model.onnx.data", value))
    else:
        edit_manifest(art, _set(field, value))
    line = one_error(*cli(capsys, "run", str(art), "--prompt-ids", "1,2",
                          "--engine", "onnxruntime"))
    assert needle in line and allowed in line and "fuselm.json" in line


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(("field", "value"), [("num_kv_heads", 1), ("head_dim", 16),
                                              ("num_layers", 3)])
def test_manifest_disagrees_with_graph(capsys, art: Path, engine: str, field: str,  # noqa: ANN001
                                       value: int) -> None:
    edit_manifest(art, _set(f"model.{field}", value))
    if field == "head_dim":
        edit_manifest(art, _set("rope.rotary_dim", value))
    line = one_error(*cli(capsys, "run", str(art), "--prompt-ids", "1,2", "--engine", engine))
    assert f"model.{field} = {value}" in line and "model.onnx" in line


@pytest.mark.parametrize("engine", ENGINES)
def test_manifest_dtype_disagrees_with_graph(capsys, art: Path, engine: str) -> None:  # noqa: ANN001
    edit_manifest(art, _set("dtype", "float16"))
    line = one_error(*cli(capsys, "run", str(art), "--prompt-ids", "1,2", "--engine", engine))
    assert "dtype = float16" in line and "float32" in line


def test_one_pass_digests_match_direct_ones(art: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The single-read digests equal the SHA-256 of the file and the CRC-32 of each slice, also
    when tensors straddle read chunks (a 1000-byte chunk here)."""
    import hashlib
    import zlib

    from fuselm.runtime_metal import integrity

    data = (art / "model.onnx.data").read_bytes()
    spans = tensor_ranges(art / "model.onnx")["model.onnx.data"]
    monkeypatch.setattr(integrity, "CHUNK", 1000)
    sha, crcs = integrity.digests(art / "model.onnx.data", spans)
    assert sha == hashlib.sha256(data).hexdigest()
    assert crcs == {n: f"{zlib.crc32(data[o:o + n_]):08x}" for o, n_, n in spans}


@pytest.fixture()
def outside(tmp_path: Path) -> Path:
    secret = tmp_path / "secret.data"
    secret.write_bytes(b"s" * 12345)  # a size that must never appear in an error
    return secret


def _record(name: str):  # noqa: ANN202
    return lambda raw: raw["integrity"]["files"].__setitem__(name, {"size": 1,
                                                                    "sha256": "0" * 64})


PATH_CASES = {
    "absolute in integrity.files": (lambda art, out: _record(str(out)), "integrity.files"),
    "dot-dot in integrity.files": (lambda art, out: _record("../secret.data"), "integrity.files"),
    "dot-dot in integrity.tensors": (
        lambda art, out: lambda raw: raw["integrity"]["tensors"].__setitem__("../secret.data",
                                                                           {}),
        "integrity.tensors"),
    "dot-dot in files.data": (lambda art, out: _set("files.data", "../secret.data"),
                              "files.data"),
    "absolute in files.tokenizer": (
        lambda art, out: _set("files.tokenizer", [str(out)]), "files.tokenizer"),
}


@pytest.mark.parametrize("command", ["verify", "run"])
@pytest.mark.parametrize("case", list(PATH_CASES))
def test_manifest_paths_outside_the_artifact_refused(capsys, art: Path, outside: Path,  # noqa: ANN001
                                                     case: str, command: str) -> None:
    make, field = PATH_CASES[case]
    edit_manifest(art, make(art, outside))
    args = ["--prompt-ids", "1,2", "-n", "2", "--engine", "onnxruntime"] if command == "run" \
        else []
    line = one_error(*cli(capsys, command, str(art), *args))
    assert field in line and "relative path inside the artifact folder" in line
    assert "12345" not in line


@pytest.mark.parametrize("command", ["verify", "run"])
def test_symlink_leading_out_of_the_artifact_refused(capsys, art: Path, outside: Path,  # noqa: ANN001
                                                     command: str) -> None:
    """A name that passes as text but is a symlink out: refused before it is stat-ed."""
    shutil.copy(art / "model.onnx.data", outside)  # the right bytes, but outside the folder
    (art / "model.onnx.data").unlink()
    (art / "model.onnx.data").symlink_to(outside)
    args = ["--prompt-ids", "1,2", "-n", "2", "--engine", "onnxruntime"] if command == "run" \
        else []
    line = one_error(*cli(capsys, command, str(art), *args))
    assert "'model.onnx.data'" in line and "symlink" in line and "refuses it" in line
