"""Fuzz fuselm.json: any field set to any JSON value (or removed) ends in a run that works or in
one `error:` line with exit code 2 — never a traceback. Bounded: 30 examples."""

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


def test_fuzz_outcomes_reported() -> None:
    """Prints the outcome counts of the fuzz run above (for the benchmarks' notes)."""
    print(f"fuselm.json fuzz outcomes: {dict(OUTCOMES)}")
    assert sum(OUTCOMES.values()) <= 30
