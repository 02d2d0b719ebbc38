"""The logits processors and logprobs (runtime_metal/sampling.py) and the per-row sampling of
the batch decoder (runtime_metal/batch.py): OpenAI's presence and frequency penalties and
logit_bias change the logits exactly as their formulas say; a row's logprobs are the
log-softmax of the engine's logits for its prefix, and a row asking for them, among rows that
do not, keeps everyone's greedy tokens; n choices from one prompt (`fork`) share its prefill;
top-k and min-p rows under batching."""

from __future__ import annotations

import numpy as np
import pytest

from fuselm.runtime_metal.batch import BatchDecoder
from fuselm.runtime_metal.engine import make_engine
from fuselm.runtime_metal.errors import RuntimeUserError
from fuselm.runtime_metal.generate import generate
from fuselm.runtime_metal.sampling import (
    SamplingOptions,
    parse_logit_bias,
    process_logits,
    token_logprobs,
)

N = 8
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]


def reference(logits: np.ndarray, prompt: list[int], generated: list[int],
              opts: SamplingOptions) -> np.ndarray:
    """The formulas, written out: HF's repetition penalty over prompt and reply, then OpenAI's
    mu[j] - c[j] * frequency - (c[j] > 0) * presence over the reply, then logit_bias."""
    z = logits.astype(np.float64).copy()
    for t in set(prompt + generated):
        z[t] = z[t] / opts.repetition_penalty if z[t] > 0 else z[t] * opts.repetition_penalty
    for t in set(generated):
        z[t] -= generated.count(t) * opts.frequency_penalty + opts.presence_penalty
    for t, bias in opts.logit_bias:
        z[t] += bias
    return z


def test_processors_follow_the_formulas() -> None:
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, 64).astype(np.float32)
    prompt, generated = [1, 2, 3, 3], [3, 9, 9, 9, 4, 2]
    opts = SamplingOptions(repetition_penalty=1.3, presence_penalty=0.7, frequency_penalty=-0.4,
                           logit_bias=((9, 5.0), (60, -100.0)))
    before = logits.copy()
    got = process_logits(logits, prompt + generated, generated, opts)
    np.testing.assert_allclose(got, reference(logits, prompt, generated, opts), rtol=1e-6)
    assert np.array_equal(logits, before)  # the engine's logits are left as they were
    # nothing on: the logits as they are
    assert process_logits(logits, prompt, [], SamplingOptions()) is logits
    # logprobs: the processed logits' log-softmax; alternatives likeliest first
    lp = token_logprobs(got, 9, 4)
    want = got.astype(np.float64) - np.log(np.exp(got.astype(np.float64)).sum())
    assert lp.logprob == pytest.approx(want[9], abs=1e-5)
    assert [t for t, _ in lp.top] == list(np.argsort(-want)[:4])
    assert [v for _, v in lp.top] == pytest.approx(sorted(want)[::-1][:4], abs=1e-5)


@pytest.mark.parametrize(("bias", "message"), [
    ({"x": 1}, "not a token id"), ({"5": 101}, r"\[-100, 100\]"), ({"-1": 1}, "negative")])
def test_bad_logit_bias_refused(bias: dict, message: str) -> None:
    with pytest.raises(RuntimeUserError, match=message):
        SamplingOptions(logit_bias=parse_logit_bias(bias)).validate()  # type: ignore[arg-type]
    with pytest.raises(RuntimeUserError, match="presence penalty"):
        SamplingOptions(presence_penalty=2.5).validate()


def _collect(dec: BatchDecoder, slots: list[int], n: int = N) -> dict[int, list[int]]:
    got: dict[int, list[int]] = {s: [] for s in slots}
    lps: dict[int, list] = {s: [] for s in slots}
    while any(len(v) < n for v in got.values()):
        for slot, token in dec.step().items():
            if slot in got and len(got[slot]) < n:
                got[slot].append(token)
                lps[slot].append(dec.logprobs(slot))
    dec.last_logprobs = lps  # type: ignore[attr-defined]
    return got


@pytest.mark.parametrize("engine_name", ["mlx", "onnxruntime"])
def test_logprob_row_among_greedy_rows(engine_name: str, qwen3_artifact) -> None:  # noqa: ANN001
    """Row a asks for logprobs (5 alternatives), rows b and c do not (b greedy, c top-k 1 and
    min-p 1 at temperature 1.5: greedy too): every row's tokens are its solo greedy run's, and
    a's logprobs are the log-softmax of the engine's logits for each prefix."""
    engine = make_engine(qwen3_artifact, engine_name)
    prompts = [PROMPT, PROMPT[:6], [30, 31, 32, 33]]
    want = [generate(engine, p, max_new_tokens=N).tokens for p in prompts]
    dec = BatchDecoder(engine, max_batch=3, max_context=64)
    a = dec.add(prompts[0], None, top_logprobs=5)
    b = dec.add(prompts[1])
    c = dec.add(prompts[2], SamplingOptions(temperature=1.5, top_k=1, seed=1))
    got = _collect(dec, [a, b, c])
    assert [got[a], got[b], got[c]] == want
    assert dec.logprobs(b) is None
    engine.reset()
    logits = engine.forward(np.array([prompts[0] + want[0][:-1]]), all_logits=True)
    ref = logits[len(prompts[0]) - 1:].astype(np.float64)
    ref -= np.log(np.exp(ref - ref.max(-1, keepdims=True)).sum(-1, keepdims=True)) + ref.max(
        -1, keepdims=True)
    for k, info in enumerate(dec.last_logprobs[a]):  # type: ignore[attr-defined]
        assert info.token == want[0][k]
        assert info.logprob == pytest.approx(ref[k, info.token], abs=1e-4)
        assert [t for t, _ in info.top][0] == info.token  # greedy: the likeliest
        values = [v for _, v in info.top]
        assert len(values) == 5 and values == sorted(values, reverse=True)
        np.testing.assert_allclose(values, ref[k, [t for t, _ in info.top]], atol=1e-4)
    for slot in (a, b, c):
        dec.remove(slot)
    c = dec.add(prompts[2], SamplingOptions(temperature=1.5, min_p=1.0, seed=2))
    assert _collect(dec, [c])[c] == want[2]


@pytest.mark.parametrize("engine_name", ["mlx", "onnxruntime"])
def test_forked_choices(engine_name: str, family_models) -> None:  # noqa: ANN001
    """n choices from one prompt: greedy ones all equal the solo run; seeded ones are the same
    on a second decoder and differ from each other; the prompt is prefilled once (MLX: the
    forks take its blocks by reference; onnxruntime's rows: a copy of its row; Llama's head_dim
    16 is one the row lowering takes). A greedy row with logprobs keeps MLX's step pipelined (its
    logprobs come from the device: no row's logits go to the host) and agrees with a fork that
    takes them on the host (a top-k 1 row)."""
    engine = make_engine(family_models["llama"][1], engine_name)
    want = generate(engine, PROMPT, max_new_tokens=N).tokens
    dec = BatchDecoder(engine, max_batch=4, max_context=64)
    assert dec.mode == ("batched" if engine_name == "mlx" else "rows")
    first = dec.add(PROMPT, None, top_logprobs=3)
    forks = [dec.fork(first), dec.fork(first, SamplingOptions(temperature=1.0, top_k=1),
                                       top_logprobs=3)]
    got = _collect(dec, [first, *forks])
    assert list(got.values()) == [want] * 3
    device, host = (dec.last_logprobs[s] for s in (first, forks[1]))  # type: ignore[attr-defined]
    assert [d.token for d in device] == [h.token for h in host] == want
    assert [d.logprob for d in device] == pytest.approx([h.logprob for h in host], abs=1e-4)
    assert [[t for t, _ in d.top] for d in device] == [[t for t, _ in h.top] for h in host]
    dec.remove(forks[1])
    dec.step()
    if engine_name == "mlx":
        assert dec._inflight is not None and dec._inflight.logits is None  # noqa: SLF001
    assert dec.reused_tokens == 2 * len(PROMPT)
    for slot in (first, forks[0]):
        dec.remove(slot)
    with pytest.raises(RuntimeUserError, match="fork"):
        dec.fork(first)

    def seeded() -> list[list[int]]:
        d = BatchDecoder(engine, max_batch=3, max_context=64)
        s = [d.add(PROMPT, SamplingOptions(temperature=1.0, seed=7))]
        s += [d.fork(s[0], SamplingOptions(temperature=1.0, seed=7 + i)) for i in (1, 2)]
        out = _collect(d, s)
        return [out[i] for i in s]

    runs = seeded()
    assert runs == seeded() and len({tuple(r) for r in runs}) == 3
    # seeded choice 0 draws what a single sequence with that seed draws
    assert runs[0] == generate(engine, PROMPT, max_new_tokens=N, device_sampling=False,
                               sampling=SamplingOptions(temperature=1.0, seed=7)).tokens


@pytest.mark.parametrize("engine_name", ["mlx", "onnxruntime"])
def test_penalties_and_bias_end_to_end(engine_name: str, qwen3_artifact) -> None:  # noqa: ANN001
    """Greedy with every processor on, in a batch beside a plain greedy row: each token is the
    argmax of the formulas applied to the engine's logits for its prefix; generate agrees; a
    +100 bias forces its token."""
    engine = make_engine(qwen3_artifact, engine_name)
    opts = SamplingOptions(repetition_penalty=1.2, presence_penalty=0.6, frequency_penalty=1.5,
                           logit_bias=((11, 2.0), (40, -1.0)))
    dec = BatchDecoder(engine, max_batch=2, max_context=64)
    a = dec.add(PROMPT, opts)
    b = dec.add(PROMPT[:5])
    got = _collect(dec, [a, b])
    want_b = generate(engine, PROMPT[:5], max_new_tokens=N).tokens
    ref: list[int] = []
    for _ in range(N):
        engine.reset()
        logits = engine.forward(np.array([PROMPT + ref]))
        ref.append(int(np.argmax(reference(logits, PROMPT, ref, opts))))
    assert got[a] == ref and got[b] == want_b
    assert len(set(ref)) > 1  # the penalties moved the greedy choice off a repeated token
    assert generate(engine, PROMPT, max_new_tokens=N, sampling=opts).tokens == ref
    forced = SamplingOptions(logit_bias=((42, 100.0),))
    assert generate(engine, PROMPT, max_new_tokens=4, sampling=forced).tokens == [42] * 4
    with pytest.raises(RuntimeUserError, match="outside the model's vocabulary"):
        dec.add(PROMPT, SamplingOptions(logit_bias=((10**6, 1.0),)))


def test_session_penalty_counts_the_cached_prefix(qwen3_artifact) -> None:  # noqa: ANN001
    """A follow-up turn prefills only its new tokens, but the repetition penalty still counts
    the whole conversation: the tokens of a fresh generation over it."""
    from fuselm.runtime_metal.session import CachedSession

    def finish(gen):  # noqa: ANN001, ANN202
        while True:
            try:
                next(gen)
            except StopIteration as done:
                return done.value

    engine = make_engine(qwen3_artifact, "onnxruntime")
    opts = SamplingOptions(repetition_penalty=3.0)
    session = CachedSession(engine)
    finish(session.stream(PROMPT, max_new_tokens=1, sampling=opts))
    longer = PROMPT + [30, 31]  # only [30, 31] is prefilled
    again = finish(session.stream(longer, max_new_tokens=N, sampling=opts)).tokens
    assert session.reused == len(PROMPT)
    want = generate(engine, longer, max_new_tokens=N, sampling=opts).tokens
    assert again == want
    # the prompt's tokens are what the penalty moves here
    assert want != generate(engine, longer, max_new_tokens=N).tokens
