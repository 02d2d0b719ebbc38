"""8-bit weights (`--quant q8` / `--q-bits 8`): uint8 blocks that both engines run — MLX as its
8-bit quantized matmul on the same values, onnxruntime as MatMulNBits — close to the float
model, with a tied table and a fused projection with bias among them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fuselm.converter.models.builtin import build_model
from fuselm.runtime_metal.artifact import read_manifest
from fuselm.runtime_metal.engine import make_engine
from fuselm.runtime_metal.mlx_engine.qweight import QWeight
from fuselm.runtime_metal.validate import engine_logits, rel
from tests.runtime.conftest import convert

# qwen3: tied embedding / LM head; qwen2: q/k/v biases, an untied table quantized too
CASES = {"qwen3-b32": ("qwen3", {}), "qwen2-b64-sym": ("qwen2", {"block_size": 64,
                                                                   "symmetric": True})}
PROMPT = [int(i) for i in np.random.default_rng(4).integers(4, 300, 24)]


@pytest.fixture(scope="module")
def q8(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """case -> (float32 artifact, 8-bit artifact) of one random model."""
    root = tmp_path_factory.mktemp("q8")
    out = {}
    for name, (family, flags) in CASES.items():
        hf = build_model(root / f"{name}_hf", family, seed=5)
        out[name] = (convert(hf, root / f"{name}_f32"),
                     convert(hf, root / f"{name}_q8", q_bits=8, quant_embeddings=True, **flags))
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_every_weight_is_stored_in_8_bits(q8: dict[str, tuple[Path, Path]], name: str) -> None:
    q = read_manifest(q8[name][1]).quantization
    assert q is not None and q["bits"] == 8 and q["method"] == "minmax+grid"
    assert {t["bits"] for t in q["tensors"]} == {8}
    assert q["block_size"] == CASES[name][1].get("block_size", 32)
    assert max(t["rel_rms_error"] for t in q["tensors"]) < 0.01  # 255 steps a block
    tables = {"tied_embedding_lm_head"} if name.startswith("qwen3") else {"lm_head",
                                                                           "embedding"}
    assert set(q["roles"]) == {"fused:FusedQKV", "fused:FusedGateUp", "linear", *tables}


@pytest.mark.parametrize("name", list(CASES))
def test_both_engines_agree_and_stay_close_to_float(q8: dict[str, tuple[Path, Path]],
                                                    name: str) -> None:
    f32, art = q8[name]
    mlx = make_engine(art, "mlx")
    weights = [v for v in mlx.plan.constants.values() if isinstance(v, QWeight)]
    assert weights and {w.bits for w in weights} == {8}
    ort = make_engine(art, "onnxruntime", accuracy_level=0)
    a, b = engine_logits(mlx, PROMPT, 8), engine_logits(ort, PROMPT, 8)
    assert rel(a, b) <= 1e-4  # the same 8-bit weights, float compute
    ref = engine_logits(make_engine(f32, "onnxruntime", accuracy_level=0), PROMPT, 8)
    assert rel(b, ref) <= 2e-2


@pytest.mark.parametrize(("bits", "group"), [(4, 32), (8, 32), (8, 64), (8, 128)])
def test_load_probe_keeps_quantized_matmuls_that_match_the_dense_one(bits: int, group: int
                                                                     ) -> None:
    """probe_kernels (run at load on a GPU) compares MLX's quantized matmul with the plain
    matmul over the dequantized weight; where they agree, as on this CPU, nothing falls back."""
    import mlx.core as mx

    from fuselm.runtime_metal.mlx_engine.qweight import probe_kernels

    w = mx.random.normal((96, 256), key=mx.random.key(bits + group))
    q, s, b = mx.quantize(w, group_size=group, bits=bits)
    for dtype in (mx.float32, mx.float16):
        weight = QWeight(q, s, b, group, True, bits=bits)
        assert probe_kernels([weight], dtype) == 0
