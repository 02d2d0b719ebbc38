"""Bad input: one clear line on stderr, exit code 2, no traceback, nothing half-written."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fuselm.converter.models.builtin import build_model


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("good"), "qwen3", tokenizer=False)


def fuselm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fuselm.converter.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def _broken(good: Path, tmp_path: Path, edit) -> Path:  # noqa: ANN001
    model = tmp_path / "model"
    shutil.copytree(good, model)
    edit(model)
    return model


def _edit_config(**changes):  # noqa: ANN202
    def edit(model: Path) -> None:
        cfg = json.loads((model / "config.json").read_text())
        for k, v in changes.items():
            if v is None:
                cfg.pop(k)
            else:
                cfg[k] = v
        (model / "config.json").write_text(json.dumps(cfg))

    return edit


def _truncate(model: Path) -> None:
    f = model / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _pickle_only(model: Path) -> None:
    (model / "model.safetensors").unlink()
    (model / "pytorch_model.bin").write_bytes(b"\x80\x04not really loaded")


def _drop_tensor(model: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(model / "model.safetensors")
    tensors.pop("model.layers.1.mlp.up_proj.weight")
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})


CASES = {
    "unknown architecture": (
        _edit_config(architectures=["GPT2LMHeadModel"]),
        ["not supported", "LlamaForCausalLM", "Qwen3ForCausalLM", "Gemma3ForCausalLM",
         "Phi3ForCausalLM"],
    ),
    "unsupported activation": (
        _edit_config(hidden_act="relu"),
        ["hidden_act 'relu' is not supported", "silu", "gelu_pytorch_tanh"],
    ),
    "missing config key": (
        _edit_config(hidden_size=None),
        ["missing required keys", "hidden_size"],
    ),
    "no weights": (lambda m: (m / "model.safetensors").unlink(), ["no *.safetensors"]),
    "truncated weights": (_truncate, ["truncated"]),
    "pickle only": (_pickle_only, ["pickle", "never unpickles", "safetensors"]),
    "missing tensor": (_drop_tensor, ["up_proj", "missing"]),
    "missing config": (lambda m: (m / "config.json").unlink(), ["config.json not found"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_checkpoint(case: str, good: Path, tmp_path: Path) -> None:
    edit, needles = CASES[case]
    model = _broken(good, tmp_path, edit)
    out = tmp_path / "out"
    r = fuselm("convert", str(model), "-o", str(out), "--no-optimize", "--quiet")
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for needle in needles:
        assert needle in lines[0]
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # no temp folders left behind


def test_output_not_writable(good: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for out in (blocker / "out", blocker / "a" / "out"):
        r = fuselm("convert", str(good), "-o", str(out), "--no-optimize", "--quiet")
        assert r.returncode == 2 and "Traceback" not in r.stderr
        # the file in the way is named, not mkdir's bare "File exists"
        assert f"{blocker} is a file, not a folder" in r.stderr, r.stderr
    assert blocker.read_text() == "x"


def test_refuses_non_empty_foreign_output_dir(good: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    r = fuselm("convert", str(good), "-o", str(out), "--no-optimize", "--quiet")
    assert r.returncode == 2 and "not empty" in r.stderr
    assert (out / "precious.txt").read_text() == "keep me"


def test_bad_block_size(good: Path, tmp_path: Path) -> None:
    r = fuselm(
        "convert", str(good), "-o", str(tmp_path / "o"), "--quant", "q4", "--block-size", "48"
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "32, 64, 128" in r.stderr


def test_inspect_not_onnx(tmp_path: Path) -> None:
    bad = tmp_path / "x.onnx"
    bad.write_bytes(b"garbage")
    r = fuselm("inspect", str(bad))
    assert r.returncode == 2 and "not a readable ONNX model" in r.stderr
