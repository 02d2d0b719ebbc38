"""Greedy float32 generation, every family: 64 tokens identical to HF transformers and across
engines, with a prompt spanning several prefill chunks."""

from __future__ import annotations

import numpy as np
import pytest

from fuselm.converter.models.builtin import FAMILIES
from fuselm.runtime_metal.engine import make_engine
from fuselm.runtime_metal.generate import generate
from fuselm.runtime_metal.validate import engine_logits, hf_greedy, hf_logits, hf_model, rel

N_TOKENS = 64
CHUNK = 16  # the 40-token prompt is three prefill chunks


def _prompt(vocab: int) -> list[int]:
    rng = np.random.default_rng(11)
    return [int(i) for i in rng.integers(4, vocab, size=40)]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_hf_and_engines_agree(family: str, family_models) -> None:  # noqa: ANN001
    hf_dir, out_dir = family_models[family]
    model = hf_model(hf_dir)
    prompt = _prompt(model.config.vocab_size)
    want = hf_greedy(model, prompt, N_TOKENS)
    ref_logits = hf_logits(model, prompt)
    tokens = {}
    for name in ("mlx", "onnxruntime"):
        engine = make_engine(out_dir, name)
        assert rel(engine_logits(engine, prompt, CHUNK), ref_logits) <= 1e-4
        result = generate(engine, prompt, max_new_tokens=N_TOKENS, prefill_chunk=CHUNK)
        tokens[name] = result.tokens
        assert result.stop_reason == "length"
    assert tokens["mlx"] == want
    assert tokens["onnxruntime"] == tokens["mlx"]


def test_kv_cache_grows_past_one_step(qwen3_artifact) -> None:  # noqa: ANN001
    """Crossing the 256-position preallocation boundary keeps the cache's meaning."""
    mlx_engine = make_engine(qwen3_artifact, "mlx")
    ort_engine = make_engine(qwen3_artifact, "onnxruntime")
    prompt = list(range(5, 255))
    for engine in (mlx_engine, ort_engine):
        engine.reset()
    a = [mlx_engine.forward(np.array([prompt])), ort_engine.forward(np.array([prompt]))]
    assert rel(a[0], a[1]) <= 1e-4
    for t in range(4):  # positions 250..253 then across 256 with a 6-token chunk
        ids = np.array([[7 + t] * (6 if t == 3 else 1)])
        assert rel(mlx_engine.forward(ids), ort_engine.forward(ids)) <= 1e-4
    assert mlx_engine.offset == ort_engine.offset == 259
    assert mlx_engine.caches[0].keys.shape[2] > 256  # grew by one more step


def test_sampling_is_seeded_and_engines_agree(qwen3_artifact) -> None:  # noqa: ANN001
    from fuselm.runtime_metal.sampling import SamplingOptions

    opts = SamplingOptions(temperature=0.8, top_k=50, top_p=0.9, repetition_penalty=1.1, seed=5)
    runs = [generate(make_engine(qwen3_artifact, e), [5, 6, 7], max_new_tokens=12, sampling=opts)
            for e in ("mlx", "onnxruntime", "mlx")]
    assert runs[0].tokens == runs[1].tokens == runs[2].tokens
    greedy = generate(make_engine(qwen3_artifact, "mlx"), [5, 6, 7], max_new_tokens=12)
    assert runs[0].tokens != greedy.tokens


def test_eos_and_stop_strings(qwen3_artifact) -> None:  # noqa: ANN001
    engine = make_engine(qwen3_artifact, "mlx")
    free = generate(engine, [5, 6, 7], max_new_tokens=8)
    stopped = generate(engine, [5, 6, 7], max_new_tokens=8, eos_ids=[free.tokens[2]])
    assert stopped.stop_reason == "eos"
    assert stopped.tokens == free.tokens[:free.tokens.index(free.tokens[2])]
    pieces: list[str] = []
    text = generate(engine, [5, 6, 7], max_new_tokens=8,
                    decode=lambda t: "".join(f"<{i}>" for i in t), on_text=pieces.append,
                    stop_strings=[f"<{free.tokens[1]}>"])
    assert text.stop_reason == "stop_string"
    cut = free.tokens.index(free.tokens[1])  # the first occurrence of the stop token
    assert text.text == "".join(f"<{t}>" for t in free.tokens[:cut])
    assert "".join(pieces) == text.text


@pytest.mark.parametrize("family", FAMILIES)
def test_q4_runs_every_family(family: str, family_models, tmp_path) -> None:  # noqa: ANN001
    """Every family's artifact through the Q4 pass (tied/untied head and embeddings included):
    the MLX engine matches onnxruntime at float compute, and both decode the same tokens."""
    from tests.runtime.conftest import quantized_copy

    out = quantized_copy(family_models[family][1], tmp_path / "q4", lm_head=True,
                         embeddings=True)
    prompt = _prompt(384)[:24]
    mlx_engine = make_engine(out, "mlx")
    ort_engine = make_engine(out, "onnxruntime", accuracy_level=0)
    assert rel(engine_logits(mlx_engine, prompt, CHUNK), engine_logits(ort_engine, prompt, CHUNK)
               ) <= 1e-3
    runs = [generate(e, prompt, max_new_tokens=16, prefill_chunk=CHUNK).tokens
            for e in (mlx_engine, ort_engine)]
    assert runs[0] == runs[1]


def test_prefill_chunk_default_follows_the_engine_and_device(qwen3_artifact) -> None:  # noqa: ANN001
    """No chunk given: 2,048 tokens for MLX on CUDA (measured faster on the H200), else 512;
    a given chunk is kept; 0 is one clear error."""
    from fuselm.runtime_metal.cuda_kernels import selection as kernels
    from fuselm.runtime_metal.errors import RuntimeUserError
    from fuselm.runtime_metal.generate import (
        CUDA_PREFILL_CHUNK,
        DEFAULT_PREFILL_CHUNK,
        prefill_chunk_for,
    )

    for name in ("mlx", "onnxruntime"):
        engine = make_engine(qwen3_artifact, name)
        on_cuda = name == "mlx" and kernels.cuda_device()
        assert prefill_chunk_for(engine, None) == (
            CUDA_PREFILL_CHUNK if on_cuda else DEFAULT_PREFILL_CHUNK)
        assert prefill_chunk_for(engine, 7) == 7
        with pytest.raises(RuntimeUserError, match="prefill chunk must be > 0"):
            prefill_chunk_for(engine, 0)
