"""Whole pipeline on real exports: ours (every family) and foreign torch.onnx exports.

Per layer exactly one FusedQKV, FusedGateUp, FusedRoPE and Attention; onnxruntime (optimizer
off) before/after every pass within 1e-5; the final model against HF transformers float32
(logits within 1e-4, 32 greedy tokens identical); idempotent and byte-deterministic.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import CASES, FOREIGN_FORMS
from passes_support import (
    apply,
    decoder_feeds,
    functions_attached,
    hf_logits_and_greedy,
    max_rel,
    op_counts,
    ort_logits_and_greedy,
    rel,
    run,
)

from fuselm.passes.layers import residual_layer_sizes
from fuselm.passes.manager import PIPELINE, run_pipeline
from fuselm.passes.model_io import check

LAYERS = 2
FUSED = ("FusedQKV", "FusedGateUp", "FusedRoPE", "Attention")
PROMPT = np.array([[5, 17, 42, 99, 7, 250, 3]], np.int64)


def assert_fused(model: onnx.ModelProto) -> None:
    counts = op_counts(model)
    for op in FUSED:
        assert counts[op] == LAYERS, (op, dict(counts))
    # nothing per-layer is left unfused
    for op in ("Softmax", "RotaryEmbedding", "Sigmoid", "ReduceMean", "Neg", "Cos"):
        assert op not in counts, (op, dict(counts))
    assert counts["MatMul"] == 2 * LAYERS + 1  # o_proj, down_proj per layer; the LM head
    assert functions_attached(model)
    check(model)


def assert_matches_hf(model: onnx.ModelProto, model_dir) -> None:  # noqa: ANN001
    ref_logits, ref_tokens = hf_logits_and_greedy(model_dir, PROMPT, 32)
    logits, tokens = ort_logits_and_greedy(model, PROMPT, 32)
    assert rel(logits, ref_logits) <= 1e-4
    assert tokens == ref_tokens


@pytest.mark.parametrize("case", CASES)
def test_ours(case: str, ours, model_dir) -> None:  # noqa: ANN001
    raw = ours(case)
    feeds = decoder_feeds(raw)
    out, report = run_pipeline(raw)
    assert_fused(out)
    assert max_rel(run(out, feeds), run(raw, feeds)) <= 1e-5
    # no shape chain left that a static shape folds
    again, result = apply(out, PIPELINE[0])
    assert result.count == 0
    assert all(not e.refused for e in report.entries), [e.refused for e in report.entries]
    per_layer = 11 if case == "llama" else 10  # llama's mlp_bias: down_proj's bias Add
    assert residual_layer_sizes(list(out.graph.node)) == [per_layer] * LAYERS
    assert_matches_hf(out, model_dir(case))


# Every form for qwen3; the other families through TorchScript, and llama (MQA, gate/up bias)
# through dynamo too. Dynamo exports cost ~7 s each, so the list is chosen, not a product.
FOREIGN = [("qwen3", form) for form in FOREIGN_FORMS] + [
    ("qwen2", "torchscript-cache"), ("llama", "torchscript-cache"),
    ("mistral", "torchscript-cache"), ("llama", "dynamo23-cache"),
]


@pytest.mark.parametrize(("case", "form"), FOREIGN, ids=[f"{c}-{f}" for c, f in FOREIGN])
def test_foreign(case: str, form: str, foreign, model_dir) -> None:  # noqa: ANN001
    raw = foreign(case, form)
    feeds = decoder_feeds(raw)
    ref = run(raw, feeds)
    out, report = run_pipeline(raw)
    assert_fused(out)
    assert max_rel(run(out, feeds), ref) <= 1e-5
    if form in ("dynamo23-cache", "torchscript-nocache", "torchscript-cache"):
        assert_matches_hf(out, model_dir(case))


def test_each_pass_keeps_numerics(foreign) -> None:  # noqa: ANN001
    """Pass by pass on the TorchScript export (the most decomposed form)."""
    model = foreign("qwen3", "torchscript-cache")
    model, _ = run_pipeline(model, [])  # opset 17 -> 23 first, nothing else but cleanup
    feeds = decoder_feeds(model)
    ref = run(model, feeds)
    for p in PIPELINE:
        model, _ = apply(model, p)
        assert max_rel(run(model, feeds), ref) <= 1e-5, p.name


def test_idempotent_and_deterministic(ours, foreign) -> None:  # noqa: ANN001
    for raw in (ours("qwen3"), foreign("qwen3", "dynamo20-cache")):
        once, _ = run_pipeline(raw)
        again, _ = run_pipeline(raw)
        assert once.SerializeToString() == again.SerializeToString()
        twice, report = run_pipeline(once)
        assert all(e.matches == 0 for e in report.entries if e.name != "cleanup"), \
            [(e.name, e.matches) for e in report.entries]
        assert twice.SerializeToString() == once.SerializeToString()


def test_report(ours) -> None:  # noqa: ANN001
    import json

    from rich.console import Console

    _, report = run_pipeline(ours("qwen2"))
    d = report.to_dict()
    json.dumps(d)
    names = [e["name"] for e in d["passes"]]
    assert names[-1] == "cleanup" and "qkv" in names
    qkv = next(e for e in d["passes"] if e["name"] == "qkv")
    assert qkv["matches"] == LAYERS and qkv["op_delta"]["fuselm.FusedQKV"] == LAYERS
    assert qkv["nodes_after"] < qkv["nodes_before"]
    reorder = next(e for e in d["passes"] if e["name"] == "reorder_qkv")
    assert reorder["extra"]["peak_live_after"] <= reorder["extra"]["peak_live_before"]
    console = Console(record=True, width=140)
    console.print(report.render())
    assert "reorder_qkv" in console.export_text()
