"""`fuselm validate` gives a verdict: PASS exits 0, NaN fails, mismatched models are refused
before any compute."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from fuselm.converter.models.builtin import build_model
from tests.ux.conftest import cli


def test_good_artifact_passes(hf_dir: Path, artifact: Path) -> None:
    r = cli("validate", str(hf_dir), str(artifact), "-n", "4", "--prompt", "Hello world")
    assert r.returncode == 0, r.stderr
    assert "[1/1] 'Hello world'" in r.stdout  # progress per prompt, the prompt shown
    assert "MLX rung skipped" in r.stdout or "mlx " in r.stdout
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("onnxruntime"))
    assert "PASS: rel" in line and "<= 0.0001 (float32)" in line
    assert r.stdout.rstrip().endswith("verdict: PASS")


def test_nan_artifact_fails(hf_dir: Path, artifact: Path, tmp_path: Path) -> None:
    broken = tmp_path / "nan"
    shutil.copytree(artifact, broken)
    data = np.memmap(broken / "model.onnx.data", dtype=np.float32, mode="r+")
    data[::97] = np.nan  # a NaN in every weight tensor
    data.flush()
    del data
    r = cli("validate", str(hf_dir), str(broken), "-n", "2", "--json")
    assert r.returncode == 1, r.stderr
    out = json.loads(r.stdout)
    assert out["verdicts"]["onnxruntime"] == {"status": "FAIL",
                                              "reason": "NaN/Inf in the logits"}
    assert "verdict: FAIL" in r.stderr


def test_another_model_is_refused_before_compute(artifact: Path, tmp_path: Path) -> None:
    other = build_model(tmp_path / "llama", "llama", seed=1, tokenizer=False)
    r = cli("validate", str(other), str(artifact))
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("error: the checkpoint and the artifact are different models")
    assert "architecture: LlamaForCausalLM" in r.stderr and "Traceback" not in r.stderr


def test_different_vocabulary_is_a_clear_error(artifact: Path, tmp_path: Path) -> None:
    other = build_model(tmp_path / "v", "qwen3", seed=3, tokenizer=False, vocab_size=512,
                        max_position_embeddings=4096)
    r = cli("validate", str(other), str(artifact))
    assert r.returncode == 2, r.stderr
    assert "different vocabularies (vocab_size: 512" in r.stderr and "384" in r.stderr


def test_thresholds_per_precision() -> None:
    from fuselm.runtime_metal.verdict import judge, precision

    assert precision("float32", None) == "float32" and precision("float16", {"bits": 4}) == "q4"
    assert judge([5e-5], [False], "float32").status == "PASS"
    assert judge([5e-4], [False], "float32").status == "WARN"
    assert judge([5e-4], [False], "float16").status == "PASS"
    assert judge([0.1], [False], "float16").status == "FAIL"
    assert precision("bfloat16", None) == "bfloat16"  # 8x float16's step: its own bound
    assert judge([1.5e-2], [False], "bfloat16").status == "PASS"
    assert judge([1.5e-2], [False], "float16").status == "WARN"
    assert judge([0.1], [False], "q4").status == "PASS"
    assert judge([1e-9], [True], "q4").status == "FAIL"  # NaN/Inf anywhere fails
    assert judge([float("nan")], [False], "float32").status == "FAIL"
    # Q4 with the PPL measured: judged on its increase (SmolLM2's default Q4: rel 0.6, +14.6 %)
    assert judge([0.6], [False], "q4", 0.146).status == "PASS"
    assert judge([0.6], [False], "q4", 0.386).status == "WARN"
    assert judge([0.1], [False], "q4", 0.6).status == "FAIL"
    assert judge([0.1], [False], "q4", float("nan")).status == "FAIL"
    assert judge([0.6], [True], "q4", 0.0).status == "FAIL"
    assert judge([5e-4], [False], "float16", 0.9).status == "PASS"  # PPL judges Q4 only


def test_mlx_on_cpu_warning_names_speed_and_alternative() -> None:
    from fuselm.converter.models.builtin import QWEN3_0_6B
    from fuselm.runtime_metal.artifact import ModelInfo
    from fuselm.runtime_metal.model_size import mlx_cpu_warning, parameter_count

    def info(shape: dict) -> ModelInfo:
        return ModelInfo("Qwen3ForCausalLM", "qwen3", shape["hidden_size"],
                         shape["num_hidden_layers"], shape["num_attention_heads"],
                         shape["num_key_value_heads"], shape["head_dim"],
                         shape["intermediate_size"], shape["vocab_size"], 1e-6,
                         shape.get("tie_word_embeddings", False), 4096)

    big = info(QWEN3_0_6B)
    assert 0.5e9 < parameter_count(big) < 0.7e9  # Qwen3-0.6B
    message = mlx_cpu_warning(big)
    assert message and "tokens/s" in message and "--engine onnxruntime" in message
    from fuselm.converter.models.builtin import TINY

    assert mlx_cpu_warning(info(TINY)) is None


def test_ppl_flags_with_no_ppl_are_refused(hf_dir: Path, artifact: Path,
                                           tmp_path: Path) -> None:
    """--text and --context set the PPL phase: with --no-ppl, which skips it, they are refused
    by name before any compute, not taken and dropped."""
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    for flag in (["--text", str(text)], ["--context", "64"]):
        r = cli("validate", str(hf_dir), str(artifact), "--no-ppl", *flag)
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert r.returncode == 2 and len(lines) == 1 and flag[0] in lines[0] \
            and "--no-ppl" in lines[0], r.stderr
        assert "validating" not in r.stdout
