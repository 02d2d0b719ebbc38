"""One default conversion of a test family, reduced to what the pins compare."""

from __future__ import annotations

import collections
import hashlib
from pathlib import Path
from typing import Any

import numpy as np

import fuselm
from fuselm.converter.models.builtin import build_model
from tests.families import TEST_CONFIGS

# every registered family once, with its test quirks (tests/families.py)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "mistral": ("mistral", {"sliding_window": 8}),
    "qwen2": ("qwen2", {"num_key_value_heads": 1}),
    "qwen3": ("qwen3", {}),
    **{f: (f, dict(c)) for f, c in TEST_CONFIGS.items()},
}
PROMPT = [5, 17, 42, 99, 7, 3, 250, 11, 64, 128]


def _logits(model_path: Path) -> np.ndarray:
    import onnx
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(str(model_path), so, providers=["CPUExecutionProvider"])
    model = onnx.load(str(model_path), load_external_data=False)
    feeds: dict[str, np.ndarray] = {}
    n = len(PROMPT)
    for inp in model.graph.input:
        dims = [d.dim_value if d.HasField("dim_value") else None
                for d in inp.type.tensor_type.shape.dim]
        if inp.name == "input_ids":
            feeds[inp.name] = np.array([PROMPT], dtype=np.int64)
        elif inp.name == "attention_mask":
            feeds[inp.name] = np.ones((1, n), dtype=np.int64)
        elif inp.name == "position_ids":
            feeds[inp.name] = np.arange(n, dtype=np.int64)[None]
        else:  # past key/value: empty
            elem = inp.type.tensor_type.elem_type
            dtype = np.float16 if elem == onnx.TensorProto.FLOAT16 else np.float32
            feeds[inp.name] = np.zeros((1, dims[1], 0, dims[3]), dtype=dtype)
    out = sess.run(["logits"], feeds)[0]
    return out.astype(np.float32)


def convert_case(tmp: Path, case: str, quant: str | None) -> tuple[dict[str, int], str,
                                                                   np.ndarray]:
    family, overrides = CASES[case]
    src = tmp / f"hf-{case}"
    if not src.exists():
        build_model(src, family, seed=0, **overrides)
    out = tmp / f"out-{case}-{quant or 'float'}"
    opts: dict[str, Any] = {} if quant is None else {"quant": quant}
    fuselm.convert(src, out, **opts)
    import onnx

    model = onnx.load(str(out / "model.onnx"), load_external_data=False)
    ops = collections.Counter(
        f"{n.domain + '.' if n.domain else ''}{n.op_type}" for n in model.graph.node)
    data = out / "model.onnx.data"
    sha = hashlib.sha256(data.read_bytes()).hexdigest() if data.exists() else ""
    return dict(sorted(ops.items())), sha, _logits(out / "model.onnx")
