"""RoPE and attention fusion on hand-built decoder blocks: each form, refusals, numerics."""

from __future__ import annotations

import numpy as np
import pytest
from passes_support import apply, layer_model, max_rel, op_counts, run

from fuselm.passes.attention import AttentionFusion
from fuselm.passes.dead_shape import RemoveDeadShapeOp
from fuselm.passes.rope import RoPEFusion

FORMS = {
    "rotate-half+softmax": {},
    "RotaryEmbedding": {"rope": "op"},
    "attention-op-4d": {"core": "op"},
    "qk-norm+bias": {"qk_norm": True, "bias": True},
    "no-cache": {"cache": False},
    "mha": {"kv": 4},
    "mqa": {"kv": 1},
}


@pytest.mark.parametrize("form", FORMS)
def test_rope_then_attention(form: str) -> None:
    model, feeds = layer_model(mlp=False, **FORMS[form])
    ref = run(model, feeds)
    folded, _ = apply(model, RemoveDeadShapeOp())
    roped, r1 = apply(folded, RoPEFusion())
    assert r1.count == 1 and not r1.refused
    assert op_counts(roped)["FusedRoPE"] == 1
    assert not {"RotaryEmbedding", "Neg", "Cos"} & set(op_counts(roped))
    assert op_counts(roped)["RMSNormalization"] == 1  # q/k norms folded into FusedRoPE
    assert max_rel(run(roped, feeds), ref) <= 1e-5
    fused, r2 = apply(roped, AttentionFusion())
    assert r2.count == 1 and not r2.refused
    counts = op_counts(fused)
    assert counts["Attention"] == 1 and "Softmax" not in counts and "Expand" not in counts
    attn = next(n for n in fused.graph.node if n.op_type == "Attention")
    attrs = {a.name: a for a in attn.attribute}
    assert attrs["q_num_heads"].i == 4 and attrs["kv_num_heads"].i == FORMS[form].get("kv", 2)
    assert max_rel(run(fused, feeds), ref) <= 1e-5
    # idempotent
    again, r3 = apply(fused, AttentionFusion())
    assert r3.count == 0 and again.SerializeToString() == fused.SerializeToString()


def test_rope_refuses_three_rotations() -> None:
    """v rotated with the same frequencies too: which two are q and k is unknown."""
    model, feeds = layer_model(mlp=False, rotate_v=True)
    out, result = apply(model, RoPEFusion())
    assert result.count == 0
    assert len(result.refused) == 3 and "3 rotations" in result.refused[0][1]
    assert "FusedRoPE" not in op_counts(out)
    assert max_rel(run(out, feeds), run(model, feeds)) == 0.0


def test_attention_refuses_leftover_head_norm() -> None:
    """q/k norms without RoPE to fold them into: Attention cannot take them."""
    model, feeds = layer_model(mlp=False, qk_norm=True, rope=None)
    out, result = apply(model, AttentionFusion())
    assert result.count == 0
    assert result.refused and "per-head norm" in result.refused[0][1]
    assert max_rel(run(out, feeds), run(model, feeds)) == 0.0


def test_attention_without_rope() -> None:
    model, feeds = layer_model(mlp=False, rope=None)
    out, result = apply(model, AttentionFusion())
    assert result.count == 1
    assert max_rel(run(out, feeds), run(model, feeds)) <= 1e-5


def test_rel_detects_a_wrong_model() -> None:
    """The numerics check itself: a changed weight must show."""
    model, feeds = layer_model(mlp=False)
    ref = run(model, feeds)
    init = next(t for t in model.graph.initializer if len(t.dims) == 2)
    arr = np.frombuffer(init.raw_data, np.float32).copy()
    arr[0] += 1.0
    init.raw_data = arr.tobytes()
    assert max_rel(run(model, feeds), ref) > 1e-3
