"""convert without an intermediate data file (export's weight recipes, wrapped as the passes'
ComputedValues: the passes and the writer read each weight from the checkpoint) writes the very
same artifact, byte for byte, as the path through raw.onnx.data (--keep-intermediate), quantized
or not."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from fuselm.converter.models.builtin import build_model
from fuselm.converter.pipeline import ConvertOptions, convert


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# GQA with head_dim != hidden / heads (bf16 → float16 graph), and a tied head with the norm
# offset (gemma3: weights + 1 computed on the way)
@pytest.mark.parametrize(("family", "dtype", "kw", "quant"), [
    ("qwen3", "bfloat16", {"num_key_value_heads": 1, "head_dim": 48}, "q4"),
    ("gemma3_text", "float32", {}, None),
])
def test_same_artifact_without_the_intermediate_file(  # noqa: PLR0913
        tmp_path: Path, family: str, dtype: str, kw: dict, quant: str | None) -> None:
    src = build_model(tmp_path / "hf", family, dtype=dtype, **kw)
    outs = []
    for keep in (True, False):
        out = tmp_path / f"out-{keep}"
        convert(src, out, ConvertOptions.from_flags(quant=quant, keep_intermediate=keep))
        outs.append(out)
    with_file, in_memory = outs
    assert not (in_memory / "raw.onnx.data").exists()
    for name in ("model.onnx", "model.onnx.data"):
        assert _digest(in_memory / name) == _digest(with_file / name), name
