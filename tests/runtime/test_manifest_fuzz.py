"""Fuzz fuselm.json: any field set to any JSON value (or removed) ends in a run that works or in
one `error:` line with exit code 2 — never a traceback. Bounded: 30 examples. And the file
names it holds (`files`, `integrity.files`, `integrity.tensors`): a name that leads outside the
artifact folder (absolute, `..`, a symlink out) is always refused, never read. Bounded: 20."""

from __future__ import annotations

import collections
import copy
import json
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.runtime.test_integrity import cli

FIELDS = [
    "format", "format_version", "dtype", "model", "rope", "special_tokens", "files", "integrity",
    "quantization", "steps", "passes", "source", "versions",
    *(f"model.{k}" for k in ("architecture", "family", "hidden_size", "num_layers", "num_heads",
                             "num_kv_heads", "head_dim", "intermediate_size", "vocab_size",
                             "rms_norm_eps", "tie_word_embeddings", "context_length",
                             "sliding_window", "unknown_field")),
    *(f"rope.{k}" for k in ("type", "theta", "rotary_dim", "attention_scale", "interleaved",
                            "parameters")),
    *(f"special_tokens.{k}" for k in ("bos", "eos", "pad")),
    "files.data", "files.tokenizer", "integrity.files", "integrity.tensors", "integrity.algorithm",
]

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.sampled_from([0, 1, 2, 3, 24])
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                 max_size=3),
    max_leaves=6,
)
DELETE = object()
OUTCOMES: collections.Counter[str] = collections.Counter()
PATH_OUTCOMES: collections.Counter[str] = collections.Counter()


@pytest.fixture(scope="module")
def fuzz_art(qwen3_artifact: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fuzz") / "art"
    shutil.copytree(qwen3_artifact, out)
    return out


def _mutate(raw: dict, path: str, value: object) -> dict:
    raw = copy.deepcopy(raw)
    *parents, last = path.split(".", 1) if path.startswith(("files.", "integrity.")) \
        else path.split(".")
    node = raw
    for p in parents:
        if not isinstance(node.get(p), dict):
            node[p] = {}
        node = node[p]
    if value is DELETE:
        node.pop(last, None)
    else:
        node[last] = value
    return raw


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(path=st.sampled_from(FIELDS), value=st.just(DELETE) | JSON,
       engine=st.sampled_from(["onnxruntime", "mlx"]))
def test_manifest_fuzz(capsys, fuzz_art: Path, path: str, value: object, engine: str) -> None:  # noqa: ANN001
    original = (fuzz_art / "fuselm.json").read_text()
    try:
        (fuzz_art / "fuselm.json").write_text(json.dumps(_mutate(json.loads(original), path,
                                                                 value)))
        code, err = cli(capsys, "run", str(fuzz_art), "--prompt-ids", "1,2", "-n", "2",
                        "--engine", engine)
    finally:
        (fuzz_art / "fuselm.json").write_text(original)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    if code == 0:
        OUTCOMES["ran"] += 1
    else:
        assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (path, err)
        OUTCOMES["error line, exit 2"] += 1


# Path names from the parts that climb, root, link or confuse a path, plus any short text.
PART = st.sampled_from(["..", ".", "", "etc", "passwd", "model.onnx.data", "out", "link",
                        "x.data", "~", "a b", "\\", "..."])
NAME = (st.lists(PART, min_size=1, max_size=4).map("/".join)
        | st.lists(PART, min_size=1, max_size=3).map(lambda p: "/" + "/".join(p))
        | st.text(max_size=10))
WHERE = ["integrity.files", "integrity.tensors", "files.data", "files.tokenizer"]


def _place(raw: dict, where: str, name: str) -> dict:
    raw = copy.deepcopy(raw)
    if where == "integrity.files":
        raw["integrity"]["files"][name] = {"size": 1, "sha256": "0" * 64}
    elif where == "integrity.tensors":
        raw["integrity"]["tensors"][name] = {}
    elif where == "files.data":
        raw["files"]["data"] = name
    else:
        raw["files"]["tokenizer"] = [name]
    return raw


def _leads_out(root: Path, name: str) -> bool:
    from fuselm.runtime_metal.artifact_paths import name_problem

    return bool(name_problem(name)) or not (root / name).resolve().is_relative_to(
        root.resolve())


@settings(max_examples=20, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(name=NAME, where=st.sampled_from(WHERE), command=st.sampled_from(["verify", "run"]))
def test_manifest_path_fuzz(capsys, fuzz_art: Path, name: str, where: str,  # noqa: ANN001
                            command: str) -> None:
    link = fuzz_art / "link"
    if not link.is_symlink():  # a symlink out of the folder, for names through it
        link.symlink_to(fuzz_art.parent)
    original = (fuzz_art / "fuselm.json").read_text()
    try:
        (fuzz_art / "fuselm.json").write_text(json.dumps(_place(json.loads(original), where,
                                                                name)))
        args = ["--prompt-ids", "1,2", "-n", "2", "--engine", "onnxruntime"] \
            if command == "run" else []
        code, err = cli(capsys, command, str(fuzz_art), *args)
    finally:
        (fuzz_art / "fuselm.json").write_text(original)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    if code == 0:
        PATH_OUTCOMES["ran"] += 1
    else:
        assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (name, err)
        PATH_OUTCOMES["error line, exit 2"] += 1
    if where != "files.tokenizer" and _leads_out(fuzz_art, name):  # (tokenizer: names only)
        assert code == 2 and ("relative path inside" in err or "refuses it" in err), (name, err)
        PATH_OUTCOMES["refused: leads out"] += 1


def test_fuzz_outcomes_reported() -> None:
    """Prints the outcome counts of the fuzz runs above (for the benchmarks' notes)."""
    print(f"fuselm.json fuzz outcomes: {dict(OUTCOMES)}; path names: {dict(PATH_OUTCOMES)}")
    assert sum(OUTCOMES.values()) <= 30
