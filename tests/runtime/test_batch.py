"""Batched decode (runtime_metal/batch.py): a sequence's greedy tokens are the same alone, in a
batch with others of different lengths that join mid-way, and from single-sequence `generate`
at temperature 0, on both engines (MLX: the batched program; onnxruntime: one at a time); for
Qwen3 (head_dim != hidden/heads, GQA 2:1, q/k-norm), Qwen2 (GQA 4:1, biases) and Llama. A freed
slot's cached prefix is reused by a prompt that extends it, and rows sharing a prefix (MLX: its
blocks, by reference) decode their solo tokens."""

from __future__ import annotations

import numpy as np
import pytest

from fuselm.runtime_metal.batch import BatchDecoder, padded_width
from fuselm.runtime_metal.engine import make_engine
from fuselm.runtime_metal.errors import RuntimeUserError
from fuselm.runtime_metal.generate import generate
from fuselm.runtime_metal.kv_cache import BLOCK
from fuselm.runtime_metal.sampling import SamplingOptions

N = 10


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [[int(t) for t in rng.integers(4, 384, size=n)] for n in (6, 29, 17)]


def _run(dec: BatchDecoder, prompts: list[list[int]], joins: list[int]) -> list[list[int]]:
    """Add prompt i before step joins[i]; collect N tokens per sequence; free each when done."""
    got: dict[int, list[int]] = {}
    order: list[int] = []
    step = 0
    while len(order) < len(prompts) or any(len(got[s]) < N for s in order):
        for i, at in enumerate(joins):
            if at == step:
                slot = dec.add(prompts[i])
                got[slot] = []
                order.append(slot)
        for slot, token in dec.step().items():
            got[slot].append(token)
            if len(got[slot]) == N:
                dec.remove(slot)
        step += 1
    return [got[s] for s in order]


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
@pytest.mark.parametrize("engine_name", ["mlx", "onnxruntime"])
def test_batched_greedy_is_batch_invariant_and_equals_generate(family: str, engine_name: str,
                                                               family_models) -> None:  # noqa: ANN001
    engine = make_engine(family_models[family][1], engine_name)
    prompts = _prompts()
    want = [generate(engine, p, max_new_tokens=N).tokens for p in prompts]
    dec = BatchDecoder(engine, max_batch=3, max_context=96)
    assert dec.mode == ("batched" if engine_name == "mlx" else "rows" if str(
        engine.describe()["lowering"]).startswith("onnxruntime contrib") else "sequential")
    alone = [_run(dec, [p], [0])[0] for p in prompts]
    together = _run(BatchDecoder(engine, max_batch=3, max_context=96), prompts, [0, 2, 5])
    assert alone == want
    assert together == want
    # the engine's own cache was left as it was: single-sequence generation still agrees
    assert generate(engine, prompts[1], max_new_tokens=N).tokens == want[1]


@pytest.mark.parametrize("engine_name", ["mlx", "onnxruntime"])
def test_prefix_reuse_sampling_and_limits(engine_name: str, qwen3_artifact) -> None:  # noqa: ANN001
    engine = make_engine(qwen3_artifact, engine_name)
    dec = BatchDecoder(engine, max_batch=2, max_context=40)
    first = _prompts()[1]
    opts = SamplingOptions(temperature=0.8, seed=2)
    a = dec.add(first)
    b = dec.add([5, 6, 7], opts)
    with pytest.raises(RuntimeUserError, match="slots are busy"):
        dec.add([1, 2])
    steps = [dec.step() for _ in range(4)]
    dec.remove(a)
    longer = first + [steps[0][a], steps[1][a], 9, 10]
    want = generate(engine, longer, max_new_tokens=5).tokens
    again = dec.add(longer)  # extends slot a's cached tokens: they are kept
    assert again == a and dec.reused_tokens == len(first) + 2  # t0, t1 were fed too
    steps += [dec.step() for _ in range(5)]
    assert [s[a] for s in steps[4:]] == want
    # the sampled slot is seeded: the same draws as generate's host sampler
    sampled = generate(engine, [5, 6, 7], max_new_tokens=9, sampling=opts,
                       device_sampling=False)
    assert [s[b] for s in steps] == sampled.tokens
    with pytest.raises(RuntimeUserError, match="context"):
        dec.add(list(range(4, 44)))
    # a slot stops at max_context: no more tokens, marked exhausted
    for _ in range(40):
        dec.step()
    assert dec.length(a) == 40 and a in dec.exhausted and a not in dec.step()


def test_batched_q4_is_batch_invariant(q4_artifact) -> None:  # noqa: ANN001
    """Q4 weights: the quantized matmul sees b rows instead of one; the tokens do not move."""
    engine = make_engine(q4_artifact, "mlx")
    prompts = _prompts()
    want = [generate(engine, p, max_new_tokens=N).tokens for p in prompts]
    assert _run(BatchDecoder(engine, max_batch=4, max_context=64), prompts, [0, 1, 3]) == want


def test_attention_span_follows_the_longest_row(qwen3_artifact) -> None:  # noqa: ANN001
    """The plain path reads only the blocks covering the longest fed row's position rounded up
    to 256 (not the reserved context): with a context of 700 the short sequences here run with
    tables of 256 positions, a row grown past 256 moves the batch to 512, and every sequence's
    tokens stay generate's."""
    engine = make_engine(qwen3_artifact, "mlx")
    prompts = _prompts() + [[int(t) for t in np.random.default_rng(5).integers(4, 384, 250)]]
    want = [generate(engine, p, max_new_tokens=N).tokens for p in prompts]
    dec = BatchDecoder(engine, max_batch=4, max_context=700)
    assert dec.row_blocks * BLOCK == 704
    spans: list[int] = []
    table = dec._block_table  # noqa: SLF001 - the table each step is called with

    def record(feed: list[int]):  # noqa: ANN202
        t = table(feed)
        spans.append(t.shape[1] * BLOCK)
        return t

    dec._block_table = record  # type: ignore[method-assign]  # noqa: SLF001
    assert _run(dec, prompts, [0, 1, 3, 6]) == want
    if engine.fast.program.kernels:  # the CUDA attention kernel reads each row's own length
        assert set(spans) == {704}
    else:
        assert spans[0] == 256 and 512 in spans and max(spans) == 512


def test_rows_leave_and_join_between_queued_steps(qwen3_artifact) -> None:  # noqa: ANN001
    """The batched step is pipelined (the next step is queued before this one's tokens are
    read): a sequence that leaves drops the token queued for it, and a new one added into its
    slot before the next step gets its own tokens, among greedy and host-sampled rows alike."""
    engine = make_engine(qwen3_artifact, "mlx")
    prompts = _prompts() + [[7, 8, 9, 10]]
    opts = SamplingOptions(temperature=0.7, seed=4)
    want = [generate(engine, p, max_new_tokens=N).tokens for p in prompts]
    sampled = generate(engine, prompts[3], max_new_tokens=N, sampling=opts,
                       device_sampling=False).tokens
    dec = BatchDecoder(engine, max_batch=2, max_context=64)
    got: dict[int, list[int]] = {}
    seq_of: dict[int, int] = {}  # slot -> index into the sequences below
    queue = [(0, None), (1, None), (2, None), (3, opts), (3, None)]
    while queue or seq_of:
        while queue and len(seq_of) < 2:  # joins the moment a slot is free
            k, o = queue.pop(0)
            slot = dec.add(prompts[k], o)
            seq_of[slot] = len(got)
            got[len(got)] = []
        for slot, token in dec.step().items():
            got[seq_of[slot]].append(token)
            if len(got[seq_of[slot]]) == N:
                dec.remove(slot)
                del seq_of[slot]
    assert [got[i] for i in range(5)] == want[:3] + [sampled, want[3]]


@pytest.mark.parametrize("family", ["qwen3", "llama", "gemma3_text", "phi3"])
@pytest.mark.parametrize("engine_name", ["mlx", "onnxruntime"])
def test_rows_sharing_a_cached_prefix_equal_their_solo_runs(family: str, engine_name: str,
                                                            family_models) -> None:  # noqa: ANN001
    """Prompts that share a long prefix (a system prompt; a follow-up turn of a finished
    sequence), joining while others decode: each row's greedy tokens are its solo run's.
    MLX shares the prefix's blocks by reference (a running row's included); onnxruntime
    reuses a freed slot's cache. Sliding-window families (gemma3, phi3) read a window of the
    shared blocks."""
    engine = make_engine(family_models[family][1], engine_name)
    rng = np.random.default_rng(9)
    system = [int(t) for t in rng.integers(4, 384, 70)]
    prompts = [system + [int(t) for t in rng.integers(4, 384, n)] for n in (3, 9)]
    want = [generate(engine, p, max_new_tokens=N).tokens for p in prompts]
    follow = prompts[0] + want[0][:4] + [17, 18]
    want.append(generate(engine, follow, max_new_tokens=N).tokens)
    dec = BatchDecoder(engine, max_batch=2, max_context=128)
    got = _run(dec, prompts, [0, 3])
    # the follow-up turn comes once both finished; it shares the first one's tokens
    got += _run(dec, [follow], [0])
    assert got == want
    # the system prompt from the running first row (MLX only), the follow-up's shared turn
    assert dec.reused_tokens == (70 if engine_name == "mlx" else 0) + len(prompts[0]) + 4


@pytest.mark.parametrize("engine_name", ["mlx", "onnxruntime"])
def test_a_constrained_row_beside_free_ones(engine_name: str, qwen3_artifact) -> None:  # noqa: ANN001
    """A row constrained by a JSON schema decodes a valid document and ends (EOS) while the
    greedy rows beside it decode their solo tokens; the same through `generate`."""
    import json

    from fuselm.runtime_metal.constraint import (
        TokenConstraint,
        constraint_vocab,
        json_schema_grammar,
    )
    from fuselm.runtime_metal.tokenizer import load_tokenizer

    engine = make_engine(qwen3_artifact, engine_name)
    tok = load_tokenizer(qwen3_artifact)
    vocab = constraint_vocab(tok, engine.manifest.model.vocab_size, [2])
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                     "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    grammar = json_schema_grammar(schema)
    prompts = _prompts()
    want = [generate(engine, p, max_new_tokens=N).tokens for p in prompts]
    dec = BatchDecoder(engine, max_batch=4, max_context=96)
    free = [dec.add(p) for p in prompts]
    shaped = dec.add(prompts[0], SamplingOptions(), constraint=TokenConstraint(vocab, grammar))
    got: dict[int, list[int]] = {s: [] for s in [*free, shaped]}
    for _ in range(N):
        for slot, token in dec.step().items():
            got[slot].append(token)
    assert [got[s] for s in free] == want
    ids = got[shaped][:got[shaped].index(2)]
    assert json.loads(tok.decode(ids))["n"] in range(10)
    alone = generate(engine, prompts[0], max_new_tokens=N, eos_ids=[2],
                     constraint=TokenConstraint(vocab, grammar))
    assert alone.tokens == ids and alone.stop_reason == "eos"


def test_masks_filled_together_equal_each_rows_own(qwen3_artifact) -> None:  # noqa: ANN001
    """fill_masks (several grammars on llguidance's threads, or row by row) writes the same
    bits as each constraint's own fill, rows in any order, grammars in different states; rows
    it is not given stay as they were."""
    from fuselm.runtime_metal.constraint import (
        TokenConstraint,
        constraint_vocab,
        fill_masks,
        json_schema_grammar,
    )
    from fuselm.runtime_metal.tokenizer import load_tokenizer

    engine = make_engine(qwen3_artifact, "mlx")
    tok = load_tokenizer(qwen3_artifact)
    n_vocab = engine.manifest.model.vocab_size
    vocab = constraint_vocab(tok, n_vocab, [2])
    schemas = [{"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
               {"type": "array", "items": {"enum": ["a", "bb"]}},
               {"type": "string", "pattern": "^[xy]{2,5}$"}]
    rng = np.random.default_rng(0)
    rows = []
    for k, schema in enumerate(schemas):  # grammar k moved on by k tokens its masks allow
        c = TokenConstraint(vocab, json_schema_grammar(schema))
        for _ in range(k):
            c.advance(int(np.argmax(c.mask(rng.standard_normal(n_vocab).astype(np.float32)))))
        rows.append(c)
    words = (n_vocab + 31) // 32
    own = np.zeros((3, words), np.int32)
    for r, c in enumerate(rows):
        c.fill(own[r])
    for threads in (2, 1):
        together = np.full((4, words), 7, np.int32)
        fill_masks([(rows[2], 0), (rows[0], 3), (rows[1], 1)], together, threads=threads)
        assert (together[[3, 1, 0]] == own).all()
        assert (together[2] == 7).all()
    assert len({own[r].tobytes() for r in range(3)}) == 3  # three different masks compared


def test_padded_prefill_equals_the_prompts_own(qwen3_artifact) -> None:  # noqa: ANN001
    """The batch decoder's prefill pads a prompt to a few widths (one compiled trace each): its
    logits, and the next decode step's over the cache it wrote, equal the unpadded prefill's;
    the dummies stay out of the cache's length."""
    engine = make_engine(qwen3_artifact, "mlx")
    rng = np.random.default_rng(3)
    assert [padded_width(n) for n in (1, 16, 17, 40, 130)] == [16, 16, 32, 48, 144]
    for n in (1, 11, 17, 40):
        ids = rng.integers(4, 384, size=n)
        runs = []
        for pad in (False, True):
            engine.swap_cache(None)
            engine.reserve(128)
            first = engine.prefill_padded(ids, padded_width(n)) if pad else engine.forward(
                ids[None])
            assert engine.offset == n
            nxt = np.array(engine.decode_step(int(first.argmax())))
            runs.append((first, nxt))
        (want, want_next), (got, got_next) = runs
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got_next, want_next, rtol=1e-5, atol=1e-5)


def test_a_reused_prefixs_rest_is_padded_and_traced_once_per_width(qwen3_artifact) -> None:  # noqa: ANN001
    """Prompts that share a prefix (a system prompt, a chat template's header) and differ in
    length: the decoder takes the prefix from its cache and, on a GPU, pads the rest from the
    multiple of 16 before it, so rests of several lengths share one compiled trace (the
    program's Python runs only when it traces) and every prompt decodes generate's tokens."""
    engine = make_engine(qwen3_artifact, "mlx")
    rng = np.random.default_rng(5)
    head = [int(t) for t in rng.integers(4, 384, size=21)]
    prompts = [head + [int(t) for t in rng.integers(4, 384, size=n)] for n in (3, 6, 9, 4)]
    want = [generate(engine, p, max_new_tokens=4).tokens for p in prompts]
    dec = BatchDecoder(engine, max_batch=2, max_context=96)
    dec.pad_after_prefix = True  # a GPU's default (this test runs on any device)
    program = engine.fast.program
    run, calls = program.run, []
    program.run = lambda *a, **k: calls.append(a[0].shape) or run(*a, **k)
    try:
        got = []
        for p in prompts:
            slot = dec.add(p)
            tokens = []
            while len(tokens) < 4:
                tokens += [t for s, t in dec.step().items() if s == slot]
            dec.remove(slot)
            got.append(tokens)
            if len(got) == 1:
                calls.clear()  # the first prompt's own traces (fresh prefill, decode step)
    finally:
        del program.run
    assert got == want
    assert dec.reused_tokens == 3 * len(head)  # the blocks of the head, by reference
    assert calls == [(16,)]  # the rests (21 + n from 16: 8..14 tokens) in one width


def test_padded_prefill_after_a_prefix_equals_the_rests_own(qwen3_artifact) -> None:  # noqa: ANN001
    """A chunk padded after cached positions (FastDecoder.prefill_padded at an offset): its
    logits and the next step's equal the unpadded chunk's; the dummies stay out."""
    engine = make_engine(qwen3_artifact, "mlx")
    rng = np.random.default_rng(6)
    head = rng.integers(4, 384, size=16)
    for n in (1, 9, 23):
        rest = rng.integers(4, 384, size=n)
        runs = []
        for pad in (False, True):
            engine.swap_cache(None)
            engine.reserve(128)
            engine.forward(head[None])
            first = engine.prefill_padded(rest, padded_width(n)) if pad else engine.forward(
                rest[None])
            assert engine.offset == 16 + n
            runs.append((first, np.array(engine.decode_step(int(first.argmax())))))
        (want, want_next), (got, got_next) = runs
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got_next, want_next, rtol=1e-5, atol=1e-5)
