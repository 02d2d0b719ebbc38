"""Property: random small configs -> TorchScript export -> pipeline -> fused and numerics hold."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from passes_foreign import export_foreign
from passes_support import decoder_feeds, max_rel, op_counts, run

from fuselm.converter.models.builtin import build_model
from fuselm.passes.manager import run_pipeline


@st.composite
def configs(draw: st.DrawFn) -> tuple[str, dict]:
    family = draw(st.sampled_from(["qwen3", "qwen2", "llama"]))
    kv = draw(st.sampled_from([1, 2]))
    heads = kv * draw(st.sampled_from([1, 2, 3]))
    cfg = {
        "num_hidden_layers": draw(st.integers(1, 2)),
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": draw(st.sampled_from([8, 16, 24])),
        "hidden_size": draw(st.sampled_from([32, 48])),
        "intermediate_size": draw(st.sampled_from([40, 64])),
        "tie_word_embeddings": draw(st.booleans()),
        "rms_norm_eps": draw(st.sampled_from([1e-6, 1e-5])),
    }
    if family != "qwen2":  # qwen2 always has q/k/v biases
        cfg["attention_bias"] = draw(st.booleans())
    return family, cfg


@settings(max_examples=10, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(config=configs(), with_cache=st.booleans())
def test_random_configs(tmp_path_factory, config: tuple[str, dict], with_cache: bool) -> None:  # noqa: ANN001
    family, cfg = config
    d = tmp_path_factory.mktemp("prop")
    build_model(d, family, tokenizer=False, **cfg)
    raw_path = export_foreign(d, d / "model.onnx", dynamo=False, opset=17, with_cache=with_cache)
    import onnx

    raw = onnx.load(str(raw_path))
    feeds = decoder_feeds(raw)
    out, _ = run_pipeline(raw)
    counts = op_counts(out)
    layers = cfg["num_hidden_layers"]
    for op in ("FusedQKV", "FusedGateUp", "FusedRoPE", "Attention"):
        assert counts[op] == layers, (op, family, cfg, dict(counts))
    assert max_rel(run(out, feeds), run(raw, feeds)) <= 1e-5
    assert np.isfinite(run(out, feeds)[0]).all()
