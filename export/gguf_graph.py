"""GGUF → the fused-op ONNX graph, built directly, without torch.

The torch path (export/onnx_export.py, then passes/) traces export/decoder.py's clean decoder
and fuses the trace: RMSNormalization, FusedQKV, FusedRoPE, ONNX Attention with the KV concat
inside, FusedGateUp, MatMul + Add. For the decoders a GGUF file holds (llama / Mistral-style
llama / qwen2 / qwen3 with default RoPE) that fused graph is known node by node, so this writes
it straight away, as onnxruntime-genai's model builder does, with each weight read from the
GGUF, laid out [K, N] (q/k/v and gate/up packed along N as the pairing passes pack them), cast
and appended to `raw.onnx.data` one tensor at a time. Tracing costs ~420 MB of torch, onnxscript
and dynamo machinery before the first weight is read; this costs none of it.

The result is the same `raw.onnx` the passes would make of the trace (float weights); the
convert pipeline then runs the pass pipeline on it as on any export (every fusion finds nothing
left to fuse, quantization and cleanup run as usual), so Q4, the writer and the manifest are
the torch path's own. tests/export/test_gguf_graph.py checks the two graphs node for node.
Attribute sets come from passes/ops.py (`*_attributes`), the weights' checkpoint names and
layouts from the family (export/family.py), the spec from export/registry.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import BinaryIO

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from fuselm.export.config import DecoderSpec
from fuselm.export.errors import ExportError
from fuselm.export.export_result import ExportResult
from fuselm.export.gguf_source import GGUFCheckpoint
from fuselm.export.registry import decoder_spec, family_of
from fuselm.export.tensor_match import check_tensor_names
from fuselm.export.weight_screen import WeightScreen
from fuselm.passes import ops

DTYPES = {"float32": (np.float32, TensorProto.FLOAT), "float16": (np.float16, TensorProto.FLOAT16)}
_ALIGN = 64  # bytes, as the exporter aligns raw.onnx.data
SLAB_BYTES = 32 << 20  # bytes of rows cast and written at a time
# model types whose GGUF config this builder reads exactly (RoPE default, windows as below)
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def unsupported(ckpt: GGUFCheckpoint) -> str | None:
    """Why this file needs the torch exporter instead (None: the builder makes its graph).

    RoPE scaling needs transformers' own frequency functions (torch); a Qwen sliding window
    applies from transformers' `max_window_layers` on, a default this builder does not restate.
    """
    c = ckpt.config
    if c["model_type"] not in MODEL_TYPES:
        return f"model type {c['model_type']}"
    if c["rope_parameters"].get("rope_type", "default") != "default":
        return f"RoPE scaling {c['rope_parameters']['rope_type']}"
    if c["model_type"] in ("qwen2", "qwen3") and c.get("use_sliding_window"):
        return "a Qwen sliding window"
    return None


def resolve_dtype(requested: str | None, checkpoint_dtype: str) -> str:
    """The graph dtype name, as export/onnx_export.py's `resolve_dtype` decides it."""
    if requested in (None, "auto"):
        return checkpoint_dtype
    if requested not in DTYPES:
        raise ExportError(f"--dtype {requested} is not supported; choose float32 or float16")
    return requested


def gguf_spec(model_dir: Path, ckpt: GGUFCheckpoint) -> DecoderSpec:
    """The DecoderSpec of the staged GGUF directory: the registry's own, read from the config
    dict fuselm wrote (every field present) instead of transformers' config class."""
    return decoder_spec(model_dir, hf_config=SimpleNamespace(**ckpt.config))


def parameter_shapes(spec: DecoderSpec) -> dict[str, tuple[int, ...]]:
    """The clean decoder's parameters (export/decoder.py), in its order, with their shapes."""
    h, d, i = spec.hidden_size, spec.head_dim, spec.intermediate_size
    nq, nkv = spec.num_heads * d, spec.num_kv_heads * d
    out: dict[str, tuple[int, ...]] = {"embed": (spec.vocab_size, h)}

    def linear(name: str, k: int, n: int, bias: bool) -> None:
        out[f"{name}.weight"] = (k, n)
        if bias:
            out[f"{name}.bias"] = (n,)

    for layer in range(spec.num_layers):
        p = f"layers.{layer}."
        out[p + "input_norm"] = (h,)
        linear(p + "q_proj", h, nq, spec.qkv_bias)
        linear(p + "k_proj", h, nkv, spec.qkv_bias)
        linear(p + "v_proj", h, nkv, spec.qkv_bias)
        linear(p + "o_proj", nq, h, spec.o_bias)
        if spec.qk_norm:
            out[p + "q_norm"] = (d,)
            out[p + "k_norm"] = (d,)
        out[p + "post_norm"] = (h,)
        linear(p + "gate_proj", h, i, spec.mlp_bias)
        linear(p + "up_proj", h, i, spec.mlp_bias)
        linear(p + "down_proj", i, h, spec.mlp_bias)
    out["norm"] = (h,)
    if not spec.tie_word_embeddings:
        out["lm_head"] = (h, spec.vocab_size)
    return out


class _Weights:
    """raw.onnx.data being written: each tensor read from the GGUF, laid out, screened, cast,
    appended 64-byte aligned, and referenced by an external initializer."""

    def __init__(self, f: BinaryIO, location: str, ckpt: GGUFCheckpoint, spec: DecoderSpec,
                 dtype: str, screen: WeightScreen) -> None:
        self.f, self.location, self.ckpt, self.screen = f, location, ckpt, screen
        self.np_dtype, self.onnx_dtype = DTYPES[dtype]
        self.sources = family_of(spec.architecture).sources(spec, list(parameter_shapes(spec)))
        self.offset = 0
        self.initializers: list[TensorProto] = []

    def _read(self, param: str) -> np.ndarray:
        src = self.sources[param]
        w = self.ckpt.array(src.hf_name)
        if src.rows is not None:
            w = w[src.rows[0]: src.rows[1]]
        self.screen(src.hf_name, w)
        if src.offset:
            w = w + np.float32(src.offset)
        return w.T if src.transpose else w

    def add(self, name: str, params: list[str]) -> str:
        """Initializer `name`: the parameters' values concatenated along the last axis (one
        parameter: its values), written as one tensor."""
        parts = [self._read(p) for p in params]
        shape = (*parts[0].shape[:-1], sum(p.shape[-1] for p in parts))
        pad = (-self.offset) % _ALIGN
        self.f.write(b"\0" * pad)
        self.offset += pad
        start = self.offset
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        step = max(1, SLAB_BYTES // (4 * shape[-1]))
        flat = [p.reshape(rows, p.shape[-1]) for p in parts]
        for r in range(0, rows, step):
            slab = np.concatenate([p[r: r + step] for p in flat], axis=1) if len(flat) > 1 \
                else flat[0][r: r + step]
            data = np.ascontiguousarray(slab, dtype=self.np_dtype)
            self.f.write(memoryview(data).cast("B"))
            self.offset += data.nbytes
        del parts, flat
        proto = TensorProto(name=name, data_type=self.onnx_dtype, dims=list(shape))
        proto.data_location = TensorProto.EXTERNAL
        for key, value in (("location", self.location), ("offset", str(start)),
                           ("length", str(self.offset - start))):
            entry = proto.external_data.add()
            entry.key, entry.value = key, value
        self.initializers.append(proto)
        return name


class _Nodes:
    """The graph's nodes and small constants, named as they are added."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.constants: list[TensorProto] = []
        self.count = 0

    def const(self, hint: str, value: np.ndarray) -> str:
        name = f"{hint}_{len(self.constants)}"
        self.constants.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def __call__(self, op: str, inputs: list[str], outputs: int | list[str] = 1,
                 domain: str = "", **attrs: object) -> list[str]:
        self.count += 1
        if isinstance(outputs, int):
            outputs = [f"{op.lower()}_{self.count}" if outputs == 1 else
                       f"{op.lower()}_{self.count}_{j}" for j in range(outputs)]
        self.nodes.append(helper.make_node(op, inputs, outputs, name=f"{op}_{self.count}",
                                           domain=domain or None, **attrs))
        return outputs


def _mask(n: _Nodes, window: int | None) -> str:
    """attention_mask_4d (export/decoder.py) as its trace exports it: bool [batch, 1, seq,
    total], causal, padded, sliding window (if any), each query sees itself."""
    zero, one = n.const("zero", np.array(0, np.int64)), n.const("one", np.array(1, np.int64))
    (seq,) = n("Squeeze", n("Shape", ["input_ids"], start=1, end=2))
    (total,) = n("Squeeze", n("Shape", ["attention_mask"], start=1, end=2))
    (k_pos,) = n("Unsqueeze", [n("Range", [zero, total, one])[0],
                               n.const("axes", np.array([0], np.int64))])
    (q_idx,) = n("Range", [zero, seq, one])
    (past,) = n("Sub", [total, seq])
    (q_pos,) = n("Unsqueeze", [n("Add", [q_idx, past])[0],
                               n.const("axes", np.array([1], np.int64))])
    (allowed,) = n("LessOrEqual", [k_pos, q_pos])
    if window is not None:
        (lo,) = n("Sub", [q_pos, n.const("window", np.array(window, np.int64))])
        (allowed,) = n("And", [allowed, n("Greater", [k_pos, lo])[0]])
    (padded,) = n("Cast", ["attention_mask"], to=TensorProto.BOOL)
    (padded,) = n("Unsqueeze", [padded, n.const("axes", np.array([1, 2], np.int64))])
    heads_axes = n.const("axes", np.array([0, 1], np.int64))
    (allowed,) = n("And", [n("Unsqueeze", [allowed, heads_axes])[0], padded])
    (itself,) = n("Unsqueeze", [n("Equal", [k_pos, q_pos])[0], heads_axes])
    return n("Or", [allowed, itself])[0]


def _projection(n: _Nodes, w: _Weights, x: str, name: str, bias: bool) -> str:
    (y,) = n("MatMul", [x, w.add(f"{name}.weight", [f"{name}.weight"])])
    if bias:
        (y,) = n("Add", [y, w.add(f"{name}.bias", [f"{name}.bias"])])
    return y


def _layer(n: _Nodes, w: _Weights, spec: DecoderSpec, i: int, x: str, mask: str) -> str:
    p, d, eps = f"layers.{i}.", spec.head_dim, float(spec.rms_norm_eps)
    norm = dict(axis=-1, epsilon=eps, stash_type=1)
    (h,) = n("RMSNormalization", [x, w.add(p + "input_norm", [p + "input_norm"])], **norm)
    qkv = [w.add(p + "qkv.weight", [p + f"{r}_proj.weight" for r in "qkv"])]
    if spec.qkv_bias:
        qkv += ["", "", w.add(p + "qkv.bias", [p + f"{r}_proj.bias" for r in "qkv"])]
    q, k, v = n("FusedQKV", [h, *qkv], 3, domain=ops.DOMAIN, **ops.qkv_attributes(
        spec.num_heads * d, spec.num_kv_heads * d, spec.num_kv_heads * d))
    r = (spec.ropes or [spec.rope] * spec.num_layers)[i]
    if r is not None:
        norms = [w.add(p + "q_norm", [p + "q_norm"]), w.add(p + "k_norm", [p + "k_norm"])] \
            if spec.qk_norm else []
        q, k = n("FusedRoPE", [q, k, "position_ids", *norms], 2, domain=ops.DOMAIN,
                 **ops.rope_attributes(
                     d, r.rotary_dim, [float(f) for f in r.inv_freq], r.attention_scale, 0, eps,
                     r.dynamic_factor, r.dynamic_max_positions, r.theta,
                     [] if r.long_inv_freq is None else [float(f) for f in r.long_inv_freq],
                     r.long_after))
    scale = spec.attention_scale if spec.attention_scale is not None else d**-0.5
    y, _, _ = n("Attention", [q, k, v, mask, f"past_key_values.{i}.key",
                              f"past_key_values.{i}.value"],
                [f"attention_{i}", f"present.{i}.key", f"present.{i}.value"],
                is_causal=0, kv_num_heads=spec.num_kv_heads, q_num_heads=spec.num_heads,
                qk_matmul_output_mode=0, scale=float(scale), softcap=float(spec.attn_softcap))
    (x,) = n("Add", [x, _projection(n, w, y, p + "o_proj", spec.o_bias)])
    (h,) = n("RMSNormalization", [x, w.add(p + "post_norm", [p + "post_norm"])], **norm)
    gu = [w.add(p + "gate_up.weight", [p + "gate_proj.weight", p + "up_proj.weight"])]
    if spec.mlp_bias:
        gu += ["", "", w.add(p + "gate_up.bias", [p + "gate_proj.bias", p + "up_proj.bias"])]
    (y,) = n("FusedGateUp", [h, *gu], domain=ops.DOMAIN,
             **ops.gate_up_attributes(spec.activation))
    return n("Add", [x, _projection(n, w, y, p + "down_proj", spec.mlp_bias)])[0]


def _check_spec(spec: DecoderSpec) -> None:
    """What the clean decoder supports that a GGUF decoder of MODEL_TYPES never has."""
    plain = (not spec.sandwich_norms and spec.embed_scale == 1.0 and spec.residual_scale == 1.0
             and spec.logit_scale == 1.0 and spec.logit_softcap == 0.0)
    if not plain or len(set(spec.windows)) > 1:
        raise ExportError(f"internal: the GGUF graph builder does not build {spec.architecture} "
                          "with these options; set FUSELM_GGUF_EXPORT=torch")


def _check_shapes(w: _Weights, shapes: dict[str, tuple[int, ...]]) -> None:
    for name, src in w.sources.items():
        have = w.ckpt.shape(src.hf_name)
        if src.rows is not None:
            have = (min(src.rows[1], have[0]) - src.rows[0], *have[1:])
        have = have[::-1] if src.transpose else have
        want = shapes[name]
        if tuple(have) != want:
            raise ExportError(
                f"tensor {src.hf_name} has shape {list(w.ckpt.shape(src.hf_name))} but "
                f"config.json implies {list(want[::-1] if src.transpose else want)}; the "
                "checkpoint does not match its config")


def _value_info(name: str, elem: int, dims: list[int | str]) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, dims)


def build_model(
    model_dir: str | Path,
    onnx_path: str | Path,
    dtype: str | None = None,
    progress: Callable[[str, int, int], None] | None = None,
    allow_nonfinite: bool = False,
    checkpoint: GGUFCheckpoint | None = None,
) -> ExportResult:
    """export/onnx_export.py's `export_model` for a GGUF `checkpoint` staged in `model_dir`:
    writes `onnx_path` (+ `.data`), the fused graph with float weights."""
    if checkpoint is None:
        raise ExportError("internal: the GGUF graph builder needs the GGUF checkpoint")
    t0 = time.perf_counter()
    ckpt = checkpoint
    spec = gguf_spec(Path(model_dir), ckpt)
    _check_spec(spec)
    graph_dtype = resolve_dtype(dtype, ckpt.dtype_name)
    result = ExportResult(spec=spec, dtype=graph_dtype, checkpoint_dtype=ckpt.dtype_name)
    shapes = parameter_shapes(spec)
    sources = family_of(spec.architecture).sources(spec, list(shapes))
    check_tensor_names([s.hf_name for s in sources.values()], ckpt.tensors, ckpt.root,
                       spec.num_layers, spec.tie_word_embeddings)
    onnx_path = Path(onnx_path)
    data_path = onnx_path.with_name(onnx_path.name + ".data")
    screen = WeightScreen(graph_dtype, allow_nonfinite)
    elem = DTYPES[graph_dtype][1]
    n = _Nodes()
    with data_path.open("wb") as f:
        w = _Weights(f, data_path.name, ckpt, spec, graph_dtype, screen)
        _check_shapes(w, shapes)
        mask = _mask(n, spec.windows[0] if spec.windows else None)
        (x,) = n("Gather", [w.add("embed", ["embed"]), "input_ids"], axis=0)
        for i in range(spec.num_layers):
            x = _layer(n, w, spec, i, x, mask)
            if progress:
                progress("weights", i + 1, spec.num_layers)
        (h,) = n("RMSNormalization", [x, w.add("norm", ["norm"])], axis=-1,
                 epsilon=float(spec.rms_norm_eps), stash_type=1)
        head = n("Transpose", ["embed"], perm=[1, 0])[0] if spec.tie_word_embeddings \
            else w.add("lm_head", ["lm_head"])
        n("MatMul", [h, head], ["logits"])
    kv = [spec.num_kv_heads, "past", spec.head_dim]
    inputs = [_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
              _value_info("attention_mask", TensorProto.INT64, ["batch", "past + seq"]),
              _value_info("position_ids", TensorProto.INT64, ["batch", "seq"])]
    outputs = [_value_info("logits", elem, ["batch", "seq", spec.vocab_size])]
    for i in range(spec.num_layers):
        for kind in ("key", "value"):
            inputs.append(_value_info(f"past_key_values.{i}.{kind}", elem, ["batch", *kv]))
            outputs.append(_value_info(f"present.{i}.{kind}", elem,
                                       ["batch", kv[0], "past + seq", kv[2]]))
    graph = helper.make_graph(n.nodes, "main_graph", inputs, outputs,
                              [*n.constants, *w.initializers])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", ops.ONNX_OPSET)],
                              ir_version=10, producer_name="fuselm")
    ops.attach_functions(model)
    onnx.save(model, str(onnx_path))
    result.weight_bytes = w.offset
    result.nonfinite = screen.nonfinite
    result.seconds["build"] = time.perf_counter() - t0
    ops_built: dict[str, int] = {}
    for node in n.nodes:
        ops_built[node.op_type] = ops_built.get(node.op_type, 0) + 1
    result.built = dict(name="gguf_graph", matches=spec.num_layers, nodes_before=0,
                        nodes_after=len(n.nodes), op_delta=dict(sorted(ops_built.items())),
                        seconds=round(result.seconds["build"], 4))
    return result
