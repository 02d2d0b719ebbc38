"""The torch-free GGUF graph builder (export/graph_builder.py) against the trace, its oracle:
the same GGUF converted both ways (FUSELM_EXPORT=torch traces) must give the same fused
graph node for node (the passes fusing both), the same weights bit for bit, the same logits and
greedy tokens on both engines — and the builder's conversion must not import torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from fuselm.config import EXPORT_ENV
from fuselm.converter.exporter_choice import BUILDER
from fuselm.runtime_metal.artifact import read_manifest
from fuselm.runtime_metal.engine import make_engine
from fuselm.runtime_metal.generate import generate
from fuselm.runtime_metal.validate import engine_logits, rel
from tests.export.gguf_files import write_gguf
from tests.export.helpers import convert_with_env

SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, vocab_size=384)
# llama: GQA 4:2, head_dim 24 != 64 / 4, biases on attention and MLP, untied, block types;
# qwen3: q/k-norm, tied, MHA; mistral (a llama file named Mistral): sliding window 8.
CASES: dict[str, tuple[str, str | None, dict[str, Any], dict[str, str]]] = {
    "llama": ("llama", None, dict(num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                                  attention_bias=True, mlp_bias=True),
              {"attn_v": "Q8_0", "ffn_down": "Q4_1", "token_embd": "Q8_0"}),
    "qwen3": ("qwen3", None, dict(num_attention_heads=2, num_key_value_heads=2, head_dim=32,
                                  tie_word_embeddings=True), {"ffn_up": "Q4_0"}),
    "mistral": ("mistral", "llama", dict(num_attention_heads=4, num_key_value_heads=1,
                                         head_dim=16, sliding_window=8), {}),
}
PROMPT = [5, 17, 99, 200, 3, 42, 7, 300, 11, 64, 2, 130]


def _convert(path: Path, out: Path, exporter: str, **options: Any) -> Path:
    return convert_with_env(EXPORT_ENV, exporter, path, out, **{"dtype": "float32", **options})


@pytest.fixture(scope="session")
def gguf_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf_graph")
    return {name: write_gguf(root / f"{name}.gguf", family, types, arch=arch, seed=i + 7,
                             **SHAPE, **shape)[0]
            for i, (name, (family, arch, shape, types)) in enumerate(CASES.items())}


@pytest.fixture(scope="session")
def pairs(gguf_files: dict[str, Path],
          tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """(torch path, builder) artifacts of each case in float32, and of llama in Q4."""
    root = tmp_path_factory.mktemp("gguf_graph_out")
    out = {name: (_convert(path, root / f"{name}-torch", "torch"),
                  _convert(path, root / f"{name}-built", ""))
           for name, path in gguf_files.items()}
    out["llama-q4"] = (_convert(gguf_files["llama"], root / "q4-torch", "torch", quant="q4"),
                       _convert(gguf_files["llama"], root / "q4-built", "", quant="q4"))
    return out


def _nodes(model: onnx.ModelProto) -> list[tuple[Any, ...]]:
    """Each node's op, domain, attributes and which inputs are present (names aside)."""
    return [(n.op_type, n.domain,
             sorted((a.name, repr(helper.get_attribute_value(a))) for a in n.attribute),
             [bool(i) for i in n.input], len(n.output)) for n in model.graph.node]


def _per_layer(model: onnx.ModelProto) -> list[int]:
    """Nodes between consecutive Attention nodes (one decoder layer each)."""
    at = [i for i, n in enumerate(model.graph.node) if n.op_type == "Attention"]
    return [b - a for a, b in zip(at, at[1:], strict=False)]


@pytest.mark.parametrize("case", [*CASES, "llama-q4"])
def test_same_graph_and_weights(pairs: dict[str, tuple[Path, Path]], case: str) -> None:
    torch_dir, built_dir = pairs[case]
    ours = onnx.load(str(built_dir / "model.onnx"))
    theirs = onnx.load(str(torch_dir / "model.onnx"))
    assert _nodes(ours) == _nodes(theirs)
    assert _per_layer(ours) == _per_layer(theirs)
    assert ([(v.name, v.type) for v in ours.graph.input] ==
            [(v.name, v.type) for v in theirs.graph.input])
    assert ([(v.name, v.type) for v in ours.graph.output] ==
            [(v.name, v.type) for v in theirs.graph.output])
    assert [f.SerializeToString() for f in ours.functions] == \
        [f.SerializeToString() for f in theirs.functions]
    assert ours.opset_import == theirs.opset_import
    a = [numpy_helper.to_array(t) for t in ours.graph.initializer]
    b = [numpy_helper.to_array(t) for t in theirs.graph.initializer]
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):  # bit-identical, quantized ones included
        assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y)
    if case == "llama-q4":
        assert any(t.data_type == onnx.TensorProto.UINT4 for t in ours.graph.initializer)


@pytest.mark.parametrize("case", [*CASES, "llama-q4"])
def test_same_manifest_and_side_files(pairs: dict[str, tuple[Path, Path]], case: str) -> None:
    torch_dir, built_dir = pairs[case]
    ours, theirs = read_manifest(built_dir), read_manifest(torch_dir)
    assert ours.model == theirs.model and ours.rope == theirs.rope
    assert (ours.dtype, ours.special_tokens, ours.files, ours.steps) == (
        theirs.dtype, theirs.special_tokens, theirs.files, theirs.steps)
    assert ours.source["exporter"] == BUILDER
    assert theirs.source["exporter"].startswith("torch")
    # the pass report: the passes fuse the builder's plain graph as they fuse the trace
    layers = ours.model.num_layers
    keys = ("name", "matches", "nodes_before", "nodes_after", "op_delta")
    assert [{k: e[k] for k in keys} for e in ours.passes["passes"]] == \
        [{k: e[k] for k in keys} for e in theirs.passes["passes"]]
    matches = {e["name"]: e["matches"] for e in ours.passes["passes"]}
    assert matches["qkv"] == matches["gate_up"] == layers, matches
    if case == "llama-q4":  # the same record, tensor by tensor, but for the packed names
        q, t = dict(ours.quantization), dict(theirs.quantization)
        keys = ("role", "shape", "block_size", "bits_per_weight", "rel_rms_error")
        assert [{k: e[k] for k in keys} for e in q.pop("tensors")] == \
            [{k: e[k] for k in keys} for e in t.pop("tensors")]
        for rec in (q, t):  # the calibration forward's wall time differs from run to run
            if rec.get("calibration"):
                rec["calibration"] = {k: v for k, v in rec["calibration"].items()
                                      if k != "seconds"}
        assert q == t
    for name in ours.files["tokenizer"]:
        assert (built_dir / name).read_bytes() == (torch_dir / name).read_bytes()


@pytest.mark.parametrize("engine", ["onnxruntime", "mlx"])
@pytest.mark.parametrize("case", [*CASES, "llama-q4"])
def test_logits_and_greedy_equal(pairs: dict[str, tuple[Path, Path]], case: str,
                                 engine: str) -> None:
    opts = {"accuracy_level": 0} if engine == "onnxruntime" else {}
    ours, theirs = (make_engine(d, engine, **opts) for d in pairs[case][::-1])
    assert rel(engine_logits(ours, PROMPT, 512), engine_logits(theirs, PROMPT, 512)) <= 1e-5
    assert generate(ours, PROMPT, max_new_tokens=12).tokens == \
        generate(theirs, PROMPT, max_new_tokens=12).tokens


def test_spec_without_transformers_equals_transformers(gguf_files: dict[str, Path],
                                                       tmp_path: Path) -> None:
    """The builder's spec (the GGUF config dict as the config object) is the one the registry
    makes with transformers' config classes, RoPE frequencies included."""
    from fuselm.export.gguf.source import GGUFCheckpoint, gguf_spec, stage
    from fuselm.export.registry import decoder_spec

    for name, path in gguf_files.items():
        ckpt = GGUFCheckpoint(path)
        stage(ckpt, tmp_path / name)
        ours, theirs = gguf_spec(tmp_path / name, ckpt), decoder_spec(tmp_path / name)
        np.testing.assert_array_equal(ours.rope.inv_freq, theirs.rope.inv_freq)
        assert repr(ours) == repr(theirs)


def test_builder_conversion_imports_no_torch(gguf_files: dict[str, Path], tmp_path: Path) -> None:
    """A GGUF conversion through the CLI's code path, in a fresh interpreter: neither torch,
    onnxscript nor transformers' model code is ever imported (their import alone is ~300 MB
    of the 403 MB bound on SmolLM2), nor Numba for a model this small (+112 MB)."""
    code = (
        "import sys\n"
        "from fuselm.converter.cli.main import cli\n"
        f"try:\n    cli(['convert', {str(gguf_files['llama'])!r}, '-o', "
        f"{str(tmp_path / 'out')!r}, '--quant', 'q4'])\n"
        "except SystemExit as e:\n    assert not e.code, e.code\n"
        "bad = sorted(m for m in sys.modules\n"
        "             if m.split('.')[0] in ('torch', 'onnxscript', 'numba')\n"
        "             or m.startswith('transformers.modeling_')\n"
        "             or (m.startswith('transformers.models.') and '.modeling_' in m))\n"
        "print('IMPORTED', bad)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != EXPORT_ENV}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "IMPORTED []" in res.stdout, res.stdout[-2000:]
    # ...with the default Q4's built-in calibration forward included (it tokenizes without
    # transformers' AutoTokenizer, which imports torch)
    calib = json.loads((tmp_path / "out" / "fuselm.json").read_text())["quantization"]
    assert calib["calibration"]["file"] == "calibration.txt (built-in)", calib["calibration"]
    source = json.loads((tmp_path / "out" / "fuselm.json").read_text())["source"]
    assert source["exporter"] == BUILDER


def test_tokenizer_files_equal_transformers_loader(gguf_files: dict[str, Path],
                                                   tmp_path: Path) -> None:
    """The tokenizer made without transformers' GGUF reader saves the tokenizer.json and chat
    template that `AutoTokenizer.from_pretrained(gguf_file=...)` saves, byte for byte, and
    tokenizes, decodes and renders chats as it does. Its tokenizer_config.json names the
    generic TokenizersBackend where AutoTokenizer's choice for the model type may be a subclass
    (Qwen2Tokenizer for qwen3; the same class for SmolLM2's llama file), without the loader's
    two flags; the tokenizer.json it loads is the same file."""
    from transformers import AutoTokenizer

    from fuselm.export.gguf.file import GGUFFile
    from fuselm.export.gguf.tokenizer import light_tokenizer

    text = "The quick brown fox — naïve café, 3.14! <|im_start|>user\nHi<|im_end|>"
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    for name, path in gguf_files.items():
        a, b = tmp_path / name / "ours", tmp_path / name / "theirs"
        ours = light_tokenizer(GGUFFile(path))
        assert ours is not None
        ours.save_pretrained(str(a))
        AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(
            str(b))
        assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())
        for f in a.iterdir():
            if f.name != "tokenizer_config.json":
                assert f.read_bytes() == (b / f.name).read_bytes(), f.name
        skip = {"is_local", "local_files_only", "tokenizer_class", "add_prefix_space"}
        mine, theirs = (
            {k: v for k, v in json.loads((d / "tokenizer_config.json").read_text()).items()
             if k not in skip} for d in (a, b))
        assert mine == theirs
        t1, t2 = AutoTokenizer.from_pretrained(str(a)), AutoTokenizer.from_pretrained(str(b))
        assert t1.encode(text) == t2.encode(text)
        assert t1.decode(t1.encode(text)) == t2.decode(t2.encode(text))
        assert t1.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
            t2.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


def test_torch_path_when_the_builder_does_not_apply(gguf_files: dict[str, Path]) -> None:
    from fuselm.converter.gguf_input import torch_reason
    from fuselm.export.gguf.source import GGUFCheckpoint

    ckpt = GGUFCheckpoint(gguf_files["llama"])
    assert torch_reason(ckpt) is None
    ckpt.config["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}
    assert torch_reason(ckpt) == "RoPE scaling yarn"


def test_weight_screen_reads_arrays_as_it_reads_tensors() -> None:
    """The builder screens NumPy arrays with the exporter's WeightScreen: NaN/Inf refused (or
    recorded with allow_nonfinite), float16 overflow refused, both named, as for torch."""
    import torch

    from fuselm.export.errors import ExportError
    from fuselm.export.weight_screen import WeightScreen

    bad = np.ones((4, 8), np.float32)
    bad[1, 2] = np.nan
    big = np.full((3,), 70000.0, np.float32)
    for kind in (np.asarray, torch.from_numpy):
        with pytest.raises(ExportError, match=r"tensor w .*1 NaN, 0 inf of 32"):
            WeightScreen("float16")("w", kind(bad))
        with pytest.raises(ExportError, match="tensor b holds values up to 7e"):
            WeightScreen(torch.float16)("b", kind(big))
        WeightScreen("float32")("b", kind(big))  # float32 holds it
        allowed = WeightScreen("float32", allow_nonfinite=True)
        allowed("w", kind(bad))
        assert allowed.nonfinite == ["w"]
