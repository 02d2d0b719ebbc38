"""Speculative decoding (runtime_metal/drafting.py, generate.py's speculative loop, batch.py's
step_tokens): greedy tokens equal plain greedy decoding's token for token, with prompt lookup
and with a draft artifact, for one sequence and in batches of 1 and 4 where rows join and
leave, on both engines (MLX: the batched program over the block cache, and its sequential
mode; onnxruntime: rows mode on the lowered graph). The drafts are really checked and kept
(a draft model that is the target itself has every draft accepted), the rejected positions
are rolled back (a later prompt reuses a finished row's cache and still decodes its solo
tokens; every block of the pool is accounted for), and a draft model of another tokenizer is
refused with one error line.

The models: seeded random-weight Qwen3 (the target) and Llama (the draft) of one tokenizer,
weights drawn wide (initializer_range 0.5) so greedy decoding does not repeat one token, and
head_dim 32, which onnxruntime's lowering (rows mode) takes. onnxruntime runs at accuracy
level 0: at level 4 a step of several tokens computes unlike one of a single token
(test_ort_row_batch.py says how), so a near-tie could pick another token; the engine's
exact_rows option, which the CLI and the API turn on under drafting, removes that difference
(test_exact_rows.py, on the real SmolLM2 at level 4)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from fuselm.converter.models.builtin import build_model
from fuselm.runtime_metal.batch import BatchDecoder
from fuselm.runtime_metal.drafting import DraftModel, PromptLookup, speculative_options
from fuselm.runtime_metal.engine import make_engine
from fuselm.runtime_metal.errors import RuntimeUserError
from fuselm.runtime_metal.generate import generate
from fuselm.runtime_metal.loaded_model import open_model
from fuselm.runtime_metal.sampling import SamplingOptions
from tests.cli_run import cli, one_error, run_cli
from tests.runtime.conftest import convert

WIDE = {"initializer_range": 0.5, "head_dim": 32}
ENGINES = {"onnxruntime": {"accuracy_level": 0}, "mlx": {}}
# prompt length, new tokens, the step it joins at (batch runs)
PLAN = [(14, 24, 0), (6, 10, 0), (9, 20, 1), (20, 14, 2), (11, 12, 5)]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("speculative")
    return {name: convert(build_model(root / f"{name}_hf", family, seed=seed, **WIDE),
                          root / name)
            for name, family, seed in (("target", "qwen3", 3), ("draft", "llama", 5))}


@pytest.fixture(scope="module", params=list(ENGINES))
def engines(request: pytest.FixtureRequest, models: dict[str, Path]) -> dict[str, object]:
    opts = ENGINES[request.param]
    return {"target": make_engine(models["target"], request.param, **opts),
            "draft": make_engine(models["draft"], request.param, **opts),
            "self": make_engine(models["target"], request.param, **opts)}


def _prompts() -> list[list[int]]:
    """Prompts that repeat part of themselves (prompt lookup finds n-grams to draft from)."""
    rng = np.random.default_rng(1)
    out = []
    for n, _, _ in PLAN:
        base = [int(t) for t in rng.integers(4, 384, size=n)]
        out.append(base + base[: n // 2] + base)
    return out


def _drafter(kind: str, engines: dict[str, object]):  # noqa: ANN202
    return PromptLookup() if kind == "lookup" else DraftModel(engines[kind], 384)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def plain(engines: dict[str, object]) -> list[list[int]]:
    return [generate(engines["target"], p, max_new_tokens=n).tokens  # type: ignore[arg-type]
            for p, (_, n, _) in zip(_prompts(), PLAN, strict=True)]


@pytest.mark.parametrize("kind", ["lookup", "self"])  # a draft model: the batch test, run CLI
def test_single_sequence_equals_plain_greedy(engines: dict[str, object], plain: list[list[int]],
                                             kind: str) -> None:
    drafted = accepted = 0
    for p, (_, n, _), want in zip(_prompts(), PLAN, plain, strict=True):
        res = generate(engines["target"], p, max_new_tokens=n,  # type: ignore[arg-type]
                       drafter=_drafter(kind, engines), num_draft=4)
        assert res.tokens == want
        drafted, accepted = drafted + res.drafted, accepted + res.accepted
    assert drafted > 0 and (accepted > 0 or kind == "draft")  # a random draft model misses
    if kind == "self":  # the target drafting for itself: every draft is its own greedy token
        assert accepted == drafted


def _serve(dec: BatchDecoder, prompts: list[list[int]]) -> list[list[int]]:
    """Prompts join in PLAN's order when a slot is free and their step has come; each leaves
    after its own number of tokens (the tokens of a step past them are dropped)."""
    got: list[list[int]] = [[] for _ in prompts]
    slot_of: dict[int, int] = {}
    nxt = step = 0
    while nxt < len(prompts) or slot_of:
        while nxt < len(prompts) and PLAN[nxt][2] <= step and len(slot_of) < dec.max_batch:
            slot_of[dec.add(prompts[nxt])] = nxt
            nxt += 1
        for slot, tokens in dec.step_tokens().items():
            j = slot_of[slot]
            got[j] += tokens[:PLAN[j][1] - len(got[j])]
            if len(got[j]) == PLAN[j][1]:
                dec.remove(slot)
                del slot_of[slot]
        step += 1
    return got


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("kind", ["lookup", "draft", "self"])
def test_batch_equals_plain_greedy(engines: dict[str, object], plain: list[list[int]],
                                   kind: str, batch: int) -> None:
    engine = engines["target"]
    dec = BatchDecoder(engine, max_batch=batch, max_context=96,  # type: ignore[arg-type]
                       drafter=_drafter(kind, engines), num_draft=4)
    assert dec.mode == ("batched" if engine.name == "mlx" else "rows")  # type: ignore[attr-defined]
    assert _serve(dec, _prompts()) == plain
    # onnxruntime drafts while one row decodes (a drafted row runs alone there): fewer drafts
    few = kind == "draft" or (dec.mode == "rows" and batch > 1)
    assert dec.drafted > 0 and (dec.accepted > 0 or few)
    if kind == "self":
        assert dec.accepted == dec.drafted
    if dec.mode == "batched":  # every block is free or held by a slot's table, once
        pool = dec.cache.pool
        held = [b for s in dec.slots for b in s.blocks]
        assert sorted(held + pool.free) == list(range(len(pool.refs)))


def test_sequential_mode_and_sampled_rows(engines: dict[str, object], plain: list[list[int]]
                                          ) -> None:
    """MLX without the batched program (each slot its own cache) checks drafts the same way;
    a sampled row decodes beside drafted greedy rows without drafts of its own."""
    engine = engines["target"]
    dec = BatchDecoder(engine, max_batch=3, max_context=96, batched=False,  # type: ignore[arg-type]
                       drafter=PromptLookup(), num_draft=4)
    prompts = _prompts()
    rows = [dec.add(prompts[0]), dec.add(prompts[2]),
            dec.add(prompts[1], SamplingOptions(temperature=0.8, seed=1))]
    got: dict[int, list[int]] = {r: [] for r in rows}
    while any(len(got[r]) < 10 for r in rows):
        for slot, tokens in dec.step_tokens().items():
            got[slot] += tokens
    assert got[rows[0]][:10] == plain[0][:10] and got[rows[1]][:10] == plain[2][:10]
    assert dec.drafted > 0


def test_rolled_back_cache_is_reused(engines: dict[str, object], plain: list[list[int]]
                                     ) -> None:
    """A finished sequence's cache (after steps that rejected drafts) is the prefix of the
    next prompt: that prompt reuses it and still decodes its solo greedy tokens."""
    engine = engines["target"]
    dec = BatchDecoder(engine, max_batch=2, max_context=128,  # type: ignore[arg-type]
                       drafter=_drafter("draft", engines), num_draft=4)
    first = _prompts()[0]
    slot = dec.add(first)
    got: list[int] = []
    while len(got) < 16:
        got += dec.step_tokens().get(slot, [])
    dec.remove(slot)
    assert dec.drafted > dec.accepted  # some drafts were rejected and rolled back
    follow = first + got[:15] + [7, 8, 9]
    want = generate(engine, follow, max_new_tokens=12).tokens  # type: ignore[arg-type]
    slot = dec.add(follow)
    assert dec.slots[slot].reused >= len(first)
    got = []
    while len(got) < 12:
        got += dec.step_tokens().get(slot, [])
    assert got[:12] == want


def test_step_refused_with_a_drafter(engines: dict[str, object]) -> None:
    dec = BatchDecoder(engines["target"], max_batch=1, max_context=64,  # type: ignore[arg-type]
                       drafter=PromptLookup())
    with pytest.raises(RuntimeUserError, match="step_tokens"):
        dec.step()


def _other_tokenizer(models: dict[str, Path], tmp_path: Path) -> Path:
    """The draft artifact with one vocabulary entry renamed: another tokenizer."""
    out = shutil.copytree(models["draft"], tmp_path / "other_tok")
    path = out / "tokenizer.json"
    data = json.loads(path.read_text())
    vocab = data["model"]["vocab"]
    token = next(t for t in vocab if len(t) > 2)
    vocab[token + "x"] = vocab.pop(token)
    path.write_text(json.dumps(data))
    return out


def test_draft_of_another_tokenizer_is_refused(models: dict[str, Path], tmp_path: Path,
                                               capsys: pytest.CaptureFixture) -> None:
    target = open_model(models["target"], "onnxruntime", defer_engine=True)
    assert speculative_options(target, draft=models["draft"])["num_draft"] == 8
    other = _other_tokenizer(models, tmp_path)
    with pytest.raises(RuntimeUserError, match="another tokenizer"):
        speculative_options(target, draft=other)
    line = one_error(*cli(capsys, "run", str(models["target"]), "--prompt-ids", "5,6,7",
                          "--draft", str(other)))
    assert "another tokenizer" in line
    line = one_error(*cli(capsys, "run", str(models["target"]), "--prompt-ids", "5,6,7",
                          "--num-draft", "4"))
    assert "--num-draft" in line and "--draft-lookup" in line


@pytest.mark.parametrize("flags", [["--draft-lookup", "--num-draft", "4"], ["--draft", "D"]])
def test_run_cli_speculative_equals_plain(models: dict[str, Path], flags: list[str],
                                          capsys: pytest.CaptureFixture) -> None:
    flags = [str(models["draft"]) if f == "D" else f for f in flags]
    ids = ",".join(str(t) for t in _prompts()[0])
    args = ["run", str(models["target"]), "--prompt-ids", ids, "-n", "20", "--json",
            "--engine", "onnxruntime", "--accuracy-level", "0"]
    code, out, _ = run_cli(capsys, *args)
    assert code == 0
    want = json.loads(out.splitlines()[-1])
    code, out, _ = run_cli(capsys, *args, *flags)
    assert code == 0
    got = json.loads(out.splitlines()[-1])
    assert got["tokens"] == want["tokens"] and got["drafted"] > 0


def test_python_api_speculative_equals_plain(models: dict[str, Path]) -> None:
    import fuselm

    ids = _prompts()[3]
    want = fuselm.load(models["target"], "onnxruntime", accuracy_level=0).generate(
        ids, max_tokens=16, temperature=0)
    model = fuselm.load(models["target"], "onnxruntime", accuracy_level=0, draft_lookup=True,
                        num_draft=4)
    got = model.generate(ids, max_tokens=16, temperature=0)
    assert got.tokens == want.tokens
    with pytest.raises(RuntimeUserError, match="--draft-ngram"):
        fuselm.load(models["target"], "onnxruntime", draft_ngram=2)


def test_bench_speculative_json(models: dict[str, Path], capsys: pytest.CaptureFixture) -> None:
    code, out, _ = run_cli(capsys, "bench", str(models["target"]), "-p", "16", "-n", "8", "-r",
                           "1", "--engine", "onnxruntime", "--draft-lookup", "--json")
    assert code == 0
    spec = json.loads(out)["speculative"]
    assert spec["drafter"] == "prompt-lookup" and spec["num_draft"] == 8


@pytest.mark.parametrize("bits", [8, 4])
def test_over_a_quantized_kv_cache(models: dict[str, Path], bits: int) -> None:
    """MLX with an 8- or 4-bit KV cache (--kv-bits): the drafted positions are written
    quantized like single steps' and rolled back the same way (4 bits: keys per channel, each
    query reading its own key group in float), so speculative greedy equals plain greedy over
    the same quantized cache, one sequence and the batched program over the block cache."""
    engine = make_engine(models["target"], "mlx", kv_bits=bits, kv_group_size=32)
    prompts = _prompts()
    want = [generate(engine, p, max_new_tokens=n).tokens
            for p, (_, n, _) in zip(prompts, PLAN, strict=True)]
    for p, (_, n, _), w in zip(prompts, PLAN, want, strict=True):
        res = generate(engine, p, max_new_tokens=n, drafter=PromptLookup(), num_draft=4)
        assert res.tokens == w
    dec = BatchDecoder(engine, max_batch=4, max_context=96, drafter=PromptLookup(),
                       num_draft=4)
    assert dec.mode == "batched"
    assert _serve(dec, prompts) == want
    assert dec.drafted > 0


def test_a_logprob_row_beside_drafting_rows(engines: dict[str, object],
                                            plain: list[list[int]]) -> None:
    """A row asking for logprobs decodes plainly beside a drafting row; the decoder hands out
    one logprob record per reported token, in order, even when a step reports a new row's
    first token and the next together; both rows keep their plain greedy tokens."""
    dec = BatchDecoder(engines["target"], max_batch=2, max_context=96,  # type: ignore[arg-type]
                       drafter=PromptLookup(), num_draft=4)
    prompts = _prompts()
    a = dec.add(prompts[0], None, top_logprobs=2)
    b = dec.add(prompts[1])
    want = {a: plain[0], b: plain[1]}
    got: dict[int, list[int]] = {a: [], b: []}
    while any(len(got[s]) < len(want[s]) for s in got):
        for slot, tokens in dec.step_tokens().items():
            for t in tokens:
                if len(got[slot]) == len(want[slot]):
                    break
                got[slot].append(t)
                record = dec.logprobs(slot)
                if slot == a:
                    assert record is not None and record.token == t and len(record.top) == 2
                else:
                    assert record is None
            if len(got[slot]) == len(want[slot]):
                dec.remove(slot)
    assert got == want
