"""Bad input through the CLI: one clear line on stderr, a non-zero exit, no traceback."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import onnx
import pytest
from onnx import helper

from fuselm.converter.cli.main import main
from tests.runtime.conftest import rehash


def _run(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str]:
    old = sys.argv
    sys.argv = ["fuselm", *args]
    try:
        with pytest.raises(SystemExit) as exc:
            main()
    finally:
        sys.argv = old
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return int(exc.value.code or 0), err


@pytest.fixture()
def artifact_copy(qwen3_artifact: Path, tmp_path: Path) -> Path:
    out = tmp_path / "copy"
    shutil.copytree(qwen3_artifact, out)
    return out


def test_missing_model(capsys, tmp_path: Path) -> None:  # noqa: ANN001
    code, err = _run(capsys, "run", str(tmp_path / "nope"), "--prompt-ids", "1,2")
    assert code != 0 and "error:" in err and "nope" in err


def test_corrupt_model(capsys, artifact_copy: Path) -> None:  # noqa: ANN001
    (artifact_copy / "model.onnx").write_bytes(b"\x00garbage" * 10)
    for engine in ("mlx", "onnxruntime"):
        code, err = _run(capsys, "run", str(artifact_copy), "--prompt-ids", "1,2",
                         "--engine", engine)
        assert code != 0 and "model.onnx" in err


def test_external_data_outside_model_dir(capsys, artifact_copy: Path) -> None:  # noqa: ANN001
    model = onnx.load(str(artifact_copy / "model.onnx"), load_external_data=False)
    for t in model.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = "../../etc/passwd"
    onnx.save(model, str(artifact_copy / "model.onnx"))
    rehash(artifact_copy)  # the loader's own check, not the graph hash, is under test
    code, err = _run(capsys, "run", str(artifact_copy), "--prompt-ids", "1,2", "--engine", "mlx")
    assert code != 0 and "outside the model folder" in err


def test_prompt_longer_than_context(capsys, qwen3_artifact: Path) -> None:  # noqa: ANN001
    ids = ",".join(["5"] * 600)  # the tiny models' context is 512
    code, err = _run(capsys, "run", str(qwen3_artifact), "--prompt-ids", ids, "--engine", "mlx")
    assert code != 0 and "context" in err


def test_unknown_op(capsys, artifact_copy: Path) -> None:  # noqa: ANN001
    model = onnx.load(str(artifact_copy / "model.onnx"), load_external_data=False)
    node = next(n for n in model.graph.node if n.op_type == "Sigmoid" or n.op_type == "Gather")
    node.op_type, node.domain = "Frobnicate", "acme"
    model.opset_import.append(helper.make_opsetid("acme", 1))
    onnx.save(model, str(artifact_copy / "model.onnx"))
    rehash(artifact_copy)  # a graph recorded as the artifact's own: the op registry answers
    code, err = _run(capsys, "run", str(artifact_copy), "--prompt-ids", "1,2", "--engine", "mlx")
    assert code != 0 and "acme::Frobnicate" in err and "opset 1" in err


def test_run_json_stdout_is_one_object(capsys, qwen3_artifact: Path) -> None:  # noqa: ANN001
    import json

    old = sys.argv
    sys.argv = ["fuselm", "run", str(qwen3_artifact), "--prompt", "Hello world", "-n", "5",
                "--engine", "mlx", "--json", "--profile"]
    try:
        main()
    except SystemExit as e:
        assert not e.code
    finally:
        sys.argv = old
    out = json.loads(capsys.readouterr().out)
    assert set(out) >= {"tokens", "text", "pp", "tg"} and out["profile"]


def test_bad_kernel_mode(capsys, qwen3_artifact: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("FUSELM_KERNELS", "fastest")
    code, err = _run(capsys, "run", str(qwen3_artifact), "--prompt-ids", "1,2", "--engine", "mlx")
    assert code == 2 and err.count("error:") == 1 and "FUSELM_KERNELS" in err and "auto" in err
