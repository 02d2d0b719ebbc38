"""The fused-op ONNX graph, built directly from a checkpoint, without tracing.

The torch path (export/onnx_export.py, then passes/) traces export/decoder.py's clean decoder
and fuses the trace: RMSNormalization, FusedQKV, FusedRoPE, ONNX Attention with the KV concat
inside, FusedGateUp, MatMul + Add. For the plain decoders (llama / mistral / qwen2 / qwen3)
that fused graph is known node by node, so this writes it straight away, as onnxruntime-genai's
model builder does, each weight read from the checkpoint (HF safetensors, safetensors/checkpoint.py,
or a GGUF file, export/gguf/source.py: both answer `tensors`, `shape`, `array` in HF names),
laid out [K, N] (q/k/v and gate/up packed along N as the pairing passes pack them) and cast.
The trace costs ~40 s of dynamo on a 28-layer model (and ~420 MB of torch, onnxscript and
dynamo machinery before the first weight is read); this costs neither.

The result is the same graph the passes make of the trace (float weights): either `raw.onnx`
with `raw.onnx.data` written a tensor at a time, or (`in_memory`) the model with data-less
initializers and a recipe per weight that reads it from the checkpoint when the passes or the
writer ask, as export/onnx_export.py's `computed_weights` does. The convert pipeline then runs
the pass pipeline on it as on any export (every fusion finds nothing left to fuse,
quantization and cleanup run as usual), so Q4, the writer and the manifest are the torch
path's own. tests/export/test_graph_builder_*.py check the two graphs node for node.
Attribute sets come from passes/ops.py (`*_attributes`), the weights' checkpoint names and
layouts from the family (export/family.py), the spec from export/registry.py.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import BinaryIO, Protocol

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from fuselm.export.config import DecoderSpec
from fuselm.export.errors import ExportError
from fuselm.export.export_result import ExportResult
from fuselm.export.family import Source
from fuselm.export.registry import decoder_spec, family_of
from fuselm.export.safetensors.checkpoint import Checkpoint, cast
from fuselm.export.tensor_match import check_layer_count, check_tensor_names
from fuselm.export.weight_screen import WeightScreen
from fuselm.passes import ops

DTYPES = {"float32": (np.float32, TensorProto.FLOAT), "float16": (np.float16, TensorProto.FLOAT16)}
_ALIGN = 64  # bytes, as the exporter aligns raw.onnx.data
SLAB_BYTES = 32 << 20  # bytes of rows cast and written at a time
_INLINE = 1024  # values: smaller weights are stored in the model itself (as the exporter does)
# the families whose whole graph this builder writes (their decoders have no extra scales,
# norms or per-layer attention kinds: _check_spec)
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


class WeightReader(Protocol):
    """A checkpoint in HF tensor names (export/safetensors/checkpoint.py, export/gguf/source.py)."""

    root: Path

    @property
    def tensors(self) -> Iterable[str]: ...

    @property
    def dtype_name(self) -> str: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def array(self, name: str) -> np.ndarray: ...


def unsupported(spec: DecoderSpec) -> str | None:
    """Why this model needs the tracing exporter instead (None: the builder makes its graph)."""
    if spec.family not in FAMILIES:
        return f"model type {spec.family}"
    plain = (not spec.sandwich_norms and spec.embed_scale == 1.0 and spec.residual_scale == 1.0
             and spec.logit_scale == 1.0 and spec.logit_softcap == 0.0)
    if not plain:
        return f"{spec.family} with extra scales or norms"
    if len(set(spec.windows)) > 1:
        return "sliding windows on some layers only"
    return None


def resolve_dtype(requested: str | None, checkpoint_dtype: str) -> str:
    """The graph dtype name, as export/onnx_export.py's `resolve_dtype` decides it."""
    if requested in (None, "auto"):
        return "float16" if checkpoint_dtype in ("float16", "bfloat16") else "float32"
    if requested not in DTYPES:
        raise ExportError(f"--dtype {requested} is not supported; choose float32 or float16")
    return requested


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
    """The graph's weights: each read from the checkpoint, laid out, screened and cast, then
    appended 64-byte aligned to the data file `f` and referenced by an external initializer,
    or (no `f`) left as a data-less initializer and a recipe in `recipes`."""

    def __init__(self, ckpt: WeightReader, shapes: dict[str, tuple[int, ...]],
                 sources: dict[str, Source], dtype: str, screen: WeightScreen,
                 f: BinaryIO | None = None, location: str = "") -> None:
        self.f, self.location, self.ckpt, self.screen = f, location, ckpt, screen
        self.shapes = shapes
        self.np_dtype, self.onnx_dtype = DTYPES[dtype]
        self.sources = sources
        self.offset = 0
        self.initializers: list[TensorProto] = []
        self.recipes: dict[str, Callable[[], np.ndarray]] = {}
        self.screened: set[str] = set()
        self.nbytes = 0

    def _read(self, param: str) -> np.ndarray:
        """One parameter as the checkpoint stores it (rows cut, screened, offset added), not
        yet transposed."""
        src = self.sources[param]
        w = self.ckpt.array(src.hf_name)
        if src.rows is not None:
            w = w[src.rows[0]: src.rows[1]]
        if param not in self.screened:  # a recipe reads it again (calibration, Q4, writer)
            self.screen(src.hf_name, w)
            self.screened.add(param)
        if src.offset:
            w = cast(w, np.float32) + np.float32(src.offset)
        return w

    def _laid_out(self, param: str) -> np.ndarray:
        return self._read(param).T if self.sources[param].transpose else self._read(param)

    def values(self, params: list[str]) -> np.ndarray:
        """The parameters' values concatenated along the last axis, cast: a [K, N] weight as
        the transpose of its C-order [N, K] array (the consumers re-lay it out tile by tile,
        as they do the exporter's), concatenated in the checkpoint's layout."""
        if self.sources[params[0]].transpose:
            parts = [self._read(p) for p in params]
            base = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
            del parts
            return cast(base, self.np_dtype).T
        parts = [self._read(p) for p in params]
        whole = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=-1)
        return cast(whole, self.np_dtype)

    def add(self, name: str, params: list[str]) -> str:
        """Initializer `name`: the parameters' values concatenated along the last axis (one
        parameter: its values)."""
        first = self.shapes[params[0]]
        shape = (*first[:-1], sum(self.shapes[p][-1] for p in params))
        proto = TensorProto(name=name, data_type=self.onnx_dtype, dims=list(shape))
        numel = int(np.prod(shape))
        self.initializers.append(proto)
        if self.f is None:
            if numel <= _INLINE:  # as the writer inlines a small tensor: the same model bytes
                proto.raw_data = np.ascontiguousarray(self.values(params)).tobytes()
                proto.data_location = TensorProto.DEFAULT  # (set, as the writer sets it)
            else:
                self.recipes[name] = lambda: self.values(params)
                self.nbytes += numel * np.dtype(self.np_dtype).itemsize
            return name
        parts = [self._laid_out(p) for p in params]
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
            data = np.ascontiguousarray(cast(np.ascontiguousarray(slab), self.np_dtype))
            self.f.write(memoryview(data).cast("B"))
            self.offset += data.nbytes
        del parts, flat
        proto.data_location = TensorProto.EXTERNAL
        for key, value in (("location", self.location), ("offset", str(start)),
                           ("length", str(self.offset - start))):
            entry = proto.external_data.add()
            entry.key, entry.value = key, value
        self.nbytes = self.offset
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
    checkpoint: WeightReader | None = None,
    in_memory: bool = False,
    spec: DecoderSpec | None = None,
) -> ExportResult:
    """export/onnx_export.py's `export_model` for the models `unsupported` accepts: the fused
    graph with float weights, written to `onnx_path` (+ `.data`), or (`in_memory`) nothing
    written: the result carries the model and a recipe per weight. `checkpoint`: where the
    weights come from (default: the safetensors in `model_dir`); `spec`: the model's, when
    the caller has it (a GGUF file's is not read from transformers' config classes)."""
    t0 = time.perf_counter()
    ckpt = checkpoint if checkpoint is not None else Checkpoint(model_dir)
    spec = spec if spec is not None else decoder_spec(model_dir)
    reason = unsupported(spec)
    if reason is not None:
        raise ExportError(f"internal: the graph builder does not build {reason}; set "
                          "FUSELM_EXPORT=torch")
    if in_memory and allow_nonfinite:
        raise ValueError("in_memory export cannot record non-finite weights")
    graph_dtype = resolve_dtype(dtype, ckpt.dtype_name)
    result = ExportResult(spec=spec, dtype=graph_dtype, checkpoint_dtype=ckpt.dtype_name)
    check_layer_count(ckpt.tensors, ckpt.root, spec.num_layers)  # before sizing every layer
    shapes = parameter_shapes(spec)
    sources = family_of(spec.architecture).sources(spec, list(shapes))
    check_tensor_names([s.hf_name for s in sources.values()], ckpt.tensors, ckpt.root,
                       spec.num_layers, spec.tie_word_embeddings)
    onnx_path = Path(onnx_path)
    data_path = onnx_path.with_name(onnx_path.name + ".data")
    screen = WeightScreen(graph_dtype, allow_nonfinite)
    elem = DTYPES[graph_dtype][1]
    n = _Nodes()
    with contextlib.ExitStack() as stack:
        f = None if in_memory else stack.enter_context(data_path.open("wb"))
        w = _Weights(ckpt, shapes, sources, graph_dtype, screen, f, data_path.name)
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
    if in_memory:
        result.model, result.sources = model, w.recipes
    else:
        onnx.save(model, str(onnx_path))
    result.weight_bytes = w.nbytes
    result.nonfinite = screen.nonfinite
    result.seconds["build"] = time.perf_counter() - t0
    ops_built: dict[str, int] = {}
    for node in n.nodes:
        ops_built[node.op_type] = ops_built.get(node.op_type, 0) + 1
    result.built = dict(name="graph_builder", matches=spec.num_layers, nodes_before=0,
                        nodes_after=len(n.nodes), op_delta=dict(sorted(ops_built.items())),
                        seconds=round(result.seconds["build"], 4))
    return result
