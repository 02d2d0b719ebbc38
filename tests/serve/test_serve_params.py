"""Which OpenAI parameters `fuselm serve` honours, which it refuses by name (HTTP 400), and the
sampling a request gets when it sets none (the model's generation_config.json, as `fuselm run`).
Everything goes through the official openai client against the shared onnxruntime server."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest
from click.testing import CliRunner

from fuselm.converter.cli.main import cli
from fuselm.converter.cli.run_cmd import sampling_from
from fuselm.runtime_metal.errors import RuntimeUserError
from fuselm.runtime_metal.sampling import SamplingOptions, sampling_defaults
from tests.serve.conftest import MODEL, Server

PROMPT = "Hello the quick brown fox"
IDS = [5, 6, 7, 8, 5, 6, 7, 8, 9, 10]
N = 12

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
# Each parameter fuselm does not implement, with a value that asks for something.
CHAT_REFUSED = {
    "functions": [TOOL["function"]], "function_call": "auto", "parallel_tool_calls": False,
    "audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "x"}, "reasoning_effort": "low",
    "store": True,
}
COMPLETION_REFUSED = {"best_of": 2, "echo": True, "suffix": "end"}


def run_json(srv: Server, *args: str) -> dict:
    """`fuselm run --json` on the server's artifact and engine, with no sampling flag but
    `args`: the same defaults the server resolves."""
    res = CliRunner().invoke(cli, ["run", str(srv.out_dir), "-n", str(N), "--engine",
                                   srv.engine, "--json", *args])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout.strip().splitlines()[-1])


def completion(srv: Server, **kw: object) -> str:
    r = srv.client().completions.create(model=MODEL, prompt=IDS, max_tokens=N, **kw)
    return r.choices[0].text


@pytest.mark.parametrize("name", list(CHAT_REFUSED))
def test_chat_refuses_what_it_does_not_implement(server: Server, name: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        server.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=2,
            **{name: CHAT_REFUSED[name]})
    assert e.value.status_code == 400
    assert e.value.param == name and e.value.code == "unsupported_parameter"
    assert name in e.value.message and "does not implement" in e.value.message


@pytest.mark.parametrize("name", list(COMPLETION_REFUSED))
def test_completions_refuse_what_they_do_not_implement(server: Server, name: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        completion(server, **{name: COMPLETION_REFUSED[name]})
    assert e.value.param == name and e.value.code == "unsupported_parameter"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_unknown_parameter_refused_by_name(server: Server, path: str) -> None:
    body = {"model": MODEL, "max_tokens": 2, "mirostat": 2,
            **({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path
               else {"prompt": "hi"})}
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "mirostat" and err["code"] == "unknown_parameter"
    assert "mirostat" in err["message"]


def test_no_op_values_and_bookkeeping_fields_accepted(server: Server) -> None:
    """What clients send by default (n=1, zero penalties, logprobs false, user, metadata,
    store...) asks for nothing: answered as if left out."""
    want = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=N,
        temperature=0).choices[0].message.content
    got = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=N,
        temperature=0, n=1, presence_penalty=0, frequency_penalty=0.0, logprobs=False,
        top_logprobs=0, logit_bias={}, tool_choice="none", response_format={"type": "text"},
        modalities=["text"], user="someone", metadata={"k": "v"}, store=False,
        service_tier="auto", tools=[], parallel_tool_calls=None)
    assert got.choices[0].message.content == want
    text = completion(server, temperature=0, n=1, best_of=1, echo=False, presence_penalty=0)
    assert text == completion(server, temperature=0)


def test_default_sampling_is_the_generation_config(any_server: Server) -> None:
    server = any_server
    """The tiny model's generation_config.json says do_sample false: a request without sampling
    parameters is greedy, token for token what `fuselm run` (no sampling flags) prints, and
    /v1/models says so."""
    gen = json.loads((server.out_dir / "generation_config.json").read_text())
    assert gen["do_sample"] is False
    (model,) = httpx.get(server.url + "/v1/models", timeout=30).json()["data"]
    assert model["fuselm"]["sampling_defaults"] == {
        "temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0}
    want = run_json(server, "--prompt-ids", ",".join(map(str, IDS)))
    assert completion(server) == want["text"]
    r = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=N)
    assert r.choices[0].message.content == run_json(server, "--prompt", PROMPT)["text"]


def test_top_k_honoured(any_server: Server) -> None:
    server = any_server
    """top_k=1 keeps only the likeliest token: any temperature and seed gives greedy output,
    while the same temperature without top_k does not."""
    greedy = completion(server, temperature=0)
    for seed in (1, 2):
        assert completion(server, temperature=2.0, seed=seed, extra_body={"top_k": 1}) == greedy
    free = {completion(server, temperature=2.0, seed=seed) for seed in (1, 2, 3)}
    assert free != {greedy}


def test_min_p_honoured(any_server: Server) -> None:
    server = any_server
    """min_p=1 keeps only the likeliest token: greedy at any temperature and seed."""
    greedy = completion(server, temperature=0)
    for seed in (1, 2):
        assert completion(server, temperature=2.0, seed=seed, extra_body={"min_p": 1.0}) == greedy


def test_min_p_same_as_run(server: Server) -> None:
    """A small min_p samples what `fuselm run --min-p` samples (one host sampler, one seed)."""
    got = completion(server, temperature=1.5, seed=4, extra_body={"min_p": 0.05})
    want = run_json(server, "--prompt-ids", ",".join(map(str, IDS)), "--temperature", "1.5",
                    "--seed", "4", "--min-p", "0.05")["text"]
    assert got == want


def test_repetition_penalty_honoured(any_server: Server) -> None:
    server = any_server
    """The same penalty `fuselm run --repetition-penalty` applies (the one host sampler), and
    it changes this prompt's greedy output."""
    ids = ",".join(map(str, IDS))
    got = completion(server, temperature=0, extra_body={"repetition_penalty": 1.8})
    assert got == run_json(server, "--prompt-ids", ids, "--repetition-penalty", "1.8")["text"]
    assert got != completion(server, temperature=0)


@pytest.mark.parametrize("value", [0, -1.0, "high"])
def test_bad_repetition_penalty_refused(server: Server, value: object) -> None:
    r = httpx.post(server.url + "/v1/completions", timeout=30, json={
        "model": MODEL, "prompt": "hi", "max_tokens": 2, "repetition_penalty": value})
    assert r.status_code == 400 and r.json()["error"]["param"] == "repetition_penalty"


def test_sampling_defaults_read_as_transformers_does() -> None:
    assert sampling_defaults({}) == SamplingOptions()
    assert sampling_defaults({"do_sample": False, "temperature": 0.7, "top_k": 20,
                              "repetition_penalty": 1.1}) == SamplingOptions(
        repetition_penalty=1.1)
    assert sampling_defaults({"do_sample": True, "temperature": 0.6, "top_p": 0.95}) == \
        SamplingOptions(temperature=0.6, top_k=50, top_p=0.95)
    for bad in ({"do_sample": True, "temperature": "hot"}, {"do_sample": True, "top_k": 2.5},
                {"do_sample": True, "top_p": 0}, {"repetition_penalty": -1}):
        with pytest.raises(RuntimeUserError, match="generation_config.json"):
            sampling_defaults(bad)


def test_run_flags_override_generation_config(tmp_path: Path) -> None:
    """`fuselm run`/`chat` resolve sampling as the server does: each flag given over the
    model's generation_config.json."""
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95}))
    assert sampling_from(str(tmp_path), None, None, 0.5, None, 7) == SamplingOptions(
        temperature=0.6, top_k=20, top_p=0.5, seed=7)
    assert sampling_from(str(tmp_path / "none"), None, None, None, None, None) == \
        SamplingOptions()


def test_python_api_defaults_agree(server: Server) -> None:
    """fuselm.load(...).generate with no sampling option: the same greedy text as the server
    and `fuselm run` give this artifact."""
    import fuselm

    model = fuselm.load(server.out_dir, engine=server.engine)
    reply = model.generate(PROMPT, max_tokens=N)
    assert reply.text == run_json(server, "--prompt", PROMPT)["text"]


def test_message_fields(server: Server) -> None:
    """An earlier reply sent back as the openai client dumps it (refusal, tool_calls, ...
    empty) is accepted; a message field with a value fuselm would ignore is refused by name."""
    client = server.client()
    first = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=4)
    history = [{"role": "user", "content": PROMPT}, first.choices[0].message.model_dump(),
               {"role": "user", "content": "more"}]
    again = client.chat.completions.create(model=MODEL, messages=history, max_tokens=4)
    assert again.choices[0].finish_reason in ("stop", "length")
    for field, value in (("name", "bob"), ("tool_call_id", "call_1")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, max_tokens=2, messages=[
                {"role": "user", "content": "hi", field: value}])
        assert e.value.param == f"messages.0.{field}"
        assert e.value.code == "unsupported_parameter"
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
        "model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi", "x": 1}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.x"


@pytest.mark.parametrize("call", [{"id": "c1"}, {"id": "c1", "function": "f"},
                                  {"id": "c1", "function": {"arguments": "{}"}}])
def test_a_malformed_earlier_tool_call_is_a_clear_400(server: Server, call: dict) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
        "model": MODEL, "max_tokens": 2, "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "user", "content": "and?"}]})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "messages.1.tool_calls"
    assert '"function": {"name"' in error["message"], error["message"]


@pytest.mark.parametrize(("body", "param"), [
    ({"stream": True, "stream_options": {"include_usage": True, "extra": 1}},
     "stream_options.extra"),
    ({"stream": True, "stream_options": {"include_obfuscation": True}},
     "stream_options.include_obfuscation"),
    ({"stream": True, "stream_options": {"include_usage": "yes"}},
     "stream_options.include_usage"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
])
def test_stream_options_checked(server: Server, body: dict, param: str) -> None:
    """stream_options holds include_usage only (include_obfuscation: false asks for nothing),
    and only with stream: true (OpenAI's rule); anything else is refused by name."""
    r = httpx.post(server.url + "/v1/completions", timeout=30, json={
        "model": MODEL, "prompt": "hi", "max_tokens": 2, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    ok = httpx.post(server.url + "/v1/completions", timeout=30, json={
        "model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": True,
        "stream_options": {"include_usage": False, "include_obfuscation": False}})
    assert ok.status_code == 200 and ok.text.endswith("data: [DONE]\n\n")


@pytest.mark.parametrize(("path", "body", "param"), [
    ("chat", {"stream": "yes"}, "stream"),
    ("chat", {"stream": 1}, "stream"),
    ("chat", {"max_tokens": 2.0}, "max_tokens"),
    ("chat", {"max_tokens": "2"}, "max_tokens"),
    ("chat", {"temperature": "0.5"}, "temperature"),
    ("chat", {"temperature": True}, "temperature"),
    ("chat", {"logprobs": "true"}, "logprobs"),
    ("chat", {"n": 1.0}, "n"),
    ("chat", {"stop": 5}, "stop"),
    ("chat", {"stop": ["a", 5]}, "stop.1"),
    ("completions", {"seed": "1"}, "seed"),
    ("completions", {"logprobs": 1.0}, "logprobs"),
    ("completions", {"logit_bias": {"5": "1"}}, "logit_bias.5"),
])
def test_types_are_strict(server: Server, path: str, body: dict, param: str) -> None:
    """As OpenAI's API: a value of the wrong JSON type is a 400 naming the parameter, never
    read as another (a string as a boolean or a number, 2.0 as an integer)."""
    base = ({"messages": [{"role": "user", "content": "hi"}]} if path == "chat" else
            {"prompt": "hi"})
    r = httpx.post(f"{server.url}/v1/{path.replace('chat', 'chat/completions')}", timeout=30,
                   json={"model": MODEL, "max_tokens": 2, **base, **body})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param, r.text
    assert error["message"].startswith(f"{param}: Input should be"), error["message"]
    # an integer is a number: temperature 0 is as good as 0.0
    ok = httpx.post(f"{server.url}/v1/completions", timeout=30,
                    json={"model": MODEL, "max_tokens": 2, "prompt": "hi", "temperature": 0})
    assert ok.status_code == 200


def test_a_tool_message_names_its_call(server: Server) -> None:
    """OpenAI's rule: a tool message's tool_call_id is required (the answer names its call)."""
    for msg in ({"role": "tool", "content": "21"}, {"role": "tool", "content": "21",
                                                     "tool_call_id": ""}):
        r = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
            "model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"},
                                                          msg]})
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == "messages.1.tool_call_id", r.text


@pytest.mark.parametrize(("part", "param", "word"), [
    ({"type": "text", "text": "hi", "foo": 1}, "messages.0.content.1.foo", "no such field"),
    ({"type": "image_url", "image_url": {"url": "data:,"}}, "messages.0.content.1.type",
     '"image_url" content parts are not supported'),
    ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}},
     "messages.0.content.1.type", '"input_audio" content parts'),
    ({"type": "text", "text": 5}, "messages.0.content.1.text", "must be a string"),
])
def test_content_parts_are_text_only(server: Server, part: dict, param: str, word: str
                                     ) -> None:
    """The model reads text: a part of another type is refused by its type, a field a text
    part does not have by its name (never dropped); text parts are joined."""
    def ask(parts: list[dict]) -> httpx.Response:
        return httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
            "model": MODEL, "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "user", "content": parts}]})

    r = ask([{"type": "text", "text": "hi"}, part])
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param and word in error["message"], r.text
    joined = ask([{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]).json()
    whole = ask([{"type": "text", "text": "hi"}]).json()
    assert joined["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"]
    assert joined["choices"][0]["message"] == whole["choices"][0]["message"]


def test_a_negative_seed_is_a_seed(server: Server) -> None:
    """OpenAI's seed is any 64-bit signed integer: a negative one seeds as any other (the same
    reply twice), it is not refused."""
    replies = {completion(server, temperature=1.0, seed=-7) for _ in range(2)}
    assert len(replies) == 1
    r = httpx.post(server.url + "/v1/completions", timeout=30, json={
        "model": MODEL, "prompt": "hi", "max_tokens": 2, "seed": -2**63 - 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed"


def test_null_asks_for_the_default(server: Server) -> None:
    """OpenAI's optional parameters are nullable: "stream": null and "n": null are the
    defaults (one choice, not streamed), as any other null."""
    want = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
        "model": MODEL, "max_tokens": 2, "temperature": 0,
        "messages": [{"role": "user", "content": "hi"}]}).json()
    got = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
        "model": MODEL, "max_tokens": 2, "temperature": 0, "stream": None, "n": None,
        "messages": [{"role": "user", "content": "hi"}]})
    assert got.status_code == 200, got.text
    assert got.json()["choices"] == want["choices"]
    # completions' max_tokens: 16 (OpenAI's default there), not the server's
    done = httpx.post(server.url + "/v1/completions", timeout=30, json={
        "model": MODEL, "prompt": IDS, "max_tokens": None, "temperature": 0}).json()
    assert done["usage"]["completion_tokens"] == 16, done  # this greedy reply has no EOS


@pytest.mark.parametrize("message", [{"role": "user"}, {"role": "system", "content": None},
                                     {"role": "assistant", "content": None},
                                     {"role": "user", "content": []}])
def test_a_message_without_content_is_400(server: Server, message: dict) -> None:
    """OpenAI's rule: content is required but for an assistant's message of tool calls; a
    message without it was rendered as empty text."""
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
        "model": MODEL, "max_tokens": 2, "messages": [message, {"role": "user", "content": "hi"}]})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "messages.0.content", r.text
