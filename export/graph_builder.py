"""The plain decoder graph, written straight from a DecoderSpec and a checkpoint, no tracing.

export/onnx_export.py traces export/decoder.py's clean decoder; this writes the very graph that
trace gives, node for node (tests/export/test_graph_builder_*.py hold the trace as the oracle):
the mask's shape work, Gather, RMSNormalization, separate q/k/v and gate/up MatMuls (+ Add
biases), fuselm.FusedRoPE, ONNX Attention with the KV concat inside, the gate's activation as
torch exports it (x * Sigmoid(x), or Gelu(approximate="tanh")), and every variant a DecoderSpec
field asks for (sandwich norms, embedding / residual / logit scales, soft-capping, per-layer
windows and RoPE, layers without RoPE). No family is named: the spec says what the graph holds,
the family (export/family.py) where each weight lives in the checkpoint. The pass pipeline then
does all the fusing (QKV and Gate/Up pairing, quantization) exactly as on the trace.

Each weight is read from the checkpoint (HF safetensors, export/safetensors/checkpoint.py, or a
GGUF file, export/gguf/source.py: both answer `tensors`, `shape`, `array` in HF names), laid
out [K, N], screened and cast, and either appended to `raw.onnx.data` a slab at a time or
(`in_memory`) left as a data-less initializer with a recipe that reads it when the passes or
the writer ask, as export/onnx_export.py's `computed_weights` does. The trace costs ~40 s of
dynamo on a 28-layer model (and ~420 MB of torch, onnxscript and dynamo machinery before the
first weight is read); this costs neither, so it is the default exporter.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import BinaryIO, Protocol

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from fuselm.export.config import DecoderSpec, RopeSpec
from fuselm.export.errors import ExportError
from fuselm.export.export_result import ExportResult, given_lookup
from fuselm.export.family import Source
from fuselm.export.registry import decoder_spec, family_of
from fuselm.export.safetensors.checkpoint import Checkpoint, cast
from fuselm.export.tensor_match import check_layer_count, check_tensor_names
from fuselm.export.weight_screen import WeightScreen
from fuselm.passes import ops

DTYPES = {"float32": (np.float32, TensorProto.FLOAT), "float16": (np.float16, TensorProto.FLOAT16),
          "bfloat16": (ml_dtypes.bfloat16, TensorProto.BFLOAT16)}
_ALIGN = 64  # bytes, as the exporter aligns raw.onnx.data
SLAB_BYTES = 32 << 20  # bytes of rows cast and written at a time
_INLINE = 1024  # values: smaller weights are stored in the model itself (as the exporter does)


class WeightReader(Protocol):
    """A checkpoint in HF tensor names (export/safetensors/checkpoint.py, export/gguf/source.py)."""

    root: Path

    @property
    def tensors(self) -> Iterable[str]: ...

    @property
    def dtype_name(self) -> str: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def array(self, name: str) -> np.ndarray: ...


def resolve_dtype(requested: str | None, checkpoint_dtype: str) -> str:
    """The graph dtype name, as export/onnx_export.py's `resolve_dtype` decides it."""
    if requested in (None, "auto"):
        return "float16" if checkpoint_dtype in ("float16", "bfloat16") else "float32"
    if requested not in DTYPES:
        raise ExportError(f"--dtype {requested} is not supported; choose float32, float16 "
                          "or bfloat16")
    return requested


def parameter_shapes(spec: DecoderSpec) -> dict[str, tuple[int, ...]]:
    """The clean decoder's parameters (export/decoder.py) with their shapes, in the order the
    trace's weights come (the family's `sources` order: embed, each layer's norms then its
    projections, the final norm, the head)."""
    h, d, i = spec.hidden_size, spec.head_dim, spec.intermediate_size
    nq, nkv = spec.num_heads * d, spec.num_kv_heads * d
    out: dict[str, tuple[int, ...]] = {"embed": (spec.vocab_size, h)}
    for layer in range(spec.num_layers):
        p = f"layers.{layer}."
        norms = ["input_norm", *(["q_norm", "k_norm"] if spec.qk_norm else []), "post_norm",
                 *(["attn_out_norm", "mlp_out_norm"] if spec.sandwich_norms else [])]
        for norm in norms:
            out[p + norm] = (d,) if norm in ("q_norm", "k_norm") else (h,)
        for name, k, n, bias in (
                ("q_proj", h, nq, spec.qkv_bias), ("k_proj", h, nkv, spec.qkv_bias),
                ("v_proj", h, nkv, spec.qkv_bias), ("o_proj", nq, h, spec.o_bias),
                ("gate_proj", h, i, spec.mlp_bias), ("up_proj", h, i, spec.mlp_bias),
                ("down_proj", i, h, spec.mlp_bias)):
            out[f"{p}{name}.weight"] = (k, n)
            if bias:
                out[f"{p}{name}.bias"] = (n,)
    out["norm"] = (h,)
    if not spec.tie_word_embeddings:
        out["lm_head"] = (h, spec.vocab_size)
    return out


class _Weights:
    """The graph's weights, one initializer per decoder parameter: each read from the
    checkpoint, laid out, screened and cast, then appended 64-byte aligned to the data file
    `f` and referenced by an external initializer, or (no `f`) left as a data-less
    initializer and a recipe in `recipes`."""

    def __init__(self, ckpt: WeightReader, sources: dict[str, Source], dtype: str,
                 screen: WeightScreen, f: BinaryIO | None = None, location: str = "") -> None:
        self.f, self.location, self.ckpt, self.screen = f, location, ckpt, screen
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

    def values(self, param: str) -> np.ndarray:
        """The parameter's values, cast: a [K, N] weight as the transpose of its C-order
        [N, K] array (the consumers re-lay it out tile by tile, as they do the exporter's)."""
        w = cast(self._read(param), self.np_dtype)
        return w.T if self.sources[param].transpose else w

    def add(self, name: str, shape: tuple[int, ...]) -> None:
        proto = TensorProto(name=name, data_type=self.onnx_dtype, dims=list(shape))
        numel = int(np.prod(shape))
        self.initializers.append(proto)
        if self.f is None:
            if numel <= _INLINE:  # as the writer inlines a small tensor: the same model bytes
                proto.raw_data = np.ascontiguousarray(self.values(name)).tobytes()
                proto.data_location = TensorProto.DEFAULT  # (set, as the writer sets it)
            else:
                self.recipes[name] = lambda: self.values(name)
                self.nbytes += numel * np.dtype(self.np_dtype).itemsize
            return
        w = self._read(name)
        w = w.T if self.sources[name].transpose else w
        pad = (-self.offset) % _ALIGN
        self.f.write(b"\0" * pad)
        self.offset += pad
        start = self.offset
        rows = w.reshape(-1, w.shape[-1]) if w.ndim > 1 else w.reshape(1, -1)
        step = max(1, SLAB_BYTES // (4 * rows.shape[-1]))
        for r in range(0, len(rows), step):
            data = np.ascontiguousarray(cast(np.ascontiguousarray(rows[r: r + step]),
                                             self.np_dtype))
            self.f.write(memoryview(data.reshape(-1).view(np.uint8)))  # (bfloat16: no buffer)
            self.offset += data.nbytes
        del w, rows
        proto.data_location = TensorProto.EXTERNAL
        for key, value in (("location", self.location), ("offset", str(start)),
                           ("length", str(self.offset - start))):
            entry = proto.external_data.add()
            entry.key, entry.value = key, value
        self.nbytes = self.offset


class _Nodes:
    """The graph's nodes and small constants; equal constants are one initializer, as the
    trace's optimizer leaves them."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.constants: dict[tuple[str, tuple[int, ...], bytes], TensorProto] = {}
        self.count = 0

    def const(self, value: np.ndarray) -> str:
        value = np.asarray(value)
        key = (value.dtype.str, value.shape, value.tobytes())
        if key not in self.constants:
            self.constants[key] = numpy_helper.from_array(value, f"const_{len(self.constants)}")
        return self.constants[key].name

    def ints(self, *values: int) -> str:
        return self.const(np.array(values, np.int64))

    def __call__(self, op: str, inputs: list[str], outputs: int | list[str] = 1,
                 domain: str = "", **attrs: object) -> list[str]:
        self.count += 1
        if isinstance(outputs, int):
            outputs = [f"{op.lower()}_{self.count}" if outputs == 1 else
                       f"{op.lower()}_{self.count}_{j}" for j in range(outputs)]
        self.nodes.append(helper.make_node(op, inputs, outputs, name=f"{op}_{self.count}",
                                           domain=domain or None, **attrs))
        return outputs

    def one(self, op: str, inputs: list[str], **attrs: object) -> str:
        return self(op, inputs, **attrs)[0]


def _masks(n: _Nodes, windows: list[int | None]) -> dict[int | None, str]:
    """export/decoder.py's `attention_mask_4d` for each distinct window, in the decoder's
    order, as its trace exports them: bool [batch, 1, seq, total], causal, padded, sliding
    window (if any), each query sees itself; the parts the masks share computed once."""
    zero, one = n.const(np.array(0, np.int64)), n.const(np.array(1, np.int64))
    seq = n.one("Squeeze", n("Shape", ["input_ids"], start=1, end=2))
    total = n.one("Squeeze", n("Shape", ["attention_mask"], start=1, end=2))
    k_pos = n.one("Unsqueeze", [n.one("Range", [zero, total, one]), n.ints(0)])
    q_idx = n.one("Range", [zero, seq, one])
    past = n.one("Sub", [total, seq])
    q_pos = n.one("Unsqueeze", [n.one("Add", [q_idx, past]), n.ints(1)])
    causal = n.one("LessOrEqual", [k_pos, q_pos])
    shared: dict[str, str] = {}
    out: dict[int | None, str] = {}
    for window in dict.fromkeys(windows):
        allowed = causal
        if window is not None:
            lo = n.one("Sub", [q_pos, n.const(np.array(window, np.int64))])
            allowed = n.one("And", [causal, n.one("Greater", [k_pos, lo])])
        if "padded" not in shared:
            cast_mask = n.one("Cast", ["attention_mask"], to=TensorProto.BOOL)
            shared["padded"] = n.one("Unsqueeze", [cast_mask, n.ints(1, 2)])
        allowed = n.one("And", [n.one("Unsqueeze", [allowed, n.ints(0, 1)]), shared["padded"]])
        if "itself" not in shared:
            shared["itself"] = n.one("Unsqueeze", [n.one("Equal", [k_pos, q_pos]), n.ints(0, 1)])
        out[window] = n.one("Or", [allowed, shared["itself"]])
    return out


class _Writer:
    """The decoder's forward (export/decoder.py), op by op as its trace exports it."""

    def __init__(self, n: _Nodes, spec: DecoderSpec, np_dtype: type) -> None:
        self.n, self.spec, self.np_dtype = n, spec, np_dtype
        self.norm_attrs = dict(axis=-1, epsilon=float(spec.rms_norm_eps), stash_type=1)

    def scaled(self, x: str, scale: float) -> str:
        """x * scale, the scale a constant of the graph's dtype (as torch exports x * float)."""
        if scale == 1.0:
            return x
        return self.n.one("Mul", [x, self.n.const(np.array(scale, self.np_dtype))])

    def norm(self, x: str, weight: str) -> str:
        return self.n.one("RMSNormalization", [x, weight], **self.norm_attrs)

    def linear(self, x: str, name: str, bias: bool) -> str:
        y = self.n.one("MatMul", [x, f"{name}.weight"])
        return self.n.one("Add", [y, f"{name}.bias"]) if bias else y

    def rope(self, q: str, k: str, p: str, r: RopeSpec) -> tuple[str, str]:
        s = self.spec
        norms = [p + "q_norm", p + "k_norm"] if s.qk_norm else []
        q, k = self.n("FusedRoPE", [q, k, "position_ids", *norms], 2, domain=ops.DOMAIN,
                      **ops.rope_attributes(
                          s.head_dim, r.rotary_dim, [float(f) for f in r.inv_freq],
                          r.attention_scale, 0, float(s.rms_norm_eps), r.dynamic_factor,
                          r.dynamic_max_positions, r.theta,
                          [] if r.long_inv_freq is None else [float(f) for f in r.long_inv_freq],
                          r.long_after))
        return q, k

    def layer(self, i: int, x: str, mask: str, rope: RopeSpec | None) -> str:
        s, n, p = self.spec, self.n, f"layers.{i}."
        h = self.norm(x, p + "input_norm")
        q = self.linear(h, p + "q_proj", s.qkv_bias)
        k = self.linear(h, p + "k_proj", s.qkv_bias)
        v = self.linear(h, p + "v_proj", s.qkv_bias)
        if rope is not None:  # a layer without RoPE (NoPE) hands q and k straight to attention
            q, k = self.rope(q, k, p, rope)
        scale = s.attention_scale if s.attention_scale is not None else s.head_dim**-0.5
        y = n("Attention", [q, k, v, mask, f"past_key_values.{i}.key",
                            f"past_key_values.{i}.value"],
              [f"attention_{i}", f"present.{i}.key", f"present.{i}.value"],
              is_causal=0, kv_num_heads=s.num_kv_heads, q_num_heads=s.num_heads,
              qk_matmul_output_mode=0, scale=float(scale), softcap=float(s.attn_softcap))[0]
        y = self.linear(y, p + "o_proj", s.o_bias)
        if s.sandwich_norms:
            y = self.norm(y, p + "attn_out_norm")
        x = n.one("Add", [x, self.scaled(y, s.residual_scale)])
        h = self.norm(x, p + "post_norm")
        gate = self.linear(h, p + "gate_proj", s.mlp_bias)
        if s.activation == "silu":
            act = n.one("Mul", [gate, n.one("Sigmoid", [gate])])
        else:
            act = n.one("Gelu", [gate], approximate="tanh")
        y = self.linear(n.one("Mul", [act, self.linear(h, p + "up_proj", s.mlp_bias)]),
                        p + "down_proj", s.mlp_bias)
        if s.sandwich_norms:
            y = self.norm(y, p + "mlp_out_norm")
        return n.one("Add", [x, self.scaled(y, s.residual_scale)])

    def decoder(self) -> None:
        s, n = self.spec, self.n
        masks = _masks(n, s.windows)
        x = self.scaled(n.one("Gather", ["embed", "input_ids"], axis=0), s.embed_scale)
        ropes = s.ropes or [s.rope] * s.num_layers
        for i in range(s.num_layers):
            x = self.layer(i, x, masks[s.windows[i]], ropes[i])
        h = self.norm(x, "norm")
        head = n.one("Transpose", ["embed"], perm=[1, 0]) if s.tie_word_embeddings \
            else "lm_head"
        last = s.logit_scale == 1.0 and s.logit_softcap <= 0
        logits = n("MatMul", [h, head], ["logits"] if last else 1)[0]
        if s.logit_scale != 1.0:
            scale = n.const(np.array(s.logit_scale, self.np_dtype))
            logits = n("Mul", [logits, scale], ["logits"] if s.logit_softcap <= 0 else 1)[0]
        if s.logit_softcap > 0:  # softcap * tanh(logits / softcap)
            cap = n.const(np.array(s.logit_softcap, self.np_dtype))
            n("Mul", [n.one("Tanh", [n.one("Div", [logits, cap])]), cap], ["logits"])


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
    """export/onnx_export.py's `export_model` without the trace: the plain decoder graph with
    float weights, written to `onnx_path` (+ `.data`), or (`in_memory`) nothing written: the
    result carries the model and a recipe per weight. `checkpoint`: where the weights come
    from (default: the safetensors in `model_dir`); `spec`: the model's, when the caller has
    it (a GGUF file's is not read from transformers' config classes)."""
    t0 = time.perf_counter()
    ckpt = checkpoint if checkpoint is not None else Checkpoint(model_dir)
    spec = spec if spec is not None else decoder_spec(model_dir)
    if in_memory and allow_nonfinite:
        raise ValueError("in_memory export cannot record non-finite weights")
    graph_dtype = resolve_dtype(dtype, ckpt.dtype_name)
    np_dtype, elem = DTYPES[graph_dtype]
    result = ExportResult(spec=spec, dtype=graph_dtype, checkpoint_dtype=ckpt.dtype_name)
    check_layer_count(ckpt.tensors, ckpt.root, spec.num_layers)  # before sizing every layer
    shapes = parameter_shapes(spec)
    sources = family_of(spec.architecture).sources(spec, list(shapes))
    check_tensor_names([s.hf_name for s in sources.values()], ckpt.tensors, ckpt.root,
                       spec.num_layers, spec.tie_word_embeddings)
    onnx_path = Path(onnx_path)
    data_path = onnx_path.with_name(onnx_path.name + ".data")
    screen = WeightScreen(graph_dtype, allow_nonfinite)
    n = _Nodes()
    _Writer(n, spec, np_dtype).decoder()
    with contextlib.ExitStack() as stack:
        f = None if in_memory else stack.enter_context(data_path.open("wb"))
        w = _Weights(ckpt, sources, graph_dtype, screen, f, data_path.name)
        _check_shapes(w, shapes)
        for i, (name, shape) in enumerate(shapes.items()):
            w.add(name, shape)
            if progress:
                progress("weights", i + 1, len(shapes))
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
                              [*n.constants.values(), *w.initializers])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", ops.ONNX_OPSET)],
                              ir_version=10, producer_name="fuselm")
    ops.attach_functions(model)
    if in_memory:
        result.model, result.sources = model, w.recipes
    else:
        onnx.save(model, str(onnx_path))
    result.given = given_lookup(ckpt, sources)
    result.weight_bytes = w.nbytes
    result.nonfinite = screen.nonfinite
    result.seconds["build"] = time.perf_counter() - t0
    return result
