"""The default Q4 (`--quant q4` alone): the built-in calibration text, run through the float graph
in segments (passes/quant/q4_segments.py): error feedback (GPTQ) on the LM head, the
importance-weighted search on every other weight, blocks of 32 everywhere. Deterministic; the
segments compute what one session over the whole graph computes; a checkpoint without a
tokenizer, or `--no-calibration`, gets the data-free quantizer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from fuselm.converter.models.builtin import build_model
from fuselm.errors import FuselmError
from fuselm.passes.quant import q4_segments
from fuselm.passes.quant.q4_calibration import HEAD_ROLES, collect
from fuselm.passes.quant.q4_math import quantize_array, quantize_gptq
from fuselm.runtime_metal.artifact import read_manifest
from fuselm.runtime_metal.engine import make_engine
from fuselm.runtime_metal.validate import engine_logits, rel
from tests.runtime.conftest import convert


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny Qwen3 (tied head, GQA, head_dim != hidden / heads): HF dir, float32 artifact, the
    default Q4 twice (determinism) and one from a copy without tokenizer files."""
    root = tmp_path_factory.mktemp("q4default")
    hf = build_model(root / "hf", "qwen3", seed=9)
    bare = build_model(root / "bare", "qwen3", seed=9, tokenizer=False)
    return {
        "hf": hf,
        "float": convert(hf, root / "float"),
        "q4": convert(hf, root / "q4", quant="q4"),
        "again": convert(hf, root / "again", quant="q4"),
        "bare": convert(bare, root / "bare_q4", quant="q4"),
        "mixed": convert(hf, root / "mixed", quant="mixed"),
    }


def _pairs(model: onnx.ModelProto) -> list[tuple[str, str]]:
    inits = {t.name: t for t in model.graph.initializer}
    return [(n.input[0], n.input[1]) for n in model.graph.node
            if n.op_type in ("MatMul", "FusedQKV", "FusedGateUp") and n.input[1] in inits
            and len(inits[n.input[1]].dims) == 2]


def test_segments_compute_what_one_session_computes(models: dict[str, Path]) -> None:
    """Every weighted node in its own segment vs the whole graph in one segment: the same
    activations (rel <= 1e-5: onnxruntime may fuse differently across a cut), and the plan
    skips the LM head's MatMul (only its input is wanted) and gathers the table in NumPy."""
    model = onnx.load(str(models["float"] / "model.onnx"))
    acts = {a: onnx.TensorProto.FLOAT for a, _ in _pairs(model)}
    tokens = tuple(int(i) for i in np.random.default_rng(3).integers(4, 384, 100))
    small = q4_segments.plan(model, list(acts), segment_bytes=1)
    whole = q4_segments.plan(model, list(acts), segment_bytes=1 << 40)
    assert len(small) > len(acts) // 2
    assert sum(s.numpy_gather is not None for s in whole) == 1  # the table, in NumPy
    ops = ("MatMul", "FusedQKV", "FusedGateUp")
    assert sum(any(n.op_type in ops for n in s.nodes) for s in whole) == 1  # one session
    assert not any(n.output[0] == "logits" for s in small for n in s.nodes)
    a = collect(model, numpy_helper.to_array, tokens, acts, context=64, gram=False,
                segment_bytes=1)
    b = collect(model, numpy_helper.to_array, tokens, acts, context=64, gram=False,
                segment_bytes=1 << 40)
    for name in acts:
        assert a[name].count == b[name].count == 100
        assert rel(a[name].sq, b[name].sq) <= 1e-5


def test_default_is_calibrated_block_32_and_deterministic(models: dict[str, Path]) -> None:
    q = read_manifest(models["q4"]).quantization
    assert q is not None and q["bits_budget"] is None and q["block_size"] == 32
    cal = q["calibration"]
    assert cal["file"] == "calibration.txt (built-in)" and cal["tokens"] >= 1000
    assert cal["method"].startswith("gptq for lm_head/tied_embedding_lm_head")
    ts = q["tensors"]
    assert {t["block_size"] for t in ts} == {32}
    assert {t["role"] for t in ts if t["calibration"] == "gptq"} == {"tied_embedding_lm_head"}
    assert all(t["calibration"] == "importance" for t in ts if t["role"] not in HEAD_ROLES)
    a = (models["q4"] / "model.onnx.data").read_bytes()
    assert a == (models["again"] / "model.onnx.data").read_bytes()


def test_default_codes_are_the_search_and_the_heads_gptq(models: dict[str, Path]) -> None:
    """The stored codes of a layer's tensor are quantize_array's with the calibration
    activations' mean squares as importance; the tied LM head's are quantize_gptq's on its
    input's Gram matrix; both at block 32 and from the same text."""
    from fuselm.converter.calibration_input import builtin_calibration

    cal = builtin_calibration(models["hf"])
    assert cal is not None and cal.gram and cal.feedback_roles == HEAD_ROLES
    model = onnx.load(str(models["float"] / "model.onnx"))
    pairs = _pairs(model)
    head_act = next(n.input[0] for n in model.graph.node
                    if n.op_type == "MatMul" and n.output[0] == "logits")
    acts = {a: onnx.TensorProto.FLOAT for a in [a for a, _ in pairs] + [head_act]}
    moments = collect(model, numpy_helper.to_array, cal.tokens, acts, cal.context, gram=True)
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    q = read_manifest(models["q4"]).quantization
    qm = onnx.load(str(models["q4"] / "model.onnx"))
    qinits = {t.name: t for t in qm.graph.initializer}
    for role in ("fused:FusedQKV", "linear"):
        rec = next(t for t in q["tensors"] if t["role"] == role)
        act = next(a for a, w in pairs if w == rec["name"])
        want = quantize_array(inits[rec["name"]], rec["block_size"],
                              importance=moments[act].sq)
        got = numpy_helper.to_array(qinits[rec["codes"]]).astype(np.uint8)
        assert np.array_equal(got, want.codes)
    head = next(t for t in q["tensors"] if t["role"] == "tied_embedding_lm_head")
    want = quantize_gptq(inits[head["name"]].T, moments[head_act].gram, 32)
    got = numpy_helper.to_array(qinits[head["codes"]]).astype(np.uint8)
    assert np.array_equal(got, want.codes)


def test_default_mlx_equals_onnxruntime(models: dict[str, Path]) -> None:
    mlx_engine = make_engine(models["q4"], "mlx")
    ort_engine = make_engine(models["q4"], "onnxruntime", accuracy_level=0)
    prompt = [int(i) for i in np.random.default_rng(2).integers(4, 384, 30)]
    assert rel(engine_logits(mlx_engine, prompt, 6), engine_logits(ort_engine, prompt, 6)) <= 1e-3


def test_without_tokenizer_or_flag_the_default_is_data_free(
    models: dict[str, Path], tmp_path: Path
) -> None:
    q = read_manifest(models["bare"]).quantization
    assert q["calibration"] is None and q["norm_importance"] and q["bits_budget"] is None
    assert {t["block_size"] for t in q["tensors"]} == {32}
    with pytest.raises(FuselmError, match="contradict"):
        convert(models["hf"], tmp_path / "x", quant="q4", calibration="any.txt",
                default_calibration=False)
    assert not (tmp_path / "x").exists()


def test_builtin_tokens_equal_transformers_tokenizer(models: dict[str, Path]) -> None:
    """The calibration text is tokenized with the `tokenizers` library (no torch import): the
    same ids as the checkpoint's transformers tokenizer, no special tokens, the whole text."""
    from importlib import resources

    from transformers import AutoTokenizer

    from fuselm.converter.calibration_input import BUILTIN_FILE, builtin_calibration

    text = (resources.files("fuselm.passes") / BUILTIN_FILE).read_text(encoding="utf-8")
    want = AutoTokenizer.from_pretrained(str(models["hf"])).encode(text, add_special_tokens=False)
    calib = builtin_calibration(models["hf"])
    assert calib is not None and list(calib.tokens) == want


def test_builtin_calibration_skips_large_models(models: dict[str, Path]) -> None:
    """Past BUILTIN_MAX_WEIGHTS linear weights the default is data-free (an 8B model's forward
    and block choice cost minutes on a CPU); the Llama-3.1-8B shape counts 7.5B."""
    from dataclasses import replace

    from fuselm.converter.calibration_input import (
        BUILTIN_MAX_WEIGHTS,
        builtin_calibration,
        linear_weights,
    )
    from fuselm.export.registry import decoder_spec

    spec = decoder_spec(models["hf"])
    assert builtin_calibration(models["hf"], spec) is not None
    big = replace(spec, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                  head_dim=128, intermediate_size=14336, vocab_size=128256)
    assert linear_weights(big) == 7_504_658_432 > BUILTIN_MAX_WEIGHTS
    assert builtin_calibration(models["hf"], big) is None


def test_mixed_preset_puts_the_most_sensitive_tensors_at_6_or_8_bits(models: dict[str, Path]
                                                                     ) -> None:
    """`--quant mixed`: the tensors choose_bits picks from the built-in text's importance under
    the default budget (MIXED_BITS_BUDGET bits per weight) are stored as 6- or 8-bit blocks
    (quantize_wide's codes at the chosen bits and block size, 6-bit ones packed), the rest as
    the default 4-bit; the choice is recorded, shown by quant-report, and the artifact runs
    the same on both engines."""
    from click.testing import CliRunner

    from fuselm.converter.calibration_input import builtin_calibration
    from fuselm.converter.cli.main import cli
    from fuselm.passes.ops import unpack_uint6_reference
    from fuselm.passes.quant.options import MIXED_BITS_BUDGET
    from fuselm.passes.quant.q4_allocate import choose_bits, mixed_bits_per_weight
    from fuselm.passes.quant.q8_math import quantize_wide

    q = read_manifest(models["mixed"]).quantization
    assert q is not None and q["bits"] == "mixed 4/6/8"
    eight, six = q["mixed"]["eight_bit"], q["mixed"]["six_bit"]
    assert eight and six and q["mixed"]["bits_budget"] == MIXED_BITS_BUDGET
    ts = {t["name"]: t for t in q["tensors"]}
    assert {n for n, t in ts.items() if t.get("bits", 4) == 8} == set(eight)
    assert {n for n, t in ts.items() if t.get("bits", 4) == 6} == set(six)
    size = {n: int(np.prod(t["shape"])) for n, t in ts.items()}
    plan = {n: (t.get("bits", 4), t["block_size"]) for n, t in ts.items()}
    assert sum(size[n] * mixed_bits_per_weight(*plan[n]) for n in ts) \
        <= MIXED_BITS_BUDGET * sum(size.values())
    # the choice is choose_bits's on the float graph's weights and the text's importance
    cal = builtin_calibration(models["hf"])
    assert cal is not None
    model = onnx.load(str(models["float"] / "model.onnx"))
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    head_act = next(n.input[0] for n in model.graph.node
                    if n.op_type == "MatMul" and n.output[0] == "logits")
    acts = dict(_pairs(model))
    acts_of = {w: a for a, w in acts.items()}
    moments = collect(model, numpy_helper.to_array, cal.tokens,
                      {a: onnx.TensorProto.FLOAT for a in [*acts, head_act]}, cal.context,
                      gram=False)
    items = []
    for n, t in ts.items():
        kn = inits[n].T if t["role"] in HEAD_ROLES else inits[n]
        items.append((n, lambda kn=kn: kn, head_act if t["role"] in HEAD_ROLES else acts_of[n]))
    imp = {k: v.sq for k, v in moments.items()}
    assert choose_bits(items, MIXED_BITS_BUDGET, 32, importance=imp) == plan
    qm = onnx.load(str(models["mixed"] / "model.onnx"))
    qinits = {t.name: t for t in qm.graph.initializer}
    for n in eight + six:
        kn = inits[n].T if ts[n]["role"] in HEAD_ROLES else inits[n]
        got = numpy_helper.to_array(qinits[ts[n]["codes"]])
        assert got.dtype == np.uint8
        if n in six:
            got = unpack_uint6_reference(got)
        assert np.array_equal(got, quantize_wide(kn, plan[n][1], bits=plan[n][0]).codes)
    four = next(n for n in ts if n not in eight + six)
    assert ts[four].get("bits", 4) == 4
    text = CliRunner().invoke(cli, ["quant-report", str(models["mixed"])]).output
    assert f"mixed: {len(eight)} tensors at 8 bits, {len(six)} at 6 bits" in text
    mlx_engine = make_engine(models["mixed"], "mlx")
    ort_engine = make_engine(models["mixed"], "onnxruntime", accuracy_level=0)
    prompt = [int(i) for i in np.random.default_rng(2).integers(4, 384, 30)]
    assert rel(engine_logits(mlx_engine, prompt, 6), engine_logits(ort_engine, prompt, 6)) <= 1e-3


def test_mixed_preset_refuses_its_contradictions() -> None:
    from fuselm.passes.errors import PassesError
    from fuselm.passes.quant.options import quant_options

    assert quant_options("mixed").mixed and quant_options("mixed").bits == 4
    assert quant_options("mixed", bits_budget=7.0).mixed_budget == 7.0
    with pytest.raises(PassesError, match="--bits-budget 4.45 is out of range; give 4.625"):
        quant_options("mixed", bits_budget=4.45)  # below every tensor at 4 bits
    with pytest.raises(PassesError, match="contradict"):
        quant_options("mixed", q_bits=8)
