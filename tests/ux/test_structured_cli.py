"""Constrained replies outside the server: `fuselm run --json-schema FILE` / `--json-object`,
`fuselm chat --json-schema FILE`, and the Python API's `json_schema=` (generate, stream_generate)
on the tiny model, each reply validated with `jsonschema`; a bad schema is one error line."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from click.testing import CliRunner

import fuselm
from fuselm.converter.cli.main import cli as click_cli
from fuselm.runtime_metal.constraint import ConstraintError
from tests.cli_run import one_error, run_cli

SCHEMA = {"type": "object", "properties": {
    "zone": {"enum": ["UTC", "CET"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["zone", "n"], "additionalProperties": False}
RUN = ("-p", "What time is it?", "-n", "120", "--temperature", "0", "--engine", "onnxruntime")


@pytest.fixture(scope="module")
def schema_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("schema") / "schema.json"
    path.write_text(json.dumps(SCHEMA))
    return path


def test_run_json_schema(capsys: pytest.CaptureFixture, artifact: Path,
                         schema_file: Path) -> None:
    code, out, _ = run_cli(capsys, "run", str(artifact), *RUN, "--json-schema",
                           str(schema_file), "--json")
    assert code == 0
    result = json.loads(out.strip().splitlines()[-1])
    assert result["stop_reason"] == "eos"
    jsonschema.validate(json.loads(result["text"]), SCHEMA)


def test_run_json_object(capsys: pytest.CaptureFixture, artifact: Path) -> None:
    code, out, _ = run_cli(capsys, "run", str(artifact), *RUN, "--json-object", "--json")
    assert code == 0
    result = json.loads(out.strip().splitlines()[-1])
    if result["stop_reason"] == "eos":  # a random model's object may outgrow -n
        assert isinstance(json.loads(result["text"]), dict)
    assert result["text"].startswith("{")


def test_bad_schema_is_one_error_line(capsys: pytest.CaptureFixture, artifact: Path,
                                      tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"type": "object", "properties": {"a": {"type": "strin"}}}')
    line = one_error(*run_cli(capsys, "run", str(artifact), *RUN, "--json-schema",
                              str(bad))[::2])
    assert str(bad) in line and "strin" in line
    bad.write_text("{not json")
    line = one_error(*run_cli(capsys, "run", str(artifact), *RUN, "--json-schema",
                              str(bad))[::2])
    assert "not valid JSON" in line


def test_chat_json_schema(artifact: Path, schema_file: Path) -> None:
    res = CliRunner().invoke(click_cli, ["chat", str(artifact), "-n", "120", "--temperature",
                                         "0", "--engine", "onnxruntime", "--json-schema",
                                         str(schema_file)], input="What time?\nAnd now?\n")
    assert res.exit_code == 0, res.output
    replies = [ln.removeprefix(">>> ") for ln in res.output.splitlines() if "{" in ln]
    assert len(replies) == 2
    for reply in replies:
        jsonschema.validate(json.loads(reply), SCHEMA)


def test_api_json_schema(artifact: Path) -> None:
    model, tok = fuselm.load(artifact, engine="onnxruntime")
    text = fuselm.generate(model, tok, "What time is it?", max_tokens=120, temperature=0,
                           json_schema=SCHEMA)
    jsonschema.validate(json.loads(text), SCHEMA)
    last = list(fuselm.stream_generate(model, tok, "What time is it?", max_tokens=120,
                                       temperature=0, json_schema=json.dumps(SCHEMA)))
    assert "".join(r.text for r in last) == text and last[-1].finish_reason == "stop"
    with pytest.raises(ConstraintError, match="strin"):
        fuselm.stream_generate(model, tok, "Hi", json_schema={"type": "strin"})
    reply = model.generate("Hi", max_tokens=120, temperature=0, json_schema=SCHEMA)
    assert reply.stop_reason == "eos"
    jsonschema.validate(json.loads(reply.text), SCHEMA)
