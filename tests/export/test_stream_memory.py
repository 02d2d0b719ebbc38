"""Weights stream out in slabs: the exporter never makes a whole cast (or transposed) copy of a
tensor, and what the slabs write is byte for byte what a whole-tensor cast writes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import onnx
import pytest
import torch

from fuselm.export import onnx_export
from fuselm.export.decoder import Decoder
from fuselm.export.registry import decoder_spec
from fuselm.export.safetensors.checkpoint import Checkpoint


def test_slabbed_weights_equal_whole_tensor_export(
        checkpoint: Callable[[str], Path], exported: Callable[..., Path], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 shards cast to float16 (the 8B path): slabs of 3 rows, transposed [K, N] weights
    included, give the same data file and the same references as the session's export."""
    case = "llama-bf16-sharded"
    want = exported(case, None)
    spec = decoder_spec(checkpoint(case))
    with torch.device("meta"):
        module = Decoder(spec, torch.float16)
    model = onnx.ModelProto()
    monkeypatch.setattr(onnx_export, "SLAB_BYTES", 3 * 64 * 4)  # 3 rows of a 64-wide weight
    data = tmp_path / "model.onnx.data"
    onnx_export.write_weights(model, module, Checkpoint(checkpoint(case)), data, torch.float16)
    assert data.read_bytes() == want.with_name(want.name + ".data").read_bytes()
    ref = {t.name: t for t in onnx.load(str(want), load_external_data=False).graph.initializer}
    for t in model.graph.initializer:
        assert t.SerializeToString() == ref[t.name].SerializeToString(), t.name
