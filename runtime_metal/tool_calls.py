"""Tool calls in a model's own format: which format a chat template defines, the grammar that
makes a reply one call of given functions, and the parse of a reply into OpenAI `tool_calls`.

One table, FORMATS, one row per format a family's template teaches its model:

- hermes: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` (Qwen 2.5 / Qwen3,
  SmolLM3, Hermes);
- llama3_json: a bare `{"name": ..., "parameters": {...}}` (Llama 3.1 / 3.2's JSON tool calling);
- granite_json: `<|tool_call|>[{"name": ..., "arguments": {...}}, ...]` (Granite 3);
- mistral_json: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (Mistral).

A format is chosen by the marker its template writes (`tool_format`). A marker that is a special
token is dropped by the text stream (special tokens are skipped when decoding), so the parse
also takes a reply that is only the JSON of the calls.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from fuselm.runtime_metal.constraint import JSON_LAYOUT, lark_grammar


@dataclass(frozen=True)
class ToolFormat:
    name: str
    detect: tuple[str, ...]  # any of these in the template's text selects the format
    start: str  # what opens the calls ("" for a bare JSON call)
    end: str  # what closes one call (hermes) or the list ("")
    args: str  # the key of the arguments object
    many: bool  # the calls are one JSON list after `start` (else one object per start..end)


FORMATS = (
    ToolFormat("mistral_json", ("[TOOL_CALLS]",), "[TOOL_CALLS]", "", "arguments", True),
    ToolFormat("granite_json", ("<|tool_call|>",), "<|tool_call|>", "", "arguments", True),
    ToolFormat("hermes", ("<tool_call>",), "<tool_call>\n", "\n</tool_call>", "arguments", False),
    ToolFormat("llama3_json", ('"parameters": dictionary of argument name',
                               '{"name": function name, "parameters"'), "", "", "parameters",
               False),
)


def tool_format(template: str | None) -> ToolFormat | None:
    """The tool-call format `template` (a chat template's text) teaches; None: it has none."""
    if not template:
        return None
    return next((f for f in FORMATS if any(d in template for d in f.detect)), None)


def function_names(tools: list[dict[str, Any]]) -> list[str]:
    return [t["function"]["name"] for t in tools]


def call_schema(fmt: ToolFormat, tools: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON schema of one call to any of `tools` (OpenAI function tools) in `fmt`."""
    options = [{"type": "object", "properties": {
        "name": {"const": t["function"]["name"]},
        fmt.args: t["function"].get("parameters") or {"type": "object"}},
        "required": ["name", fmt.args], "additionalProperties": False} for t in tools]
    return options[0] if len(options) == 1 else {"anyOf": options}


def _literal(text: str, special: dict[str, int]) -> str:
    """A Lark terminal for `text`: the token itself where it is one special token."""
    if text in special:
        return f"<[{special[text]}]>"
    return json.dumps(text) if text else ""


def call_grammar(fmt: ToolFormat, tools: list[dict[str, Any]],
                 special: dict[str, int] | None = None) -> str:
    """The grammar of a reply that is one call to one of `tools` in `fmt` (tool_choice
    "required" or a named function). `special`: the tokenizer's special tokens by text."""
    special = special or {}
    schema = call_schema(fmt, tools)
    if fmt.many:
        schema = {"type": "array", "items": schema, "minItems": 1, "maxItems": 1}
    body = json.dumps({**schema, "x-guidance": JSON_LAYOUT})
    parts = [p for p in (_literal(fmt.start, special), "call", _literal(fmt.end, special)) if p]
    return lark_grammar(f"start: {' '.join(parts)}\ncall: %json {body}\n",
                        "the tools' parameters schema")


@dataclass
class ParsedReply:
    content: str | None  # text outside the calls (None when there is none)
    calls: list[dict[str, Any]]  # [{"name": str, "arguments": str (JSON)}]


def _call(obj: Any, fmt: ToolFormat) -> dict[str, Any] | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(fmt.args, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}


def _calls_in(text: str, fmt: ToolFormat) -> list[dict[str, Any]] | None:
    """The calls of `text` that is only JSON (one call object or a list of them), else None."""
    decoder = json.JSONDecoder()
    text = text.strip()
    calls: list[dict[str, Any]] = []
    at = 0
    while at < len(text):
        try:
            obj, end = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return None
        items = obj if isinstance(obj, list) else [obj]
        parsed = [_call(o, fmt) for o in items]
        if not parsed or any(p is None for p in parsed):
            return None
        calls += parsed  # type: ignore[arg-type]
        at = end
        while at < len(text) and text[at] in " \n\t;,":
            at += 1
    return calls or None


def parse_reply(text: str, fmt: ToolFormat, names: list[str]) -> ParsedReply:
    """`text` split into the calls it makes (to functions in `names`) and the rest."""
    marker = fmt.start.strip()
    if marker and marker in text:
        head, _, rest = text.partition(marker)
        calls: list[dict[str, Any]] = []
        for piece in rest.split(marker):
            if fmt.end.strip():
                piece = piece.split(fmt.end.strip())[0]
            found = _calls_in(piece, fmt)
            if found is None:
                return ParsedReply(text, [])
            calls += found
    else:
        head, calls = "", _calls_in(text, fmt) or []
        if not calls:
            return ParsedReply(text, [])
    if any(c["name"] not in names for c in calls):
        return ParsedReply(text, [])
    return ParsedReply(head.strip() or None, calls)


def call_start(text: str, fmt: ToolFormat) -> int | None:
    """Where in `text` (a reply so far) a tool call may begin: 0 when the reply opens with JSON,
    else at its marker or at a tail that may grow into the marker; None when no part may. A
    stream holds the text from there back until it knows."""
    if (at := call_opened(text, fmt)) is not None:
        return at
    marker = fmt.start.strip()
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return len(text) - k
    return None


def call_opened(text: str, fmt: ToolFormat) -> int | None:
    """Where in `text` a tool call certainly begins (its whole marker, or a reply opening with
    JSON); None while none has. Unlike `call_start`, a tail that may yet grow into the marker
    does not count."""
    if text.lstrip()[:1] in ("{", "["):
        return 0
    marker = fmt.start.strip()
    at = text.find(marker) if marker else -1
    return at if at >= 0 else None
