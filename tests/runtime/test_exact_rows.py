"""onnxruntime's `exact_rows` (ort_engine/lowering.py `_attention`): on the real SmolLM2-135M
(the bundled Q4_1 GGUF, default conversion) at the default accuracy level 4, a step of several
tokens computes each position bit for bit as a one-token step does, so speculative decoding
(prompt lookup) gives plain greedy decoding's tokens, for one sequence and through the batch
decoder at batch 1 and 4, over an edit-style reply long enough to pass the near-ties where
the default lowering's several-token check picks another token (BENCHMARKS.md 'Speculative
decoding': from token 88 of the edit reply)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fuselm.runtime_metal.batch import BatchDecoder
from fuselm.runtime_metal.drafting import PromptLookup
from fuselm.runtime_metal.errors import RuntimeUserError
from fuselm.runtime_metal.generate import prefill
from fuselm.runtime_metal.loaded_model import LoadedModel, open_model
from fuselm.runtime_metal.tokenizer import encode_prompt
from tests.cli_run import cli, one_error, run_cli
from tests.workloads import WORKLOADS

EDIT = WORKLOADS["edit"]
N = 110  # new tokens: past token 88


@pytest.fixture(scope="module")
def smol(smol_default: Path) -> LoadedModel:
    model = open_model(smol_default, "onnxruntime", exact_rows=True)  # level: the default
    assert model.engine.describe()["accuracy_level"] == 4
    return model


@pytest.fixture(scope="module")
def prompt(smol: LoadedModel) -> list[int]:
    return encode_prompt(smol.tokenizer, EDIT)


@pytest.fixture(scope="module")
def plain(smol: LoadedModel, prompt: list[int]) -> list[int]:
    return smol.generate(prompt, max_new_tokens=N).tokens


def test_several_token_steps_compute_like_one_token_steps(smol: LoadedModel,
                                                          prompt: list[int]) -> None:
    engine = smol.engine
    engine.reset()
    engine.reserve(len(prompt) + 16)
    whole = prefill(engine, prompt)
    tokens = [int(np.argmax(whole)), *prompt[-8:]]  # any ids will do
    checked = engine.verify(np.array([tokens], np.int64))
    engine.trim(len(tokens))
    stepped = np.stack([engine.decode_step(t) for t in tokens])
    assert np.array_equal(checked, stepped)
    # the prompt prefilled in one step, or its last positions decoded one by one
    engine.reset()
    prefill(engine, prompt[:-5])
    for t in prompt[-5:]:
        last = engine.decode_step(t)
    assert np.array_equal(last, whole)


def test_prompt_lookup_equals_plain_greedy(smol: LoadedModel, prompt: list[int],
                                           plain: list[int]) -> None:
    assert len(plain) > 88
    res = smol.generate(prompt, max_new_tokens=N, drafter=PromptLookup(), num_draft=8)
    assert res.tokens == plain
    assert res.accepted > 20  # the reply copies its input: drafts are really kept


@pytest.mark.parametrize("batch", [1, 4])
def test_batch_decoder_equals_plain_greedy(smol: LoadedModel, prompt: list[int],
                                           plain: list[int], batch: int) -> None:
    """The batch decoder checks drafts row by row here (exact_rows: no batched rows); four
    copies of the prompt, joining at different steps, each get plain decoding's tokens."""
    n = 16
    dec = BatchDecoder(smol.engine, max_batch=batch, max_context=len(prompt) + N + 8,
                       drafter=PromptLookup(), num_draft=8)
    assert dec.mode == "sequential"
    got: dict[int, list[int]] = {}
    waiting, step = 4, 0
    while waiting or dec.active:
        if waiting and len(dec.active) < batch and step % 3 == 0:
            got[dec.add(prompt)] = []
            waiting -= 1
        for slot, tokens in dec.step_tokens().items():
            got[slot] += tokens
            if len(got[slot]) >= n:
                assert got[slot][:n] == plain[:n]
                dec.remove(slot)
        step += 1
    assert dec.accepted > 0


def test_run_cli_exact_rows(smol: LoadedModel, plain: list[int],
                            capsys: pytest.CaptureFixture) -> None:
    """`fuselm run --exact-rows --draft-lookup` replies with plain decoding's tokens; the flag
    is refused by name on MLX, and without the lowered graph."""
    args = ["run", str(smol.path), "--prompt", EDIT, "-n", "24", "--json", "--exact-rows"]
    code, out, _ = run_cli(capsys, *args, "--draft-lookup")
    assert code == 0
    got = json.loads(out.splitlines()[-1])
    assert got["tokens"] == plain[:24] and got["accepted"] > 0
    line = one_error(*cli(capsys, *args, "--engine", "mlx"))
    assert "--exact-rows" in line and "onnxruntime" in line
    with pytest.raises(RuntimeUserError, match="exact_rows needs the lowered graph"):
        open_model(Path(smol.path), "onnxruntime", exact_rows=True, lower=False)
