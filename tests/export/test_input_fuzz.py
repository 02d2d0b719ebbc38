"""Fuzzing the convert boundary (hypothesis): config.json fields, safetensors headers, index
files, tokenizers, and GGUF metadata (every type, arrays nested up to 30,000 deep). Every
generated case must end in exit 0 or exactly one `error:` line with exit 2, never a traceback
(an exception escaping the CLI fails the test).

Bounded twice: 25 examples per target (FUSELM_FUZZ_EXAMPLES), and a wall-clock budget per
target (FUSELM_FUZZ_BUDGET_S) after which the remaining examples are checked only up to where
convert starts its export (a case that converts runs a whole tiny export). Derandomized, so
CI sees the same cases every run. `pytest -s` prints the outcomes per target.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuselm.converter.errors import user_errors
from fuselm.export.decoder import Decoder
from fuselm.export.registry import decoder_spec
from fuselm.export.safetensors.checkpoint import Checkpoint
from fuselm.export.tensor_match import check_tensor_names
from fuselm.export.tokenizer_check import check_tokenizer
from tests.export.inputs import copy_model, error_line, run_cli, split_safetensors

# Seconds per target (a case that converts costs a whole tiny export); raise it to fuzz longer.
BUDGET_S = float(os.environ.get("FUSELM_FUZZ_BUDGET_S", "20"))
SETTINGS = settings(
    max_examples=int(os.environ.get("FUSELM_FUZZ_EXAMPLES", "25")),
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 1024),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, 1e-6, 1e6, 10000.0]),
    st.text(max_size=8),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=3),
    max_leaves=6,
)
CONFIG_KEYS = [
    "architectures", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size",
    "max_position_embeddings", "rms_norm_eps", "rope_parameters", "rope_theta", "rope_scaling",
    "tie_word_embeddings", "hidden_act", "sliding_window", "layer_types", "bos_token_id",
    "eos_token_id", "pad_token_id", "attention_bias", "torch_dtype",
]


class Target:
    """One fuzz target's model copy per example, its outcomes and its time budget."""

    def __init__(self, good: Path, name: str) -> None:
        self.good, self.name = good, name
        self.outcomes: Counter[str] = Counter()
        self.stop = time.monotonic() + BUDGET_S

    def convert(self, edit: Callable[[Path], None]) -> None:
        root = Path(tempfile.mkdtemp(prefix=f"fuzz-{self.name}-"))
        try:
            model = copy_model(self.good, root / "model")
            edit(model)
            if time.monotonic() > self.stop:
                self.boundary(model)
                return
            code, err = run_cli("convert", str(model), "-o", str(root / "out"), "--no-optimize",
                                "--quiet")
            if code == 0:
                self.outcomes["exit 0"] += 1
                assert (root / "out" / "fuselm.json").is_file()
            else:
                error_line(code, err)  # exactly one `error:` line, exit 2
                self.outcomes["error (exit 2)"] += 1
                assert not (root / "out").exists()
        finally:
            shutil.rmtree(root, ignore_errors=True)

    def boundary(self, model: Path) -> None:
        """Past the time budget: only what convert checks before tracing (config, tokenizer,
        headers, index, tensor names), through the same public functions; a user error is the
        CLI's `error:` line, anything else escapes as the traceback it would be."""
        try:
            spec = decoder_spec(model)
            check_tokenizer(model, spec.vocab_size)
            ckpt = Checkpoint(model)
            with torch.device("meta"):
                names = [s.hf_name for s in Decoder(spec, torch.float32).weight_sources().values()]
            check_tensor_names(names, ckpt.tensors, model, spec.num_layers,
                               spec.tie_word_embeddings)
        except user_errors() as e:
            assert "\n" not in str(e), str(e)
            self.outcomes["error at the boundary (budget spent)"] += 1
            return
        self.outcomes["valid at the boundary, not converted (budget spent)"] += 1


@pytest.fixture(scope="module")
def good(checkpoint: Callable[[str], Path]) -> Path:
    return checkpoint("qwen3")


@pytest.fixture
def target(good: Path, request: pytest.FixtureRequest) -> Iterator[Target]:
    t = Target(good, request.node.name)
    yield t
    print(f"\nfuzz {t.name}: {sum(t.outcomes.values())} cases, {dict(t.outcomes)}")
    assert sum(t.outcomes.values()) > 0


def _dump(value: Any) -> str:
    return json.dumps(value)  # NaN / Infinity too: Python's json (and HF's reader) allow them


@SETTINGS
@given(changes=st.lists(st.tuples(st.sampled_from(CONFIG_KEYS), VALUES | st.just(...)),
                        min_size=1, max_size=3))
def test_fuzz_config(target: Target, changes: list[tuple[str, Any]]) -> None:
    def edit(model: Path) -> None:
        path = model / "config.json"
        cfg = json.loads(path.read_text())
        for key, value in changes:
            if value is ...:
                cfg.pop(key, None)
            else:
                cfg[key] = value
        path.write_text(_dump(cfg))

    target.convert(edit)


HEADER_FIELDS = st.sampled_from(["dtype", "shape", "data_offsets"])
NEAR_INTS = st.lists(st.integers(-2, 2**40), max_size=3)


@SETTINGS
@given(
    kind=st.sampled_from(["field", "entry", "whole", "new entry", "length"]),
    field=HEADER_FIELDS,
    value=VALUES | NEAR_INTS | st.sampled_from(["F32", "F16", "BF16", "F8_E4M3", "I64", "X"]),
    which=st.integers(0, 100),
    length=st.integers(0, 2**64 - 1),
)
def test_fuzz_safetensors_header(
    target: Target, kind: str, field: str, value: Any, which: int, length: int
) -> None:
    def edit(model: Path) -> None:
        path = model / "model.safetensors"
        header, body = split_safetensors(path)
        names = sorted(k for k in header if k != "__metadata__")
        name = names[which % len(names)]
        if kind == "field":
            header[name][field] = value
        elif kind == "entry":
            header[name] = value
        elif kind == "whole":
            header = value
        elif kind == "new entry":
            header[f"extra.{which}"] = {"dtype": "F32", "shape": [1], field: value}
        raw = _dump(header).encode()
        prefix = struct.pack("<Q", length if kind == "length" else len(raw))
        path.write_bytes(prefix + raw + body)

    target.convert(edit)


SHARD_PATHS = st.sampled_from([
    "model.safetensors", "./model.safetensors", "../model.safetensors", "/etc/passwd",
    "", ".", "..", "sub/../model.safetensors", "missing.safetensors", "model.safetensors/",
    "/dev/zero", "config.json",
])


@SETTINGS
@given(
    weight_map=VALUES | st.dictionaries(st.text(max_size=4), SHARD_PATHS, min_size=1,
                                        max_size=3),
    wrap=st.booleans(),
)
def test_fuzz_index(target: Target, weight_map: Any, wrap: bool) -> None:
    def edit(model: Path) -> None:
        data = {"metadata": {}, "weight_map": weight_map} if wrap else weight_map
        (model / "model.safetensors.index.json").write_text(_dump(data))

    target.convert(edit)


TEMPLATES = st.text(alphabet="{}%#abc ()'.|_-=endforif ", max_size=24)


@SETTINGS
@given(
    kind=st.sampled_from(["key", "vocab id", "text", "template"]),
    key=st.sampled_from(["model", "added_tokens", "pre_tokenizer", "decoder", "normalizer",
                         "post_processor", "version"]),
    value=VALUES,
    token_id=st.integers(-3, 2**40),
    text=st.text(max_size=40),
    template=TEMPLATES,
)
def test_fuzz_tokenizer(
    target: Target, kind: str, key: str, value: Any, token_id: int, text: str, template: str
) -> None:
    def edit(model: Path) -> None:
        path = model / "tokenizer.json"
        if kind == "text":
            path.write_text(text)
            return
        if kind == "template":
            (model / "chat_template.jinja").write_text(template)
            return
        tok = json.loads(path.read_text())
        if kind == "key":
            tok[key] = value
        else:
            first = next(iter(tok["model"]["vocab"]))
            tok["model"]["vocab"][first] = token_id
        path.write_text(_dump(tok))

    target.convert(edit)



# GGUF metadata: every key the config mapping reads, given a value of any GGUF type (numbers
# of each width, strings, arrays) or an array nested up to 30,000 deep.
GGUF_KEYS = [f"llama.{k}" for k in (
    "embedding_length", "block_count", "feed_forward_length", "context_length",
    "attention.head_count", "attention.head_count_kv", "attention.key_length",
    "attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.dimension_count",
    "rope.scaling.type", "rope.scaling.factor", "vocab_size", "attention.sliding_window",
)] + ["general.architecture", "general.name", "general.alignment", "tokenizer.ggml.model",
      "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
      "tokenizer.ggml.padding_token_id", "tokenizer.ggml.tokens", "x.unknown"]
_INT_RANGES = {0: (0, 255), 1: (-128, 127), 2: (0, 2**16 - 1), 3: (-(2**15), 2**15 - 1),
               4: (0, 2**32 - 1), 5: (-(2**31), 2**31 - 1), 10: (0, 2**64 - 1),
               11: (-(2**63), 2**63 - 1)}


def _scalar(kind: int) -> st.SearchStrategy[Any]:
    if kind in _INT_RANGES:
        low, high = _INT_RANGES[kind]
        return st.one_of(st.integers(low, high), st.integers(max(low, -2), min(high, 8)))
    if kind in (6, 12):
        return st.floats(width=32 if kind == 6 else 64)
    if kind == 7:
        return st.booleans()
    return st.text(max_size=8)


@st.composite
def gguf_values(draw: st.DrawFn) -> bytes:
    from tests.export.gguf_files import gguf_value, nested_array

    shape = draw(st.sampled_from(["scalar", "array", "nested"]))
    if shape == "nested":
        return nested_array(draw(st.sampled_from([2, 8, 9, 64, 1000, 30000])))
    kind = draw(st.sampled_from([*_INT_RANGES, 6, 7, 8, 12]))
    if shape == "scalar":
        return gguf_value(kind, draw(_scalar(kind)))
    return gguf_value(9, draw(st.lists(_scalar(kind), max_size=4)), kind)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.export.gguf_files import write_gguf

    path, _ = write_gguf(tmp_path_factory.mktemp("fuzz-gguf") / "tiny.gguf", "llama", {},
                         seed=5)
    return path


@settings(SETTINGS, max_examples=min(SETTINGS.max_examples, 20))  # errors mostly: seconds
@given(changes=st.dictionaries(st.sampled_from(GGUF_KEYS), gguf_values(), min_size=1,
                               max_size=3))
def test_fuzz_gguf_metadata(target: Target, tiny_gguf: Path, changes: dict[str, bytes]) -> None:
    from fuselm.export.gguf.config import generation_config
    from fuselm.export.gguf.source import GGUFCheckpoint
    from tests.export.gguf_files import rewrite_gguf

    root = Path(tempfile.mkdtemp(prefix="fuzz-gguf-"))
    try:
        bad = rewrite_gguf(tiny_gguf, root / "model.gguf", changes)
        if time.monotonic() > target.stop:  # past the budget: the header and config mapping
            try:
                generation_config(GGUFCheckpoint(bad).gguf)
            except user_errors() as e:
                assert "\n" not in str(e), str(e)
                target.outcomes["error at the boundary (budget spent)"] += 1
                return
            target.outcomes["valid at the boundary, not converted (budget spent)"] += 1
            return
        code, err = run_cli("convert", str(bad), "-o", str(root / "out"), "--quiet")
        if code == 0:
            target.outcomes["exit 0"] += 1
        else:
            error_line(code, err)
            target.outcomes["error (exit 2)"] += 1
            assert not (root / "out").exists()
    finally:
        shutil.rmtree(root, ignore_errors=True)
