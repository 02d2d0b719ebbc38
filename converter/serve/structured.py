"""What a request asks of the reply's shape: `response_format` (any JSON object, or JSON valid
against a schema) and `tools` / `tool_choice` (OpenAI function tools, laid out by the chat
template; the reply parsed back into `tool_calls` in the format the template teaches,
runtime_metal/tool_calls.py). Each becomes a grammar for constrained decoding
(runtime_metal/constraint.py) where the reply must follow one; every problem is a 400 naming the
parameter. `ToolStream` holds back streamed text that may be a tool call until it knows."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from fuselm.converter.serve.errors import ApiError
from fuselm.converter.serve.schema import ChatRequest, CompletionRequest
from fuselm.runtime_metal.constraint import (
    ConstraintError,
    json_object_grammar,
    json_schema_grammar,
)
from fuselm.runtime_metal.tool_calls import (
    ToolFormat,
    call_grammar,
    call_start,
    function_names,
    parse_reply,
    tool_format,
)


@dataclass
class Structure:
    grammar: str | None = None  # the reply follows it (None: free text)
    tools: list[dict[str, Any]] | None = None  # for the chat template
    fmt: ToolFormat | None = None  # parse the reply's tool calls in this format (None: none)
    names: list[str] = field(default_factory=list)  # the functions it may call


def _bad(message: str, param: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param, code="invalid_value")


# The fields of OpenAI's shapes that fuselm reads; another one is refused by name, never
# dropped (llama.cpp's {"type": "json_object", "schema": ...} would otherwise lose its schema).
RESPONSE_FORMAT_FIELDS = {"text": {"type"}, "json_object": {"type"},
                          "json_schema": {"type", "json_schema"}}
JSON_SCHEMA_FIELDS = {"name", "description", "schema", "strict"}
TOOL_FIELDS = {"type", "function"}
FUNCTION_FIELDS = {"name", "description", "parameters", "strict"}


def _known(value: dict[str, Any], fields: set[str], param: str) -> None:
    extra = next((k for k in value if k not in fields), None)
    if extra is not None:
        raise _bad(f"fuselm does not read this field (it reads {', '.join(sorted(fields))})",
                   f"{param}.{extra}")


def _response_format(value: dict[str, Any] | None) -> str | None:
    if value is None:
        return None
    kind = value.get("type")
    if kind in RESPONSE_FORMAT_FIELDS:
        _known(value, RESPONSE_FORMAT_FIELDS[kind], "response_format")
    try:
        if kind == "text":
            return None
        if kind == "json_object":
            return json_object_grammar()
        if kind == "json_schema":
            spec = value.get("json_schema")
            if not isinstance(spec, dict) or "schema" not in spec:
                raise _bad('json_schema needs {"name": ..., "schema": {...}}',
                           "response_format.json_schema")
            _known(spec, JSON_SCHEMA_FIELDS, "response_format.json_schema")
            return json_schema_grammar(spec["schema"], "the JSON schema")
    except ConstraintError as e:
        raise _bad(str(e), "response_format") from None
    raise _bad(f'type must be "text", "json_object" or "json_schema", got {kind!r}',
               "response_format")


def _tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise _bad('each tool must be {"type": "function", "function": {...}}',
                       f"tools.{i}")
        _known(t, TOOL_FIELDS, f"tools.{i}")
        _known(fn, FUNCTION_FIELDS, f"tools.{i}.function")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _bad("a function needs a name", f"tools.{i}.function.name")
        if fn["name"] in function_names(tools[:i]):  # a call could not say which it means
            raise _bad(f"another tool is named {fn['name']!r} too; function names must be "
                       "unique", f"tools.{i}.function.name")
        params = fn.get("parameters")
        if params is not None:
            try:
                json_schema_grammar(params, "the parameters schema")
            except ConstraintError as e:
                raise _bad(str(e), f"tools.{i}.function.parameters") from None
    return tools


def request_structure(req: ChatRequest | CompletionRequest, template: str | None,
                      special: dict[str, int]) -> Structure:
    """The request's grammar, tools and tool-call format; ApiError 400 for what cannot be."""
    grammar = _response_format(req.response_format)
    tools = getattr(req, "tools", None) or None
    choice = getattr(req, "tool_choice", None)
    if tools is None:
        if choice not in (None, "none"):
            raise _bad("a tool choice needs tools", "tool_choice")
        return Structure(grammar)
    tools = _tools(tools)
    names = function_names(tools)
    if choice == "none":
        return Structure(grammar, tools)
    fmt = tool_format(template)
    if fmt is None:
        raise _bad("this model's chat template defines no tool-call format (fuselm reads "
                   "Qwen's <tool_call>, Llama 3's JSON, Granite's <|tool_call|> and "
                   "Mistral's [TOOL_CALLS])", "tools")
    if choice in (None, "auto"):
        return Structure(grammar, tools, fmt, names)
    if choice == "required":
        chosen = tools
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(
            choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise _bad(f"no tool is named {name!r} (tools: {', '.join(names)})",
                       "tool_choice")
        chosen = [t for t in tools if t["function"]["name"] == name]
    else:
        raise _bad('must be "none", "auto", "required" or {"type": "function", "function": '
                   '{"name": ...}}', "tool_choice")
    if grammar is not None:
        raise _bad("a required tool call and a response_format cannot both shape the reply",
                   "response_format")
    try:
        grammar = call_grammar(fmt, chosen, special)
    except ConstraintError as e:
        raise _bad(str(e), "tools") from None
    return Structure(grammar, tools, fmt, names)


def openai_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]


def template_messages(req: ChatRequest) -> list[dict[str, Any]]:
    """The messages as the chat template reads them: an assistant's tool calls with their
    arguments as objects (transformers' convention: templates write them with tojson)."""
    import json

    out = []
    for m in req.messages:
        msg: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.tool_calls:
            calls = []
            for c in m.tool_calls:
                fn = dict(c.get("function") or {})
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except json.JSONDecodeError:
                        pass  # kept as the client sent it
                calls.append({**c, "function": fn})
            msg["tool_calls"] = calls
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


class ToolStream:
    """A streamed reply's text, held back while it may be a tool call: text is passed on as
    content until a call's marker (or a reply opening with JSON) shows; at the end the held
    text is parsed into calls, or passed on as content when it is none."""

    def __init__(self, fmt: ToolFormat, names: list[str]) -> None:
        self.fmt, self.names = fmt, names
        self.text = ""
        self.sent = 0

    def push(self, piece: str) -> str:
        """The content safe to send now."""
        self.text += piece
        start = call_start(self.text, self.fmt)
        upto = len(self.text) if start is None else max(start, self.sent)
        out, self.sent = self.text[self.sent:upto], upto
        return out

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """(content still to send, the calls: OpenAI tool_calls, empty when none)."""
        parsed = parse_reply(self.text, self.fmt, self.names)
        if parsed.calls:
            return "", openai_calls(parsed.calls)
        return self.text[self.sent:], []


def call_deltas(calls: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """OpenAI's streamed tool calls: per call its id and name, then its arguments."""
    for i, c in enumerate(calls):
        yield {"tool_calls": [{"index": i, "id": c["id"], "type": "function",
                               "function": {"name": c["function"]["name"], "arguments": ""}}]}
        yield {"tool_calls": [{"index": i, "function": {"arguments":
                                                        c["function"]["arguments"]}}]}
