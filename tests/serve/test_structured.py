"""Structured output on the real SmolLM2-135M (`fuselm serve`, onnxruntime rows, 8 slots):
twenty JSON schemas, each reply parsed and validated with `jsonschema`, every other one
streamed, all sent at once; and eight concurrent requests of which four are constrained, where
the four unconstrained ones get exactly their solo greedy text (a row's mask touches only its
row)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema

from tests.serve.conftest import MODEL, Server


def _obj(props: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {"type": "object", "properties": props,
            "required": list(props) if required is None else required,
            "additionalProperties": False}


NAME = {"type": "string", "maxLength": 16}
# (what to ask for, the schema): small enough to close within MAX_TOKENS
SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    ("a person", _obj({"name": NAME, "age": {"type": "integer", "minimum": 0,
                                             "maximum": 120}})),
    ("a color", _obj({"color": {"enum": ["red", "green", "blue"]}})),
    ("a rating", _obj({"stars": {"type": "integer", "minimum": 1, "maximum": 5},
                       "score": {"type": "number", "minimum": 0, "maximum": 1}})),
    ("a flag", _obj({"done": {"type": "boolean"}, "note": {"type": "null"}})),
    ("an address", _obj({"address": _obj({"street": NAME, "city": NAME})})),
    ("three fruits", _obj({"fruits": {"type": "array", "items": {"type": "string",
                                                                  "maxLength": 12},
                                      "minItems": 1, "maxItems": 3}})),
    ("tagged items", _obj({"items": {"type": "array", "minItems": 1, "maxItems": 2,
                                     "items": _obj({"id": {"type": "integer", "minimum": 0,
                                                           "maximum": 99},
                                                    "tag": {"enum": ["a", "b"]}})}})),
    ("a date", _obj({"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}})),
    ("a product code", _obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}})),
    ("a user with an optional nickname", _obj({"name": NAME, "nick": NAME}, ["name"])),
    ("a version", _obj({"kind": {"const": "version"}, "major": {"type": "integer",
                                                               "minimum": 0, "maximum": 9}})),
    ("an id", _obj({"id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 999},
                                     {"type": "string", "maxLength": 8}]}})),
    ("a user profile", _obj({"user": _obj({"profile": _obj({"name": NAME, "age": {
        "type": "integer", "minimum": 0, "maximum": 99}})})})),
    ("some small numbers", _obj({"numbers": {"type": "array", "minItems": 2, "maxItems": 4,
                                             "items": {"type": "integer", "minimum": 0,
                                                       "maximum": 9}}})),
    ("a priority", _obj({"priority": {"enum": [1, 2, 3]}})),
    ("a word", _obj({"word": {"type": "string", "minLength": 3, "maxLength": 10}})),
    ("a temperature", _obj({"celsius": {"type": "number", "exclusiveMinimum": -50,
                                        "exclusiveMaximum": 60}})),
    ("a list of sizes", {"type": "array", "items": {"enum": ["S", "M", "L"]}, "minItems": 1,
                         "maxItems": 3}),
    ("a point", {"$defs": {"coord": {"type": "integer", "minimum": -9, "maximum": 9}},
                 **_obj({"x": {"$ref": "#/$defs/coord"}, "y": {"$ref": "#/$defs/coord"}})}),
    ("a city and its country", _obj({"city": NAME, "country": NAME,
                                     "capital": {"type": "boolean"}}, ["city", "country"])),
]
MAX_TOKENS = 64
FREE = ["What is the capital of France?", "Name three colors.", "What is 2 + 2?",
        "Say hello."]


def _schema_request(srv: Server, i: int, stream: bool) -> tuple[str, str]:
    what, schema = SCHEMAS[i]
    kw: dict[str, Any] = dict(
        model=MODEL, messages=[{"role": "user", "content": f"Reply with JSON for {what}."}],
        max_tokens=MAX_TOKENS, temperature=0,
        response_format={"type": "json_schema",
                         "json_schema": {"name": f"s{i}", "schema": schema}})
    client = srv.client()
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kw))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        return text, finish
    r = client.chat.completions.create(**kw)
    return r.choices[0].message.content, r.choices[0].finish_reason


def _free(srv: Server, prompt: str) -> str:
    r = srv.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=12,
        temperature=0)
    return r.choices[0].message.content


def test_twenty_schemas_validate_streamed_and_not(smol_server: Server) -> None:
    jobs = [(i, i % 2 == 1) for i in range(len(SCHEMAS))]
    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda j: _schema_request(smol_server, *j), jobs))
    for (i, stream), (text, finish) in zip(jobs, replies, strict=True):
        assert finish == "stop", (SCHEMAS[i][0], stream, text)
        jsonschema.validate(json.loads(text), SCHEMAS[i][1])


def test_constrained_rows_leave_the_others_alone(smol_server: Server) -> None:
    solo = [_free(smol_server, p) for p in FREE]
    with ThreadPoolExecutor(8) as pool:
        free = [pool.submit(_free, smol_server, p) for p in FREE]
        short = [1, 14, 10, 3]  # the shortest documents: the wave lasts as long as its longest
        shaped = [pool.submit(_schema_request, smol_server, i, False) for i in short]
        got = [f.result() for f in free]
        for i, f in zip(short, shaped, strict=True):
            jsonschema.validate(json.loads(f.result()[0]), SCHEMAS[i][1])
    assert got == solo
    assert any("{" not in t for t in solo)  # they were free text
