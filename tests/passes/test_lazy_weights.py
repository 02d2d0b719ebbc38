"""Weights stay on disk: the pipeline reads only the weights it packs or quantizes, once each.

Every decode of external bytes goes through passes.weights (a model loaded without its external
data has no other way to its values: onnx's own reader is never pointed at the data), and
`weights.recording()` logs each one. The lazy path must give exactly what the in-memory path
gives.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import numpy_helper

from fuselm.converter.cli.optimize_cmd import optimize
from fuselm.converter.errors import UserError
from fuselm.passes import weights
from fuselm.passes.manager import run_pipeline
from fuselm.passes.quant.options import QuantOptions
from fuselm.passes.quant.quantize import QuantizeQ4
from fuselm.passes.writer import ALIGN, write_model


@pytest.fixture(scope="module")
def raw(model_dir, tmp_path_factory) -> Path:  # noqa: ANN001
    """Our exporter's raw.onnx for qwen2 (q/k/v biases, so packing covers biases too)."""
    from fuselm.export.onnx_export import export_model

    path = tmp_path_factory.mktemp("lazy") / "raw.onnx"
    export_model(model_dir("qwen2"), path)
    return path


def _values(path: Path) -> dict[str, np.ndarray]:
    model = onnx.load(str(path), load_external_data=True)
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def _same(lazy: Path, eager: onnx.ModelProto) -> None:
    got = onnx.load(str(lazy), load_external_data=True)
    assert [n.SerializeToString() for n in got.graph.node] == \
        [n.SerializeToString() for n in eager.graph.node]
    want = {t.name: numpy_helper.to_array(t) for t in eager.graph.initializer}
    have = {t.name: numpy_helper.to_array(t) for t in got.graph.initializer}
    assert list(have) == list(want)
    for name, v in want.items():
        assert have[name].dtype == v.dtype and have[name].tobytes() == v.tobytes(), name


DATA_FREE = QuantOptions(norm_importance=False)  # the quantized weights are all it reads


def _lazy_run(raw: Path, out: Path, quantize: QuantizeQ4 | None) -> tuple[list[str], list[str]]:
    """(weights read by the passes, weights read while writing) for one lazy conversion."""
    model = onnx.load(str(raw), load_external_data=False)
    deferred: dict = {}
    with weights.recording() as in_passes:
        result, _ = run_pipeline(model, quantize=quantize, base_dir=raw.parent,
                                 deferred=deferred)
    with weights.recording() as in_writer:
        write_model(result, out, base_dir=raw.parent, deferred=deferred)
    return in_passes, in_writer


@pytest.mark.parametrize("quant", [False, True])
def test_only_packed_or_quantized_weights_are_read(raw: Path, tmp_path: Path, quant: bool) -> None:
    out = tmp_path / "model.onnx"
    in_passes, in_writer = _lazy_run(raw, out, QuantizeQ4(DATA_FREE) if quant else None)

    raw_names = {t.name for t in onnx.load(str(raw), load_external_data=False).graph.initializer}
    out_names = {t.name for t in onnx.load(str(out), load_external_data=False).graph.initializer}
    replaced = raw_names - out_names  # packed into a fused weight, or quantized
    assert replaced and "embed" in out_names  # the (unquantized) embedding is never read
    if quant:
        # Quantization reads each weight it replaces, once; the writer only copies bytes.
        assert sorted(in_passes) == sorted(replaced) and len(set(in_passes)) == len(in_passes)
        assert in_writer == []
    else:
        # Packed weights are read once, while being written; only packed tensors too small to
        # go to the data file (here the q/k/v biases) are computed when the graph is exported.
        both = in_passes + in_writer
        assert sorted(both) == sorted(replaced)
        assert all(n.endswith("bias") for n in in_passes) and len(in_writer) > len(in_passes)

    eager, _ = run_pipeline(onnx.load(str(raw), load_external_data=True),
                            quantize=QuantizeQ4(DATA_FREE) if quant else None)
    _same(out, eager)


def test_data_file_is_aligned_and_small_tensors_inline(raw: Path, tmp_path: Path) -> None:
    out = tmp_path / "model.onnx"
    _lazy_run(raw, out, None)
    model = onnx.load(str(out), load_external_data=False)
    for t in model.graph.initializer:
        if weights.is_external(t):
            _, offset, length = weights.external_span(t, tmp_path)
            assert offset % ALIGN == 0 and length >= 1024, t.name
        else:
            assert len(t.raw_data) < 1024 or not t.HasField("raw_data"), t.name
    onnx.checker.check_model(str(out))


def test_optimize_streams_external_weights(raw: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.onnx"
    with weights.recording() as reads:
        r = CliRunner().invoke(optimize, [str(raw), "-o", str(out), "--json"])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "out.onnx.data").is_file()
    eager, _ = run_pipeline(onnx.load(str(raw), load_external_data=True))
    _same(out, eager)
    raw_names = {t.name for t in onnx.load(str(raw), load_external_data=False).graph.initializer}
    packed = raw_names - set(_values(out))
    assert sorted(reads) == sorted(packed)  # each packed part once, while being written


def test_optimize_reports_missing_external_data(raw: Path, tmp_path: Path) -> None:
    model = onnx.load(str(raw), load_external_data=False)
    lonely = tmp_path / "lonely.onnx"
    onnx.save(model, str(lonely))  # points at raw.onnx.data, which is not beside it
    r = CliRunner().invoke(optimize, [str(lonely), "-o", str(tmp_path / "o.onnx")])
    assert isinstance(r.exception, UserError) and "is missing" in str(r.exception)


@pytest.mark.parametrize("exporter", ["builder", "torch"])
@pytest.mark.parametrize("keep", [True, False])
def test_convert_reads_only_the_weights_it_quantizes(model_dir, tmp_path: Path,  # noqa: ANN001
                                                      keep: bool, exporter: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """`fuselm convert --quant q4 --no-calibration --block-size 32` end to end: norms are read
    once; the tied embedding / LM head is read once when quantized (the default) and never with
    --no-quant-lm-head. A bits budget (--bits-budget) reads each weight twice, one at a time:
    once to measure its error at each block size, once to quantize it; each norm weight once.
    The calibrated default reads each weight at most three times: the segmented forward for the
    input importances, a second one that collects the Gram matrix of the weight GPTQ rounds
    (the LM head's), the quantization.

    keep=True goes through raw.onnx.data (--keep-intermediate), whose bytes the writer copies
    undecoded. Without it the weights come from the checkpoint itself (export's
    ComputedValues): the small norms are read with the graph, before the passes, and a float
    weight is decoded once by the writer (the float head here); still nothing twice.

    Both exporters write q/k/v and gate/up as separate weights; the pairing passes pack them
    from their parts, read part by part."""
    from collections import Counter

    from fuselm.converter.exporter_choice import EXPORT_ENV
    from fuselm.converter.pipeline import ConvertOptions, convert

    monkeypatch.setenv(EXPORT_ENV, "torch" if exporter == "torch" else "")

    free = {"quant": "q4", "default_calibration": False, "keep_intermediate": keep}
    with weights.recording() as reads:
        convert(model_dir("qwen3"), tmp_path / "out",
                ConvertOptions.from_flags(**free, block_size=32))
    with weights.recording() as float_head_reads:
        convert(model_dir("qwen3"), tmp_path / "out2",
                ConvertOptions.from_flags(**free, quant_lm_head=False, block_size=32))
    with weights.recording() as budget_reads:
        convert(model_dir("qwen3"), tmp_path / "out3",
                ConvertOptions.from_flags(**free, bits_budget=4.45))
    from fuselm.converter.models.builtin import build_model
    from tests.passes.conftest import CASES

    family, kw = CASES["qwen3"]
    with_tokenizer = build_model(tmp_path / "hf", family, **kw)  # the calibration needs one
    with weights.recording() as default_reads:
        convert(with_tokenizer, tmp_path / "out4",
                ConvertOptions(quant=QuantOptions(), keep_intermediate=keep))
    layers = json.loads((tmp_path / "out" / "fuselm.json").read_text())["model"]["num_layers"]
    linear = [f"{p}_proj" for p in ("q", "k", "v", "o", "gate", "up", "down")]
    want = [f"layers.{i}.{p}.weight" for i in range(layers) for p in linear]

    def weights_after_norms(got: list[str], n_norms: int) -> list[str]:
        # each RMSNorm weight feeding a quantized weight is read once first (gamma^2 weights
        # its input channels in the search); nothing else
        n_norms = n_norms if keep else 0  # in the graph already (64 values: stored inline)
        norms = got[:n_norms]
        assert len(set(norms)) == n_norms and all("norm" in n for n in norms), got
        return got[n_norms:]

    assert weights_after_norms(reads, 2 * layers + 1) == [*want, "embed"]
    assert weights_after_norms(float_head_reads, 2 * layers) == want + ([] if keep else ["embed"])
    assert weights_after_norms(budget_reads, 2 * layers + 1) == [*want, "embed"] * 2
    counts = Counter(default_reads)
    assert all(2 <= counts[w] <= 3 for w in [*want, "embed"]), counts
    extra = set(counts) - {*want, "embed"}  # norms: read by the passes only from raw.onnx.data
    assert all("norm" in n for n in extra) and (bool(extra) or not keep), counts


def test_quantized_tensors_spill_to_disk(raw: Path, tmp_path: Path) -> None:
    """With `spill_dir` (the convert pipeline's setting) the quantize pass holds no quantized
    bytes: every new tensor is a reference into SPILL_FILE from the moment it is made, the
    writer copies it without decoding, and the saved model equals the in-memory run's."""
    import shutil

    from onnx import TensorProto

    from fuselm.passes.quant.quantize import SPILL_FILE

    for name in (raw.name, raw.name + ".data"):
        shutil.copy(raw.parent / name, tmp_path / name)
    model = onnx.load(str(tmp_path / raw.name), load_external_data=False)
    deferred: dict = {}
    result, _ = run_pipeline(model, quantize=QuantizeQ4(DATA_FREE, spill_dir=tmp_path),
                             base_dir=tmp_path, deferred=deferred)
    q4 = [t for t in result.graph.initializer if t.data_type == TensorProto.UINT4]
    assert q4 and not any(t.name in deferred for t in q4)
    for t in q4:
        assert weights.is_external(t) and not t.HasField("raw_data"), t.name
        assert weights.external_span(t, tmp_path)[0].name == SPILL_FILE
    out = tmp_path / "model.onnx"
    with weights.recording() as in_writer:
        write_model(result, out, base_dir=tmp_path, deferred=deferred)
    assert in_writer == []
    eager, _ = run_pipeline(onnx.load(str(raw), load_external_data=True),
                            quantize=QuantizeQ4(DATA_FREE))
    _same(out, eager)
