"""The raw export through onnxruntime matches HF transformers (float32 ground truth)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest

from fuselm.runtime_metal.validate import rel
from tests.export.conftest import CASES, to_transformers4_config
from tests.export.helpers import (
    OrtLoop,
    hf_greedy,
    hf_incremental_logits,
    hf_logits,
    hf_model,
)

PREFILL, TOTAL = 12, 20  # 12-token prefill, then 8 single-token steps feeding present as past


def _ids(vocab: int, n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, (1, n))


@pytest.mark.parametrize("case", list(CASES))
def test_prefill_then_decode_matches_hf(case: str, checkpoint, exported) -> None:
    model = hf_model(checkpoint(case))
    ids = _ids(model.config.vocab_size, TOTAL)
    ours = OrtLoop(exported(case)).prefill_then_decode(ids, PREFILL)
    assert rel(ours, hf_incremental_logits(model, ids, PREFILL)) <= 1e-4


@pytest.mark.parametrize("case", ["qwen3", "qwen2-mqa", "llama-bias-mha", "mistral-window"])
def test_greedy_32_tokens_identical(case: str, checkpoint, exported) -> None:
    model = hf_model(checkpoint(case))
    prompt = _ids(model.config.vocab_size, 6, seed=1)
    assert OrtLoop(exported(case)).greedy(prompt, 32) == hf_greedy(model, prompt, 32)


def test_float16_export(checkpoint, exported) -> None:
    model = hf_model(checkpoint("qwen3"))
    ids = _ids(model.config.vocab_size, TOTAL)
    path = exported("qwen3", "float16")
    init = onnx.load(str(path), load_external_data=False).graph.initializer
    assert {t.data_type for t in init if t.dims and len(t.dims) == 2} == {onnx.TensorProto.FLOAT16}
    ours = OrtLoop(path).prefill_then_decode(ids, PREFILL)
    assert rel(ours, hf_logits(model, ids)) <= 2e-2


def test_bf16_checkpoint_defaults_to_float16_graph(checkpoint, exported) -> None:
    path = exported("llama-bf16-sharded", None)
    assert (checkpoint("llama-bf16-sharded") / "model.safetensors.index.json").is_file()
    loop = OrtLoop(path)
    assert loop.dtype == np.float16
    model = hf_model(checkpoint("llama-bf16-sharded"))
    ids = _ids(model.config.vocab_size, TOTAL)
    assert rel(loop.prefill_then_decode(ids, PREFILL), hf_logits(model, ids)) <= 2e-2


def test_transformers4_config_format(checkpoint, tmp_path) -> None:
    import shutil

    from fuselm.export.onnx_export import export_model

    src = checkpoint("llama-linear")
    copy = tmp_path / "v4"
    shutil.copytree(src, copy)
    to_transformers4_config(copy)
    export_model(copy, tmp_path / "m.onnx", "float32")
    model = hf_model(copy)
    assert model.config.rope_parameters["rope_type"] == "linear"
    ids = _ids(model.config.vocab_size, TOTAL)
    ours = OrtLoop(tmp_path / "m.onnx").prefill_then_decode(ids, PREFILL)
    assert rel(ours, hf_logits(model, ids)) <= 1e-4


def test_batch_with_left_padding(checkpoint, exported) -> None:
    """Two prompts of different lengths in one batch: padding masked, real tokens exact."""
    model = hf_model(checkpoint("qwen3"))
    ids = _ids(model.config.vocab_size, 10).repeat(2, 0)
    ids[1] = _ids(model.config.vocab_size, 10, seed=3)
    mask = np.ones_like(ids)
    mask[1, :4] = 0  # row 1 is left-padded by 4
    positions = np.stack([np.arange(10), np.clip(np.arange(10) - 4, 0, None)])
    loop = OrtLoop(exported("qwen3"))
    ours, _ = loop.step(ids, loop.empty_past(2), mask=mask, positions=positions)
    ref0 = hf_logits(model, ids[:1])
    ref1 = hf_logits(model, ids[1:, 4:])
    assert rel(ours[0], ref0[0]) <= 1e-4
    assert rel(ours[1, 4:], ref1[0]) <= 1e-4


def test_graph_contract(exported) -> None:
    """Opset 23 + fuselm, optimum's I/O names, one FusedRoPE and one Attention per layer."""
    path = exported("qwen3")
    onnx.checker.check_model(str(path))
    model = onnx.load(str(path), load_external_data=False)
    opsets = {o.domain: o.version for o in model.opset_import}
    assert opsets[""] == 23 and opsets["fuselm"] == 1
    names = [i.name for i in model.graph.input]
    assert names[:3] == ["input_ids", "attention_mask", "position_ids"]
    assert names[3:5] == ["past_key_values.0.key", "past_key_values.0.value"]
    assert [o.name for o in model.graph.output][:3] == [
        "logits",
        "present.0.key",
        "present.0.value",
    ]
    ops = Counter(n.op_type for n in model.graph.node)
    assert ops["FusedRoPE"] == 2 and ops["Attention"] == 2
    assert {f.name for f in model.functions} == {"FusedRoPE"}
    # weights are external, in model.onnx.data
    for t in model.graph.initializer:
        if len(t.dims) == 2:
            assert t.data_location == onnx.TensorProto.EXTERNAL
