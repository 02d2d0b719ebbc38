"""The tool-call format table (runtime_metal/tool_calls.py): each family's marker selects its
format, a reply in that format parses into OpenAI calls (arguments as JSON text), the grammar of
a required call compiles for every format, and a stream holds back only what may be a call."""

from __future__ import annotations

import json

import pytest

from fuselm.converter.serve.structured import ToolStream
from fuselm.runtime_metal.constraint import ConstraintError
from fuselm.runtime_metal.tool_calls import FORMATS, call_grammar, parse_reply, tool_format

TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
ARGS = {"city": "Paris"}
# a template snippet of the family -> a reply of its model calling weather(city="Paris")
REPLIES = {
    "hermes": ("<tool_call>\n{\"name\": <function-name>...",
               'Let me check.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}'
               "\n</tool_call>"),
    "llama3_json": ('Respond in the format {"name": function name, "parameters": dictionary of '
                    "argument name and its value}.",
                    '{"name": "weather", "parameters": {"city": "Paris"}}'),
    "granite_json": ("<|tool_call|>", '<|tool_call|>[{"name": "weather", "arguments": '
                                      '{"city": "Paris"}}]'),
    "mistral_json": ("[TOOL_CALLS]", '[TOOL_CALLS][{"name": "weather", "arguments": '
                                     '{"city": "Paris"}}]'),
}


@pytest.mark.parametrize("name", list(REPLIES))
def test_each_format_detects_and_parses(name: str) -> None:
    snippet, reply = REPLIES[name]
    fmt = tool_format("{% for m in messages %}" + snippet + "{% endfor %}")
    assert fmt is not None and fmt.name == name
    parsed = parse_reply(reply, fmt, ["weather"])
    assert [(c["name"], json.loads(c["arguments"])) for c in parsed.calls] == [("weather", ARGS)]
    assert parsed.content == ("Let me check." if name == "hermes" else None)
    assert parse_reply(reply.replace("weather", "other"), fmt, ["weather"]).calls == []
    if fmt.start.strip():  # a special-token marker dropped by the detokenizer still parses
        bare = reply.split(fmt.start.strip())[1].split("</tool_call>")[0]
        assert parse_reply(bare, fmt, ["weather"]).calls == parsed.calls
    assert call_grammar(fmt, TOOLS, {"[TOOL_CALLS]": 5})


def test_no_format_and_plain_text() -> None:
    assert tool_format("{{ messages }}") is None
    fmt = FORMATS[-1]
    assert parse_reply("It is sunny.", fmt, ["weather"]).calls == []
    with pytest.raises(ConstraintError, match="strin"):
        call_grammar(fmt, [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "strin"}}}])


def test_stream_holds_back_only_a_possible_call() -> None:
    fmt = next(f for f in FORMATS if f.name == "hermes")
    s = ToolStream(fmt, ["weather"])
    assert s.push("Let me ") == "Let me "
    assert s.push("check <tool") == "check "  # "<tool" may open <tool_call>
    assert s.push("s are fine") == "<tools are fine"
    assert s.finish() == ("", [])
    s = ToolStream(fmt, ["weather"])
    assert s.push("<tool_call>\n{\"name\": \"weather\", ") == ""
    assert s.push('"arguments": {"city": "Paris"}}\n</tool_call>') == ""
    rest, calls = s.finish()
    assert rest == "" and calls[0]["function"]["name"] == "weather" and calls[0]["id"]
