"""Logprobs, n > 1, presence/frequency penalties and logit_bias through `fuselm serve` with the
official openai client, on both engines (MLX: one batched step; onnxruntime: its rows): the
logprobs are the engine's (the Python API's log-softmax for the same prefix), streaming equals
the whole response, n choices share one prompt and a seed makes them reproducible, and a row
asking for logprobs or n choices leaves the greedy text of rows beside it as it is alone."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

import fuselm
from tests.serve.conftest import MODEL, Server
from tests.serve.test_serve_params import IDS, PROMPT, N, run_json


@pytest.fixture(scope="module")
def reference(serve_artifact: Path) -> fuselm.Model:
    return fuselm.load(serve_artifact, engine="onnxruntime")


def _chat(srv: Server, **kw: object):  # noqa: ANN202
    return srv.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=N, **kw)


def test_completion_logprobs_are_the_engines(any_server: Server, reference: fuselm.Model
                                             ) -> None:
    r = any_server.client().completions.create(model=MODEL, prompt=IDS, max_tokens=N,
                                               temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    steps = list(fuselm.stream_generate(reference, reference.tokenizer, IDS, max_tokens=N,
                                        logprobs=True))[:-1]
    tokens = [s.token for s in steps]
    assert len(lp.tokens) == len(tokens) == r.usage.completion_tokens
    decode = reference.tokenizer.decode
    assert lp.tokens == [decode([t], skip_special_tokens=True) for t in tokens]
    assert "".join(lp.tokens) == r.choices[0].text
    offset = 0
    for k, step in enumerate(steps):
        assert lp.token_logprobs[k] == pytest.approx(float(step.logprobs[step.token]), abs=2e-4)
        top = list(lp.top_logprobs[k].items())
        assert top[0][0] == lp.tokens[k]  # greedy: the likeliest
        assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
        assert top[0][1] == pytest.approx(float(step.logprobs.max()), abs=2e-4)
        assert lp.text_offset[k] == offset
        offset += len(lp.tokens[k])


def test_chat_logprobs_streamed_as_whole(any_server: Server) -> None:
    whole = _chat(any_server, temperature=0, logprobs=True, top_logprobs=2)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens - (
        whole.choices[0].finish_reason == "stop")
    for item in content:
        assert item.bytes == list(item.token.encode())
        assert len(item.top_logprobs) == 2 and item.top_logprobs[0].token == item.token
        assert item.top_logprobs[0].logprob == item.logprob >= item.top_logprobs[1].logprob
    streamed = [item for chunk in _chat(any_server, temperature=0, logprobs=True,
                                        top_logprobs=2, stream=True)
                if chunk.choices and chunk.choices[0].logprobs
                for item in chunk.choices[0].logprobs.content]
    # the same tokens; the logprobs to float rounding (the second request's prompt comes
    # from the prefix cache, prefilled in other chunks)
    assert [i.token for i in streamed] == [i.token for i in content]
    assert [i.logprob for i in streamed] == pytest.approx([i.logprob for i in content],
                                                          abs=1e-4)
    assert _chat(any_server, temperature=0).choices[0].logprobs is None


def test_completion_logprobs_streamed_as_whole(server: Server) -> None:
    client = server.client()
    whole = client.completions.create(model=MODEL, prompt=IDS, max_tokens=N, logprobs=0,
                                      temperature=0).choices[0].logprobs
    assert whole.top_logprobs == [{}] * len(whole.tokens)
    parts = [c.choices[0].logprobs for c in client.completions.create(
        model=MODEL, prompt=IDS, max_tokens=N, logprobs=0, temperature=0, stream=True)
        if c.choices and c.choices[0].logprobs]
    assert sum((p.tokens for p in parts), []) == whole.tokens
    assert sum((p.text_offset for p in parts), []) == whole.text_offset
    assert sum((p.token_logprobs for p in parts), []) == pytest.approx(whole.token_logprobs,
                                                                        abs=1e-4)


def test_n_choices(any_server: Server) -> None:
    """n=3 greedy: three equal choices, the n=1 reply; seeded: the same three again, not all
    equal; streamed: each index's text is the whole response's."""
    one = _chat(any_server, temperature=0)
    three = _chat(any_server, temperature=0, n=3)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert [c.message.content for c in three.choices] == [one.choices[0].message.content] * 3
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    if any_server.engine == "mlx":  # the prompt prefilled once: the other two share it whole
        p = three.usage.prompt_tokens
        lines = [ln for ln in any_server.log.read_text().splitlines() if three.id in ln]
        assert len(lines) == 3
        assert sum(f"prompt {p} tok (cached {p})" in ln for ln in lines) == 2, lines
    seeded = [[c.message.content for c in _chat(any_server, temperature=1.0, seed=5,
                                                 n=3).choices] for _ in range(2)]
    assert seeded[0] == seeded[1] and len(set(seeded[0])) > 1
    texts = ["", "", ""]
    for chunk in _chat(any_server, temperature=1.0, seed=5, n=3, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == seeded[0]


def test_logit_bias_and_penalties(server: Server, reference: fuselm.Model) -> None:
    client = server.client()
    forced = client.completions.create(model=MODEL, prompt=IDS, max_tokens=4, temperature=0,
                                       logprobs=0, logit_bias={"42": 100})
    assert forced.choices[0].logprobs.tokens == [reference.tokenizer.decode([42])] * 4
    ids = ",".join(map(str, IDS))
    got = client.completions.create(model=MODEL, prompt=IDS, max_tokens=N, temperature=0,
                                    presence_penalty=0.5, frequency_penalty=1.5,
                                    logit_bias={"40": -2}).choices[0].text
    want = run_json(server, "--prompt-ids", ids, "--presence-penalty", "0.5",
                    "--frequency-penalty", "1.5", "--logit-bias", "40=-2")["text"]
    assert got == want
    assert got != client.completions.create(model=MODEL, prompt=IDS, max_tokens=N,
                                            temperature=0).choices[0].text


@pytest.mark.parametrize(("path", "body", "param"), [
    ("chat", {"logit_bias": {"99999": 1}}, "logit_bias"),
    ("chat", {"logit_bias": {"x": 1}}, "logit_bias"),
    ("completions", {"logit_bias": {"5": 200}}, "logit_bias"),
    ("chat", {"presence_penalty": 3}, "presence_penalty"),
    ("completions", {"frequency_penalty": -2.5}, "frequency_penalty"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("completions", {"logprobs": 21}, "logprobs"),
    ("chat", {"n": 0}, "n"), ("completions", {"n": 17}, "n"),
])
def test_bad_sampling_parameters_refused(server: Server, path: str, body: dict, param: str
                                         ) -> None:
    base = ({"messages": [{"role": "user", "content": "hi"}]} if path == "chat"
            else {"prompt": "hi"})
    url = server.url + ("/v1/chat/completions" if path == "chat" else "/v1/completions")
    r = httpx.post(url, json={"model": MODEL, "max_tokens": 2, **base, **body}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_logprob_and_n_rows_keep_their_neighbours_greedy(any_server: Server) -> None:
    """Three requests at once, one with logprobs, one with n=2, one plain: every text is the
    one its prompt gets alone."""
    client = any_server.client()
    prompts = [IDS, IDS[:4] + [20, 21], [30, 31, 32]]

    def ask(k: int, **kw: object) -> list[str]:
        r = client.completions.create(model=MODEL, prompt=prompts[k], max_tokens=N,
                                      temperature=0, **kw)
        return [c.text for c in r.choices]

    solo = [ask(k)[0] for k in range(3)]
    with ThreadPoolExecutor(3) as pool:
        jobs = [pool.submit(ask, 0, logprobs=2), pool.submit(ask, 1, n=2), pool.submit(ask, 2)]
        got = [j.result() for j in jobs]
    assert got == [[solo[0]], [solo[1]] * 2, [solo[2]]]


def test_logprob_bytes_are_the_tokens_own(smol_server: Server) -> None:
    """A token holding part of a UTF-8 character decodes alone to U+FFFD; its `bytes` are its
    own bytes all the same (OpenAI's: joined in order they make the reply's text), not those
    of U+FFFD."""
    r = smol_server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "日本の首都は"}], max_tokens=12,
        temperature=0, logprobs=True, top_logprobs=2)
    items = r.choices[0].logprobs.content
    assert any(i.token == "\ufffd" for i in items)  # the case this is about
    joined = b"".join(bytes(i.bytes) for i in items)
    assert joined.decode("utf-8", "replace") == r.choices[0].message.content
    for item in items:
        for alt in item.top_logprobs:
            assert alt.bytes != list("\ufffd".encode()) or alt.token != "\ufffd"


def _legacy_bytes(token: str) -> bytes:
    """A legacy completions token's bytes: its text, or "bytes:\\xe3\\x82" (OpenAI's)."""
    if token.startswith("bytes:"):
        return bytes.fromhex(token.removeprefix("bytes:").replace("\\x", ""))
    return token.encode()


def test_completion_logprob_tokens_and_offsets_are_exact(smol_server: Server) -> None:
    """A token holding part of a UTF-8 character is named by its bytes (OpenAI's
    "bytes:\\xe3\\x82"), not U+FFFD: the tokens joined are the reply's text, each text_offset
    is where its token's character starts, two such alternatives keep two keys; streamed the
    same."""
    client = smol_server.client()
    kw = dict(model=MODEL, prompt="日本の首都は", max_tokens=12, temperature=0, logprobs=2)
    r = client.completions.create(**kw)
    text, lp = r.choices[0].text, r.choices[0].logprobs
    assert any(t.startswith("bytes:") for t in lp.tokens)  # the case this is about
    assert "\ufffd" not in "".join(lp.tokens) + "".join(k for d in lp.top_logprobs for k in d)
    raw = b"".join(_legacy_bytes(t) for t in lp.tokens)
    assert raw.decode("utf-8", "replace") == text
    for k, token in enumerate(lp.tokens):
        before = b"".join(_legacy_bytes(t) for t in lp.tokens[:k])
        assert lp.text_offset[k] == len(before.decode("utf-8", "ignore"))
        assert text[lp.text_offset[k]:].encode().startswith(_legacy_bytes(token)) or (
            token.startswith("bytes:"))
        assert all(len(d) == 2 for d in lp.top_logprobs)
    parts = [c.choices[0].logprobs for c in client.completions.create(stream=True, **kw)
             if c.choices and c.choices[0].logprobs]
    assert sum((p.tokens for p in parts), []) == lp.tokens
    assert sum((p.text_offset for p in parts), []) == lp.text_offset
