"""onnxruntime's batched decode (ort_engine/row_batch.py, batch.py's "rows" mode): rows of
different lengths in one run of the lowered graph. Every row's greedy tokens equal its solo
`generate`, while rows join, leave mid-generation (a row in the middle of the buffer falls
idle and is refilled) and run different lengths, for Qwen3 (q/k-norm, GQA, tied embeddings),
Granite (multipliers), Gemma 3 (a sliding window of 8 that the rows outgrow), the suite's
Llama (head_dim == hidden / heads) and the real SmolLM2-135M Q4. The plain graph (no
lowering) still serves its rows one after another, with the same tokens.

Every family runs at the engine's default accuracy level (4: int8 activations for the Q4
model's MatMulNBits), where batched rows still equal solo steps bit for bit: MatMulNBits
quantizes each row's activations on its own, and GroupQueryAttention multiplies a row's one
query by V with the same single-row kernel a solo decode step uses. What does compute unlike
one-token steps is a step of several tokens of one sequence (a prefill, a speculative check):
GroupQueryAttention takes MLAS's general kernel for several query rows, a 1-ulp difference
that the next int8 quantization can amplify (benchmarks/probes/verify_rows.py; BENCHMARKS.md,
"Speculative decoding"). Both paths prefill a prompt the same way here, so the tokens agree."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fuselm.converter.models.builtin import build_model
from fuselm.converter.models.smollm2 import bundled_gguf
from fuselm.runtime_metal.batch import BatchDecoder
from fuselm.runtime_metal.engine import make_engine
from fuselm.runtime_metal.generate import generate
from tests.families import TEST_CONFIGS
from tests.runtime.conftest import convert

# prompt length, new tokens, first step it may join at
PLAN = [(6, 12, 0), (29, 5, 0), (17, 14, 1), (11, 9, 3), (23, 7, 4)]
H32 = {"qwen3": {"head_dim": 32}, "granite": {**TEST_CONFIGS["granite"], "head_dim": 32},
       "gemma3_text": {**TEST_CONFIGS["gemma3_text"], "head_dim": 32}}


@pytest.fixture(scope="session")
def row_models(tmp_path_factory: pytest.TempPathFactory, family_models) -> dict[str, Path]:  # noqa: ANN001
    root = tmp_path_factory.mktemp("row_batch")
    out = {f: convert(build_model(root / f"{f}_hf", f, seed=7, **o), root / f"{f}_out")
           for f, o in H32.items()}
    out["llama"] = family_models["llama"][1]
    out["smollm2-q4"] = convert(bundled_gguf(), root / "smol_q4", quant="q4")
    return out


def _prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [[int(t) for t in rng.integers(4, min(vocab, 384), size=n)] for n, _, _ in PLAN]


def _serve(dec: BatchDecoder, prompts: list[list[int]]) -> list[list[int]]:
    """Prompts join in PLAN's order as soon as a slot is free (and their step has come); each
    leaves after its own number of tokens."""
    got: list[list[int]] = [[] for _ in prompts]
    slot_of: dict[int, int] = {}
    nxt, step = 0, 0
    while nxt < len(prompts) or slot_of:
        while nxt < len(prompts) and PLAN[nxt][2] <= step and len(slot_of) < dec.max_batch:
            slot_of[dec.add(prompts[nxt])] = nxt
            nxt += 1
        for slot, token in dec.step().items():
            i = slot_of[slot]
            got[i].append(token)
            if len(got[i]) == PLAN[i][1]:
                dec.remove(slot)
                del slot_of[slot]
        step += 1
    return got


@pytest.mark.parametrize("family", ["qwen3", "granite", "gemma3_text", "llama", "smollm2-q4"])
def test_rows_joining_and_leaving_get_their_solo_tokens(family: str, row_models) -> None:  # noqa: ANN001
    engine = make_engine(row_models[family], "onnxruntime")
    assert str(engine.describe()["lowering"]).startswith("onnxruntime contrib ops")
    prompts = _prompts(engine.manifest.model.vocab_size)  # type: ignore[attr-defined]
    want = [generate(engine, p, max_new_tokens=n).tokens for p, (_, n, _) in zip(
        prompts, PLAN, strict=True)]
    dec = BatchDecoder(engine, max_batch=3, max_context=96)
    assert dec.mode == "rows"
    assert _serve(dec, prompts) == want
    assert dec.reused_tokens == 0 or family != "qwen3"  # distinct prompts: nothing to reuse
    # the engine's own cache is untouched by the batch: a solo run still agrees
    assert generate(engine, prompts[2], max_new_tokens=PLAN[2][1]).tokens == want[2]


def test_a_row_reuses_its_cached_prefix_inside_the_batch(row_models) -> None:  # noqa: ANN001
    """A finished row's tokens stay in its row: a prompt extending them prefills only the rest
    and decodes as from scratch, next to a row that keeps running."""
    engine = make_engine(row_models["qwen3"], "onnxruntime")
    a, b = _prompts(384)[:2]
    dec = BatchDecoder(engine, max_batch=2, max_context=96)
    sa = dec.add(a)
    first = [dec.step()[sa] for _ in range(4)]
    dec.remove(sa)
    longer = a + first[:3]
    sc = dec.add(longer)
    assert sc == sa and dec.reused_tokens == len(longer) - 1
    sb = dec.add(b)
    got: dict[int, list[int]] = {sb: [], sc: []}
    for _ in range(6):
        for slot, token in dec.step().items():
            got[slot].append(token)
    assert got[sc] == generate(engine, longer, max_new_tokens=6).tokens
    assert got[sb] == generate(engine, b, max_new_tokens=6).tokens


def test_the_plain_graph_serves_rows_one_after_another(row_models) -> None:  # noqa: ANN001
    engine = make_engine(row_models["qwen3"], "onnxruntime", lower=False)
    prompts = _prompts(384)
    dec = BatchDecoder(engine, max_batch=3, max_context=96)
    assert dec.mode == "sequential"
    assert _serve(dec, prompts) == [generate(engine, p, max_new_tokens=n).tokens
                                    for p, (_, n, _) in zip(prompts, PLAN, strict=True)]
