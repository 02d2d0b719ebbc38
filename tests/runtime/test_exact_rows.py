"""onnxruntime's `exact_rows` (ort_engine/lowering.py `_attention`), on by default under
speculative decoding (drafting.py `speculative_engine_options`): on the real SmolLM2-135M (the
bundled Q4_1 GGUF, default conversion) at the default accuracy level 4, a step of several
tokens computes each position bit for bit as a one-token step does, so a drafted reply at the
default settings is plain greedy decoding's (on the exact-rows engine) token for token, for
one sequence, both drafters, the CLI and the API, and through the batch decoder at batch 1
and 4, over an edit-style reply long enough to pass the near-ties where the one-row engine's
several-token check picks another token (BENCHMARKS.md 'Speculative decoding': from token 88
of the edit reply). Plain decoding keeps the one-row path."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import fuselm
from fuselm.converter.cli.options import ort_options
from fuselm.runtime_metal.batch import BatchDecoder
from fuselm.runtime_metal.drafting import PromptLookup, speculative_engine_options
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
    """The model as speculative decoding opens it by default (exact rows: on where lowered)."""
    options = speculative_engine_options("onnxruntime", {}, drafting=True)
    model = open_model(smol_default, "onnxruntime", **options)  # level: the default
    assert model.engine.describe()["accuracy_level"] == 4
    assert model.engine.describe()["exact_rows"] is True
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


def test_exact_rows_default_rule() -> None:
    """On onnxruntime: on with a drafter unless --no-exact-rows, off for plain decoding unless
    --exact-rows; either flag is refused by name on MLX."""
    assert "exact_rows" not in ort_options("onnxruntime", 4, None)
    assert ort_options("onnxruntime", 4, None, drafting=True)["exact_rows"] is None  # if lowered
    assert ort_options("onnxruntime", 4, None, False, drafting=True)["exact_rows"] is False
    assert ort_options("onnxruntime", 4, None, True)["exact_rows"] is True
    assert ort_options("mlx", None, None, drafting=True) == {}
    for flag, value in (("--exact-rows", True), ("--no-exact-rows", False)):
        with pytest.raises(RuntimeUserError, match=f"{flag} sets onnxruntime's"):
            ort_options("mlx", None, None, value)


def test_run_cli_drafts_at_defaults(smol: LoadedModel, plain: list[int],
                                    capsys: pytest.CaptureFixture) -> None:
    """`fuselm run --draft-lookup`, no other flag, replies with plain decoding's tokens
    (--exact-rows: the drafted reply's plain counterpart)."""
    args = ["run", str(smol.path), "--prompt", EDIT, "-n", "24", "--json", "--draft-lookup"]
    code, out, _ = run_cli(capsys, *args)
    assert code == 0
    got = json.loads(out.splitlines()[-1])
    assert got["tokens"] == plain[:24] and got["accepted"] > 0


def test_api_draft_model_at_defaults(smol: LoadedModel, prompt: list[int],
                                     plain: list[int]) -> None:
    """`fuselm.load(..., draft=OUT_DIR)` (the model as its own draft: the same tokenizer)
    opens the target on onnxruntime with exact rows; its greedy generation is plain
    decoding's."""
    model = fuselm.load(smol.path, "onnxruntime", draft=smol.path, num_draft=4)
    assert model.engine.describe()["exact_rows"] is True
    assert model.generate(prompt, max_tokens=24).tokens == plain[:24]


def test_run_cli_exact_rows(smol: LoadedModel, plain: list[int],
                            capsys: pytest.CaptureFixture) -> None:
    """`fuselm run --exact-rows` (plain decoding) replies with a drafted reply's tokens; the
    flag is refused by name on MLX, and without the lowered graph."""
    args = ["run", str(smol.path), "--prompt", EDIT, "-n", "24", "--json", "--exact-rows"]
    code, out, _ = run_cli(capsys, *args)
    assert code == 0
    assert json.loads(out.splitlines()[-1])["tokens"] == plain[:24]
    line = one_error(*cli(capsys, *args, "--engine", "mlx"))
    assert "--exact-rows" in line and "onnxruntime" in line
    with pytest.raises(RuntimeUserError, match="exact_rows needs the lowered graph"):
        open_model(Path(smol.path), "onnxruntime", exact_rows=True, lower=False)
