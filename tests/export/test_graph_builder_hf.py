"""The graph builder (export/graph_builder.py) on HF safetensors checkpoints, against the trace
(export/onnx_export.py), its oracle: for every registered family the builder writes the trace's
plain decoder graph node for node (float32 and float16); the same checkpoint converted both ways
(FUSELM_EXPORT=torch traces) gives the same fused graph and the very same model.onnx.data, byte
for byte (RoPE scaling, a sliding window, a bf16 sharded checkpoint quantized to Q4 with the
default calibration included), the passes doing the fusing in both; the builder's artifact
gives onnxruntime's logits on MLX and transformers' greedy tokens."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from fuselm.converter.exporter_choice import BUILDER, EXPORT_ENV, exporter_for, trace_reason
from fuselm.converter.models.builtin import build_model as build_checkpoint
from fuselm.export.graph_builder import build_model
from fuselm.export.onnx_export import export_model
from fuselm.export.registry import decoder_spec, model_types
from fuselm.runtime_metal.artifact import read_manifest
from fuselm.runtime_metal.engine import make_engine
from fuselm.runtime_metal.generate import generate
from fuselm.runtime_metal.validate import engine_logits, hf_greedy, hf_model, rel
from tests.export.graph_compare import canonical, params
from tests.export.helpers import convert_with_env
from tests.families import TEST_CONFIGS

# conftest CASES: qwen3 (q/k-norm, tied head, head_dim 24 != 64 / 4, GQA 4:2), qwen2 GQA 4:1
# with q/k/v biases, llama MHA with attention and MLP biases, mistral with a sliding window 8,
# YaRN RoPE scaling (attention scale included); bf16 + sharded in Q4 (default, calibrated).
FLOAT_CASES = ["qwen3", "qwen2-mqa", "llama-bias-mha", "mistral-window", "qwen3-yarn"]
Q4_CASE = "llama-bf16-sharded"
PROMPT = [5, 17, 99, 200, 3, 42, 7, 300, 11, 64, 2, 130]


def _convert(src: Path, out: Path, exporter: str, **options: Any) -> Path:
    return convert_with_env(EXPORT_ENV, exporter, src, out, **options)


@pytest.fixture(scope="session")
def pairs(checkpoint: Any, tmp_path_factory: pytest.TempPathFactory
          ) -> dict[str, tuple[Path, Path]]:
    """(trace, builder) artifacts: float32 for FLOAT_CASES, the default dtype in Q4 for Q4_CASE."""
    root = tmp_path_factory.mktemp("graph_builder_hf")
    out = {}
    for case in FLOAT_CASES:
        out[case] = (_convert(checkpoint(case), root / f"{case}-torch", "torch", dtype="float32"),
                     _convert(checkpoint(case), root / f"{case}-built", "", dtype="float32"))
    out[Q4_CASE] = (_convert(checkpoint(Q4_CASE), root / "q4-torch", "torch", quant="q4"),
                    _convert(checkpoint(Q4_CASE), root / "q4-built", "", quant="q4"))
    return out


def _nodes(model: onnx.ModelProto) -> list[tuple[Any, ...]]:
    """Each node's op, domain, attributes and which inputs are present (names aside)."""
    return [(n.op_type, n.domain,
             sorted((a.name, repr(helper.get_attribute_value(a))) for a in n.attribute),
             [bool(i) for i in n.input], len(n.output)) for n in model.graph.node]


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("case", [*FLOAT_CASES, Q4_CASE])
def test_same_graph_and_data_file(pairs: dict[str, tuple[Path, Path]], case: str) -> None:
    torch_dir, built_dir = pairs[case]
    ours = onnx.load(str(built_dir / "model.onnx"))
    theirs = onnx.load(str(torch_dir / "model.onnx"))
    assert _nodes(ours) == _nodes(theirs)
    assert ([(v.name, v.type) for v in ours.graph.input] ==
            [(v.name, v.type) for v in theirs.graph.input])
    assert ([(v.name, v.type) for v in ours.graph.output] ==
            [(v.name, v.type) for v in theirs.graph.output])
    assert [f.SerializeToString() for f in ours.functions] == \
        [f.SerializeToString() for f in theirs.functions]
    a = [numpy_helper.to_array(t) for t in ours.graph.initializer]
    b = [numpy_helper.to_array(t) for t in theirs.graph.initializer]
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y)
    # the same tensors in the same order: the data files are the same bytes
    assert _digest(built_dir / "model.onnx.data") == _digest(torch_dir / "model.onnx.data")
    assert not (built_dir / "raw.onnx.data").exists()


@pytest.mark.parametrize("case", [*FLOAT_CASES, Q4_CASE])
def test_manifest_names_the_exporter(pairs: dict[str, tuple[Path, Path]], case: str) -> None:
    torch_dir, built_dir = pairs[case]
    ours, theirs = read_manifest(built_dir), read_manifest(torch_dir)
    assert ours.model == theirs.model and ours.rope == theirs.rope
    assert (ours.dtype, ours.special_tokens, ours.files, ours.steps) == (
        theirs.dtype, theirs.special_tokens, theirs.files, theirs.steps)
    assert ours.source["exporter"] == BUILDER
    assert theirs.source["exporter"] == f"torch ({EXPORT_ENV}=torch)"
    assert ours.source["checkpoint_dtype"] == theirs.source["checkpoint_dtype"]
    # the passes do the fusing for both: the same report, pass by pass
    layers = ours.model.num_layers
    for manifest in (ours, theirs):
        matches = {e["name"]: e["matches"] for e in manifest.passes["passes"]}
        assert matches["qkv"] == matches["gate_up"] == layers, matches
    assert [{k: e[k] for k in ("name", "matches", "nodes_before", "nodes_after", "op_delta")}
            for e in ours.passes["passes"]] == \
        [{k: e[k] for k in ("name", "matches", "nodes_before", "nodes_after", "op_delta")}
         for e in theirs.passes["passes"]]
    if case == Q4_CASE:
        q, t = dict(ours.quantization), dict(theirs.quantization)
        assert q["calibration"]["file"] == "calibration.txt (built-in)"
        for rec in (q, t):  # the calibration forward's wall time differs from run to run
            rec["calibration"] = {k: v for k, v in rec["calibration"].items() if k != "seconds"}
        keys = ("role", "shape", "block_size", "bits_per_weight", "rel_rms_error")
        assert [{k: e[k] for k in keys} for e in q.pop("tensors")] == \
            [{k: e[k] for k in keys} for e in t.pop("tensors")]  # the same but for the names
        assert q == t


@pytest.mark.parametrize("case", ["qwen3", "qwen2-mqa", "mistral-window", "qwen3-yarn"])
def test_logits_ort_equal_mlx_and_greedy_equal_transformers(
        pairs: dict[str, tuple[Path, Path]], checkpoint: Any, case: str) -> None:
    built = pairs[case][1]
    ort_engine = make_engine(built, "onnxruntime", accuracy_level=0)
    mlx_engine = make_engine(built, "mlx")
    assert rel(engine_logits(mlx_engine, PROMPT, 512),
               engine_logits(ort_engine, PROMPT, 512)) <= 1e-4
    want = hf_greedy(hf_model(checkpoint(case)), PROMPT, 16)
    assert generate(ort_engine, PROMPT, max_new_tokens=16).tokens == want
    assert generate(mlx_engine, PROMPT, max_new_tokens=16).tokens == want


@pytest.fixture(scope="session")
def family_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny checkpoint of every registered family, with its test quirks (tests/families.py)."""
    root = tmp_path_factory.mktemp("builder_families")
    return {f: build_checkpoint(root / f, f, seed=3, tokenizer=False, **TEST_CONFIGS.get(f, {}))
            for f in model_types()}


@pytest.mark.parametrize("family", model_types())
def test_plain_graph_equals_the_trace(family_checkpoints: dict[str, Path], family: str,
                                      tmp_path: Path) -> None:
    """The builder's graph is the trace's, node for node: the same ops, attributes, inputs
    (graph inputs, the decoder's parameters by name, small constants by value, earlier nodes
    by position), the same parameters in the same order, the same functions; float16 and
    bfloat16 for the families whose graph holds float constants (scales, caps)."""
    src = family_checkpoints[family]
    dtypes = ["float32", "float16", "bfloat16"] if family in ("gemma2", "granite") \
        else ["float32"]
    for dtype in dtypes:
        traced = export_model(src, tmp_path / "raw.onnx", dtype, in_memory=True)
        built = build_model(src, tmp_path / "raw.onnx", dtype, in_memory=True)
        a, b = traced.model, built.model
        assert canonical(b) == canonical(a), (family, dtype)
        assert params(b) == params(a)
        assert [(v.name, v.type) for v in b.graph.input] == \
            [(v.name, v.type) for v in a.graph.input]
        assert [(v.name, v.type) for v in b.graph.output] == \
            [(v.name, v.type) for v in a.graph.output]
        assert [f.SerializeToString() for f in b.functions] == \
            [f.SerializeToString() for f in a.functions]
        assert b.opset_import == a.opset_import
        assert sorted(built.sources) == sorted(traced.sources)
        for name in built.sources:  # the recipes give the same values, laid out alike
            x, y = built.sources[name](), traced.sources[name]()
            assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), name
        assert built.weight_bytes == traced.weight_bytes
    assert not list(tmp_path.iterdir())  # in memory: nothing written


def test_the_builder_exports_every_conversion(checkpoint: Any) -> None:
    """Every family, fused or not: the builder; the trace only when FUSELM_EXPORT=torch asks
    (or GGUF input needs it), named as fuselm.json names it."""
    for case in ("qwen3", "phi3"):
        assert trace_reason() is None
        assert exporter_for(decoder_spec(checkpoint(case)))[1] == BUILDER
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(EXPORT_ENV, "torch")
        exporter, label = exporter_for(decoder_spec(checkpoint("phi3")))
        assert (exporter, label) == (export_model, f"torch ({EXPORT_ENV}=torch)")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_weight_screen_on_arrays_agrees_with_torch(dtype: str) -> None:
    """The builder screens NumPy arrays (bfloat16 as ml_dtypes') on their bits; the verdicts
    are the exporter's torch screen's: NaN and Inf refused or recorded, float16 overflow named
    at the same threshold, the largest finite values let through."""
    import ml_dtypes
    import torch

    from fuselm.export.errors import ExportError
    from fuselm.export.weight_screen import WeightScreen

    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    rng = np.random.default_rng(0)
    cases = {"normal": rng.standard_normal(5000).astype(np.float32),
             "nan": np.array([1.0, np.nan, -2.0], np.float32),
             "-inf": np.array([1.0, -np.inf], np.float32),
             "edge": np.array([65504.0, -65504.0, -0.0], np.float32),
             "big": np.array([3.0, -1e6], np.float32)}
    for name, values in cases.items():
        with np.errstate(over="ignore"):  # 1e6 in float16 is inf: a non-finite case too
            arr = values.astype(np_dtype)
        tensor = torch.from_numpy(arr.astype(np.float32)).to(getattr(torch, dtype))
        verdicts = []
        for value in (arr, tensor):
            try:
                screen = WeightScreen("float16", allow_nonfinite=name in ("nan", "-inf"))
                screen(name, value)
                verdicts.append(("ok", screen.nonfinite))
            except ExportError as e:
                verdicts.append(("refused", str(e).split(" holds ")[0]))
        assert verdicts[0] == verdicts[1], (name, verdicts)
    with pytest.raises(ExportError, match="1 NaN"):
        WeightScreen("float32")("w", cases["nan"].astype(np_dtype))
