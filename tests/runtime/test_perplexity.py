"""`fuselm perplexity`: the chunking rule, the NLL against torch, engines against HF, the CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from fuselm.converter.cli.main import cli
from fuselm.runtime_metal.errors import RuntimeUserError
from fuselm.runtime_metal.perplexity import (
    SAMPLE_TEXT,
    chunk_nll,
    chunks,
    perplexity,
    perplexity_of,
    text_tokens,
)
from fuselm.runtime_metal.tokenizer import load_tokenizer
from fuselm.runtime_metal.validate import hf_logits, hf_model


def test_chunk_nll_is_torch_cross_entropy_on_the_second_half() -> None:
    """llama-perplexity's count: of a chunk of c tokens, the c/2 - 1 after position c/2 are
    scored (llama.cpp's `first = n_ctx/2`, `n_ctx - 1 - first` tokens from the logits at
    first .. c-2), so its PPL of the same logits is ours."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(8, 11)).astype(np.float32) * 3
    ids = rng.integers(0, 11, size=8).tolist()
    want = torch.nn.functional.cross_entropy(
        torch.tensor(logits[4:7], dtype=torch.float64), torch.tensor(ids[5:]), reduction="none")
    np.testing.assert_allclose(chunk_nll(logits, ids), want.numpy(), rtol=1e-12)


def test_chunks_drop_the_partial_tail_and_check_context() -> None:
    assert chunks(list(range(10)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(RuntimeUserError, match="even"):
        chunks(list(range(10)), 5)
    with pytest.raises(RuntimeUserError, match="fewer than one chunk"):
        chunks(list(range(3)), 4)


def test_uniform_model_has_vocab_perplexity() -> None:
    r = perplexity_of(lambda ids: np.zeros((len(ids), 50)), list(range(40)), context=8)
    assert math.isclose(r.ppl, 50.0) and r.ppl_stderr < 1e-9
    assert (r.chunks, r.scored_tokens, r.evaluated_tokens) == (5, 15, 40)


@pytest.mark.parametrize("engine", ["onnxruntime", "mlx"])
def test_engine_ppl_equals_hf_ppl(family_models: dict[str, tuple[Path, Path]],
                                  engine: str) -> None:
    """float32 artifact: the same chunks through the engine and HF give the same PPL."""
    hf_dir, out = family_models["qwen2"]
    text = SAMPLE_TEXT.read_text()[:1500]
    tokens = text_tokens(load_tokenizer(out), text)
    model = hf_model(hf_dir)
    want = perplexity_of(lambda ids: hf_logits(model, ids), tokens, context=64)
    got = perplexity(out, text, context=64, engine=engine)
    assert got.chunks == want.chunks >= 2
    assert math.isclose(got.ppl, want.ppl, rel_tol=1e-5)
    assert math.isclose(got.ppl_stderr, want.ppl_stderr, rel_tol=1e-3)


def test_cli_json_and_errors(qwen3_artifact: Path, tmp_path: Path) -> None:
    res = CliRunner().invoke(cli, ["perplexity", str(qwen3_artifact), "--context", "128",
                                   "--engine", "onnxruntime", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["context"] == 128 and out["scored_tokens"] == out["chunks"] * 63
    assert out["ppl"] > 1 and out["tokens_per_s"] > 0
    short = tmp_path / "short.txt"
    short.write_text("too short")
    res = CliRunner().invoke(cli, ["perplexity", str(qwen3_artifact), "--text", str(short)])
    assert isinstance(res.exception, RuntimeUserError)
    assert "fewer than one chunk" in str(res.exception)
