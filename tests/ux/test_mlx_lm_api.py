"""The Python API in the shapes mlx-lm users type: `model, tokenizer = load(path)`,
`generate(...)` returning text, `stream_generate(...)` yielding responses with text, token,
logprobs and timing; explicit keyword parameters; `dir(fuselm)` lists the public names."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import fuselm
from fuselm.runtime_metal.errors import RuntimeUserError
from fuselm.runtime_metal.generate import prefill


@pytest.fixture(scope="module")
def loaded(artifact: Path) -> tuple[fuselm.Model, object]:
    return fuselm.load(artifact, engine="onnxruntime")


def test_load_unpacks_as_model_and_tokenizer(loaded: tuple, artifact: Path) -> None:
    model, tokenizer = loaded
    assert isinstance(model, fuselm.Model) and model.path == artifact
    assert tokenizer is model.tokenizer


def test_generate_returns_the_text_of_the_stream(loaded: tuple) -> None:
    model, tokenizer = loaded
    text = fuselm.generate(model, tokenizer, "Hello", max_tokens=12)
    responses = list(fuselm.stream_generate(model, tokenizer, "Hello", max_tokens=12))
    reply = model.generate("Hello", max_tokens=12)
    assert isinstance(text, str) and text == "".join(r.text for r in responses) == reply.text
    # one response per token, then the closing one repeating the last (as mlx-lm)
    assert [r.token for r in responses[:-1]] == reply.tokens
    assert responses[-1].token == reply.tokens[-1]
    assert [r.finish_reason for r in responses] == [None] * len(reply.tokens) + ["length"]
    assert [r.generation_tokens for r in responses[:-1]] == list(range(1, 13))
    last = responses[-1]
    assert last.prompt_tokens == len(model.encode("Hello"))
    assert last.prompt_tps > 0 and last.generation_tps > 0 and last.peak_memory > 0


def test_logprobs_are_the_log_softmax_of_the_step(loaded: tuple) -> None:
    """Asked for (logprobs=True), each response carries its step's log-softmax; else None
    (sampling stays on the device loop). With logit_bias the logprobs are of the biased
    logits (what OpenAI's logprobs show), not of temperature's."""
    model, tokenizer = loaded
    plain = list(fuselm.stream_generate(model, tokenizer, "Hello", max_tokens=3))
    assert all(r.logprobs is None for r in plain)
    first = next(iter(fuselm.stream_generate(model, tokenizer, "Hello", max_tokens=3,
                                             logprobs=True)))
    ids = model.encode("Hello")
    model.engine.reset()
    logits = np.asarray(prefill(model.engine, ids), np.float64)
    want = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
    assert first.logprobs is not None
    assert first.logprobs.shape == (model.manifest.model.vocab_size,)
    np.testing.assert_allclose(first.logprobs, want, atol=1e-4)
    assert first.token == int(np.argmax(first.logprobs)) == plain[0].token  # greedy
    biased = logits.copy()
    biased[7] += 30.0
    want = biased - np.log(np.exp(biased - biased.max()).sum()) - biased.max()
    responses = list(fuselm.stream_generate(model, tokenizer, "Hello", max_tokens=2,
                                            logprobs=True, temperature=0.7, seed=1,
                                            logit_bias={7: 30.0}))
    np.testing.assert_allclose(responses[0].logprobs, want, atol=1e-4)


def test_stop_string_finishes_with_stop(loaded: tuple) -> None:
    model, tokenizer = loaded
    sampled = {"temperature": 1.0, "seed": 2}  # a random model's greedy text is newlines
    reply = model.generate("Hello", max_tokens=12, **sampled)
    stop = reply.text[3:5]
    assert len(stop) == 2 and reply.text.index(stop) > 0, reply.text
    responses = list(fuselm.stream_generate(model, tokenizer, "Hello", max_tokens=12,
                                            stop=[stop], **sampled))
    assert responses[-1].finish_reason == "stop"
    assert "".join(r.text for r in responses) == reply.text[:reply.text.index(stop)]


def test_sampling_keywords_are_explicit_and_honoured(loaded: tuple) -> None:
    model, tokenizer = loaded
    for fn in (fuselm.generate, fuselm.stream_generate, fuselm.Model.generate):
        params = inspect.signature(fn).parameters
        assert not any(p.kind is p.VAR_KEYWORD for p in params.values()), fn
        assert {"max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                "presence_penalty", "frequency_penalty", "logit_bias", "seed",
                "stop"} <= set(params), fn
    greedy = fuselm.generate(model, tokenizer, "Hello", max_tokens=8)
    assert fuselm.generate(model, tokenizer, "Hello", max_tokens=8, temperature=2.0,
                           min_p=1.0, seed=3) == greedy
    a, b = (fuselm.generate(model, tokenizer, "Hello", max_tokens=8, temperature=1.5, seed=s)
            for s in (1, 1))
    assert a == b
    forced = model.generate("Hello", max_tokens=4, logit_bias={42: 100.0})
    assert forced.tokens == [42] * 4
    penalized = model.generate("Hello", max_tokens=8, frequency_penalty=2.0,
                               presence_penalty=2.0)
    assert len(set(penalized.tokens)) > len(set(model.generate("Hello", max_tokens=8).tokens))
    with pytest.raises(RuntimeUserError, match="vocabulary"):
        model.generate("Hello", max_tokens=2, logit_bias={10**6: 1.0})


def test_another_tokenizer_is_refused(loaded: tuple) -> None:
    model, _ = loaded
    with pytest.raises(fuselm.converter.errors.UserError, match="tokenizer fuselm.load"):
        fuselm.generate(model, object(), "Hello", max_tokens=2)


def test_dir_lists_the_public_names_and_import_stays_light() -> None:
    assert set(fuselm.__all__) <= set(dir(fuselm))
    assert {"load", "generate", "stream_generate", "GenerationResponse"} <= set(fuselm.__all__)
    code = ("import sys, fuselm; dir(fuselm); "
            "print(sorted(m for m in ('torch', 'onnxruntime', 'mlx', 'transformers') "
            "if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "[]", r.stderr


def test_one_stop_string_is_one_stop_string(loaded: tuple) -> None:
    """`stop="ab"` is the one stop string "ab", as OpenAI's `stop` takes it (a string or a
    list), never the characters "a" and "b"."""
    model, tokenizer = loaded
    sampled = {"temperature": 1.0, "seed": 2}  # a random model's greedy text is newlines
    text = model.generate("Hello", max_tokens=12, **sampled).text
    # two characters, the first seen before them: its characters would stop the reply earlier
    at = next(k for k in range(1, len(text) - 1)
              if text[k] in text[:k] and text.index(text[k:k + 2]) == k
              and text[k:k + 2].isprintable() and "\ufffd" not in text[k:k + 2])
    stop, want = text[at:at + 2], text[:at]
    assert model.generate("Hello", max_tokens=12, stop=stop, **sampled).text == want
    assert "".join(model.stream("Hello", max_tokens=12, stop=stop, **sampled)) == want
    assert fuselm.generate(model, tokenizer, "Hello", max_tokens=12, stop=stop,
                           **sampled) == want


@pytest.mark.parametrize("max_tokens", [0, -1])
def test_max_tokens_below_one_is_refused(loaded: tuple, max_tokens: int) -> None:
    """mlx-lm reads max_tokens=-1 as "no limit"; here a count below 1 is refused by name
    rather than answered with an empty reply."""
    model, tokenizer = loaded
    for call in (lambda: model.generate("Hello", max_tokens=max_tokens),
                 lambda: fuselm.generate(model, tokenizer, "Hello", max_tokens=max_tokens),
                 lambda: list(model.stream("Hello", max_tokens=max_tokens))):
        with pytest.raises(fuselm.converter.errors.UserError, match="max_tokens"):
            call()


@pytest.mark.parametrize("prompt", [[{"role": "user"}], [1.5, 2], [{"role": "user",
                                                                    "content": 3}], ["hi"]])
def test_a_malformed_prompt_is_one_user_error(loaded: tuple, prompt: list) -> None:
    """A prompt that is neither text, token ids nor chat messages is refused saying what a
    prompt is (not a KeyError or AttributeError from inside)."""
    model, _ = loaded
    with pytest.raises(fuselm.converter.errors.UserError, match="prompt"):
        model.generate(prompt, max_tokens=2)


def test_an_option_of_the_other_engine_is_refused_by_name(artifact: Path) -> None:
    """fuselm.load(path, engine=E, **options): an option E's engine does not take is one
    RuntimeUserError naming it (not a TypeError from inside the engine's constructor)."""
    for engine, option in (("mlx", {"accuracy_level": 0}), ("onnxruntime", {"fast": False}),
                           ("onnxruntime", {"kv_bits": 8})):
        with pytest.raises(RuntimeUserError, match=next(iter(option)).replace("_", ".")):
            fuselm.load(artifact, engine=engine, **option).generate("hi", max_tokens=1)
