"""Tool calls through the official openai client, for a Qwen3 chat template (`<tool_call>`) and
a Llama 3 one (bare `{"name", "parameters"}` JSON), each on its own `fuselm serve` over a tiny
random model: a required or named call comes back as `tool_calls` whose arguments validate
against the function's schema (streamed and not), the tools reach the template, and a follow-up
with the tool's result answers. Plus the 400s: an invalid schema, an unknown tool name, tools
for a template without a tool-call format. Servers run on 127.0.0.1 and are stopped by PID."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from fuselm.converter.models.builtin import build_model
from fuselm.runtime_metal.chat_template import render_chat
from tests.serve.conftest import MODEL, STARTUP_S, Server, start_server, stop_server, wait_up

# The tool parts of Qwen3's and Llama 3.1's templates, their instructions cut short (a tiny
# tokenizer spends about a token a character): the markers and layouts are the families'.
QWEN3 = """{%- if tools %}<|im_start|>system
# Tools
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>
Call a function as:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}{%- for message in messages %}
{%- if message.role == "assistant" %}<|im_start|>assistant
{%- if message.content %}
{{ message.content }}{% endif %}
{%- for tool_call in message.tool_calls or [] %}
{%- if tool_call.function %}{% set tool_call = tool_call.function %}{% endif %}
<tool_call>
{"name": "{{ tool_call.name }}", "arguments": {% if tool_call.arguments is string %}\
{{ tool_call.arguments }}{% else %}{{ tool_call.arguments | tojson }}{% endif %}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

LLAMA3 = """{%- if tools %}<|start_header_id|>user<|end_header_id|>

Respond in the format {"name": function name, "parameters": dictionary of argument name and \
its value}.
{% for t in tools %}{{ t | tojson }}
{% endfor %}<|eot_id|>{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}
{%- set tool_call = message.tool_calls[0].function %}\
<|start_header_id|>assistant<|end_header_id|>

{"name": "{{ tool_call.name }}", "parameters": {{ tool_call.arguments | tojson }}}<|eot_id|>
{%- elif message.role == "tool" %}<|start_header_id|>ipython<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- else %}<|start_header_id|>{{ message.role }}<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- endif %}{% endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

WEATHER = {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
         "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "clock", "parameters": CLOCK}}]
SCHEMA_OF = {"weather": WEATHER, "clock": CLOCK}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CONTEXT = 2048
QUEUE = 8  # the tool servers' --max-queue: below the most choices a request may ask for


@pytest.fixture(scope="module")
def tool_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    """One tiny qwen3 model (a context long enough for the tools' JSON at a character a
    token), served twice: with the Qwen3 template and with the Llama 3 one."""
    from fuselm.converter.pipeline import ConvertOptions, convert

    root = tmp_path_factory.mktemp("tool_serve")
    hf = build_model(root / "hf", "qwen3", seed=5, max_position_embeddings=CONTEXT)
    base = root / "base"
    convert(hf, base, ConvertOptions(dtype="float32"))
    started = []
    for name, template in (("qwen3", QWEN3), ("llama3", LLAMA3)):
        art = root / name
        shutil.copytree(base, art)
        (art / "chat_template.jinja").write_text(template)
        started.append(start_server(art, root / f"{name}.log", "onnxruntime",
                                    ["--max-context", str(CONTEXT), "--model-name", MODEL,
                                     "--max-queue", str(QUEUE)]))
    try:
        deadline = time.monotonic() + STARTUP_S
        for proc, srv in started:
            wait_up(proc, srv, deadline)
        yield dict(zip(("qwen3", "llama3"), (srv for _, srv in started), strict=True))
        for _, srv in started:
            assert "Traceback" not in srv.log.read_text()
    finally:
        for proc, _ in started:
            stop_server(proc)


def _check_call(call: Any, name: str | None = None) -> dict[str, Any]:
    assert call.type == "function" and call.id
    assert name is None or call.function.name == name
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMA_OF[call.function.name])
    return args


@pytest.mark.parametrize("family", ["qwen3", "llama3"])
def test_required_call_validates_and_the_result_continues(
        tool_servers: dict[str, Server], family: str) -> None:
    client = tool_servers[family].client()
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                       tool_choice="required", max_tokens=200, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    _check_call(call)
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1)
    assert r.usage.prompt_tokens > plain.usage.prompt_tokens + 100  # the tools were rendered
    follow = client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0, messages=[
        *ASK, choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 21}'}], tools=TOOLS,
        tool_choice="none")
    assert follow.choices[0].finish_reason in ("stop", "length")
    assert follow.choices[0].message.content and not follow.choices[0].message.tool_calls
    assert follow.usage.prompt_tokens > r.usage.prompt_tokens  # the call and result rendered


@pytest.mark.parametrize("family", ["qwen3", "llama3"])
def test_named_call_streams_as_tool_call_deltas(tool_servers: dict[str, Server],
                                                family: str) -> None:
    chunks = list(tool_servers[family].client().chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=200, temperature=0, stream=True,
        tool_choice={"type": "function", "function": {"name": "clock"}}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not any(d.content for d in deltas)
    parts = [tc for d in deltas for tc in d.tool_calls or []]
    assert parts[0].id and parts[0].function.name == "clock"
    arguments = "".join(p.function.arguments or "" for p in parts)
    jsonschema.validate(json.loads(arguments), CLOCK)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_does_not_cut_a_call(tool_servers: dict[str, Server], stream: bool
                                          ) -> None:
    """`stop` applies to the reply's content (OpenAI's, vLLM's): a stop string that the call's
    own text holds ("zone", its argument's name) leaves the call whole, parsed into
    tool_calls, rather than its raw opening cut into content."""
    kw: dict[str, Any] = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=200,
                              temperature=0, stop=["zone", "</tool_call>"],
                              tool_choice={"type": "function", "function": {"name": "clock"}})
    client = tool_servers["qwen3"].client()
    if stream:
        chunks = [c for c in client.chat.completions.create(stream=True, **kw) if c.choices]
        deltas = [c.choices[0].delta for c in chunks]
        assert not any(d.content for d in deltas)
        parts = [tc for d in deltas for tc in d.tool_calls or []]
        assert parts[0].function.name == "clock"
        jsonschema.validate(json.loads("".join(p.function.arguments or "" for p in parts)),
                            CLOCK)
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        return
    choice = client.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert "zone" in _check_call(call, "clock")


def test_parallel_tool_calls_true_asks_for_nothing(tool_servers: dict[str, Server]) -> None:
    """OpenAI's default, true (a reply may make several calls: fuselm parses every one), is
    accepted; false, at most one call, is refused by name."""
    client = tool_servers["qwen3"].client()
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=2,
                                       parallel_tool_calls=True)
    assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")
    err = _bad_request(tool_servers["qwen3"], tools=TOOLS, parallel_tool_calls=False)
    assert err.param == "parallel_tool_calls" and err.code == "unsupported_parameter"


def test_n_past_the_queue_is_400(tool_servers: dict[str, Server]) -> None:
    """n choices wait together: more than --max-queue could never be admitted, a 400 naming n
    and the limit (not a 503 asking to retry)."""
    err = _bad_request(tool_servers["qwen3"], n=QUEUE + 1)
    assert err.param == "n" and f"at most {QUEUE} (--max-queue)" in err.message, err.message
    ok = tool_servers["qwen3"].client().chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=1, n=QUEUE)
    assert len(ok.choices) == QUEUE


def test_tools_reach_the_template() -> None:
    text = render_chat(QWEN3, ASK, tools=TOOLS)
    assert '"name": "weather"' in text and text.index("<tools>") < text.index("Weather in")


def _bad_request(srv: Server, **kw: Any) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as e:
        srv.client().chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, **kw)
    return e.value


def test_unknown_tool_name_is_400(tool_servers: dict[str, Server]) -> None:
    err = _bad_request(tool_servers["qwen3"], tools=TOOLS, tool_choice={
        "type": "function", "function": {"name": "nope"}})
    assert err.param == "tool_choice" and "'nope'" in err.message and "weather" in err.message


def test_duplicate_function_names_are_400(server: Server) -> None:
    """As OpenAI: two tools of one name are refused (a call could not say which it means)."""
    err = _bad_request(server, tools=[TOOLS[0], TOOLS[1], {
        "type": "function", "function": {"name": "weather"}}])
    assert err.param == "tools.2.function.name" and "'weather'" in err.message, err.message


def test_invalid_schemas_are_400(server: Server) -> None:
    err = _bad_request(server, response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}})
    assert err.param == "response_format" and "strin" in err.message
    err = _bad_request(server, response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "pattern": "(?=a)b"}}})
    assert "look-around" in err.message
    err = _bad_request(server, response_format={"type": "yaml"})
    assert err.param == "response_format" and "'yaml'" in err.message
    err = _bad_request(server, tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"$ref": "#/nowhere"}}}])
    assert err.param == "tools.0.function.parameters" and "nowhere" in err.message
    # the tiny model's own template teaches no tool-call format
    err = _bad_request(server, tools=TOOLS)
    assert err.param == "tools" and "tool-call format" in err.message


@pytest.mark.parametrize(("kw", "param"), [
    ({"response_format": {"type": "json_object", "schema": WEATHER}}, "response_format.schema"),
    ({"response_format": {"type": "text", "json_schema": {"schema": WEATHER}}},
     "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "w", "schema": WEATHER, "strcit": True}}}, "response_format.json_schema.strcit"),
    ({"tools": [{"type": "function", "function": {"name": "f", "paramters": WEATHER}}]},
     "tools.0.function.paramters"),
    ({"tools": [{"type": "function", "function": {"name": "f"}, "cache": True}]},
     "tools.0.cache"),
])
def test_unknown_fields_in_shapes_are_400(server: Server, kw: dict, param: str) -> None:
    """A field inside response_format or a tool that fuselm does not read (llama.cpp's
    `schema` beside json_object, a misspelt `parameters`) is refused by name, not dropped."""
    err = _bad_request(server, **kw)
    assert err.param == param and "does not read" in err.message, err.message


def test_json_schema_on_completions_both_engines(any_server: Server) -> None:
    """On onnxruntime's rows and MLX's pipelined batched step (its mask applied on the device),
    beside a free request decoded in the same steps."""
    import threading

    client = any_server.client()
    free = client.completions.create(model=MODEL, prompt="Data:", max_tokens=24, temperature=0)
    got: list[str] = []
    other = threading.Thread(target=lambda: got.append(client.completions.create(
        model=MODEL, prompt="Data:", max_tokens=24, temperature=0).choices[0].text))
    other.start()
    r = client.completions.create(model=MODEL, prompt="Data:", max_tokens=200, temperature=0,
                                  extra_body={"response_format": {"type": "json_schema",
                                                                  "json_schema": {
                                                                      "name": "c",
                                                                      "schema": CLOCK}}})
    other.join(timeout=60)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].text), CLOCK)
    assert got == [free.choices[0].text]
