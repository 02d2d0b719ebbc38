"""The fuselm op contract, defined once: FusedRoPE, FusedQKV, FusedGateUp, DequantizeAffine,
UnpackUInt6.

Each op has (1) an `onnx.defs.OpSchema` so checkers and torch's exporter know it, (2) a NumPy
reference that tests and runtimes compare against, and (3) an ONNX function body in standard
opset-23 ops that ships inside every model we write, so any ONNX runtime runs the model.

A model-local function is keyed by (domain, op_type), so one model carries one body per op.
Bodies are built for the *variant* the model's nodes use (q/k-norm or not, Q4 or float weights,
bias or not, dynamic NTK or not) and read every number from the node's attributes through
attribute references; `attach_functions` refuses a model that mixes variants of one op.

Semantics that are attributes or absences rather than ops of their own:
- FusedGateUp `activation`: "silu" (SwiGLU) or "gelu_tanh" (GeGLU with tanh-approximated GELU,
  0.5·g·(1 + tanh(√(2/π)·(g + 0.044715·g³))), ONNX Gelu approximate="tanh").
- Attention soft-capping is ONNX Attention's own `softcap` attribute (opset 23), applied to
  the scaled scores before the mask; a custom softmax scale is its `scale` attribute.
- A layer without position encoding (NoPE) has no FusedRoPE node: its q and k go from the
  projections straight to Attention (QKV pairing tells them apart by Attention's inputs).
- Logit soft-capping and the scalar multipliers of some families are plain Tanh/Mul/Div nodes.
- DequantizeAffine is blocked DequantizeLinear with a float bias per block instead of an
  integer zero point, w = codes·scale + bias (MLX's affine form; GGUF's Q4_1 and Q4_K, whose
  per-block minimum no integer zero point holds). Its body computes in float32:
  DequantizeLinear(codes, scale) + DequantizeLinear(ones, bias), the second spreading each
  block's bias over its weights exactly (1·b = b), then casts to the scales' type.
- UnpackUInt6 is the 6-bit integer type ONNX lacks: bytes [3K/4, N] holding 6-bit codes, four
  in three bytes along axis 0 as one little-endian bit stream per column (code i of a column
  at bits 6i .. 6i+5 of its bytes: MLX's own 6-bit packing, row by row of the transpose) →
  uint8 codes [K, N]. A 6-bit weight is DequantizeLinear(UnpackUInt6(bytes), scales, uint8
  zero points), so every reader after the unpacking sees the standard 8-bit form.

export/ and runtime_metal/ import this module and nothing else from passes/.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import AttributeProto, FunctionProto, NodeProto, defs, helper

DOMAIN = "fuselm"
DOMAIN_VERSION = 1
ONNX_OPSET = 23
OP_TYPES = ("FusedRoPE", "FusedQKV", "FusedGateUp", "DequantizeAffine", "UnpackUInt6")
GATE_ACTIVATIONS = ("silu", "gelu_tanh")

_FLOATS = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"]

# ---------------------------------------------------------------------------------------------
# Schemas
# ---------------------------------------------------------------------------------------------

_A = defs.OpSchema.AttrType
_P = defs.OpSchema.FormalParameter
_OPT = defs.OpSchema.FormalParameterOption.Optional

ROPE_ATTRS: dict[str, object] = {
    "head_dim": 0,
    "rotary_dim": 0,
    "inv_freq": [],
    "attention_scale": 1.0,
    "interleaved": 0,
    "norm_eps": 1e-6,
    # dynamic NTK (HF "dynamic"): 0 = off. inv_freq is recomputed from max(position_ids) + 1.
    "dynamic_factor": 0.0,
    "dynamic_max_positions": 0,
    "rope_theta": 10000.0,
    # LongRoPE (HF "longrope"): 0 = off; else long_inv_freq replaces inv_freq when
    # max(position_ids) + 1 > long_after (the checkpoint's original context length).
    "long_inv_freq": [],
    "long_after": 0,
}



def rope_attributes(head_dim: int, rotary_dim: int, inv_freq: list[float],
                    attention_scale: float, interleaved: int, norm_eps: float,
                    dynamic_factor: float, dynamic_max_positions: int, rope_theta: float,
                    long_inv_freq: list[float], long_after: int) -> dict[str, object]:
    """A FusedRoPE node's attributes as fuselm writes them (the exporter's translation and the
    GGUF graph builder): long_inv_freq/long_after only on LongRoPE nodes."""
    attrs: dict[str, object] = dict(
        head_dim=int(head_dim),
        rotary_dim=int(rotary_dim),
        inv_freq=[float(f) for f in inv_freq],
        attention_scale=float(attention_scale),
        interleaved=int(interleaved),
        norm_eps=float(norm_eps),
        dynamic_factor=float(dynamic_factor),
        dynamic_max_positions=int(dynamic_max_positions),
        rope_theta=float(rope_theta),
    )
    if long_after > 0:  # only LongRoPE nodes carry these: every other graph stays as it was
        attrs.update(long_inv_freq=[float(f) for f in long_inv_freq], long_after=int(long_after))
    return attrs


def qkv_attributes(q_size: int, k_size: int, v_size: int,
                   block_size: int | None = None) -> dict[str, object]:
    """A FusedQKV node's attributes (block_size only when its weight is 4-bit codes)."""
    attrs: dict[str, object] = {"q_size": int(q_size), "k_size": int(k_size),
                                "v_size": int(v_size)}
    if block_size is not None:
        attrs["block_size"] = int(block_size)
    return attrs


def gate_up_attributes(activation: str, block_size: int | None = None) -> dict[str, object]:
    """A FusedGateUp node's attributes (block_size only when its weight is 4-bit codes)."""
    if activation not in GATE_ACTIVATIONS:
        raise ValueError(f"FusedGateUp: unsupported activation {activation!r}")
    attrs: dict[str, object] = {"activation": activation}
    if block_size is not None:
        attrs["block_size"] = int(block_size)
    return attrs

def _schemas() -> list[defs.OpSchema]:
    rope = defs.OpSchema(
        "FusedRoPE",
        DOMAIN,
        DOMAIN_VERSION,
        doc="Rotary embedding of q and k in one node (optionally RMS-normalizing each head first).",
        inputs=[
            _P("q", "T", "[batch, seq, q_heads*head_dim]"),
            _P("k", "T", "[batch, seq, kv_heads*head_dim]"),
            _P("position_ids", "tensor(int64)", "[batch, seq]"),
            _P("q_norm", "T", "[head_dim] RMSNorm weight for q heads", param_option=_OPT),
            _P("k_norm", "T", "[head_dim] RMSNorm weight for k heads", param_option=_OPT),
        ],
        outputs=[_P("q_rot", "T", ""), _P("k_rot", "T", "")],
        type_constraints=[("T", _FLOATS, "float activations")],
        attributes=[
            defs.OpSchema.Attribute("head_dim", _A.INT, "", required=True),
            defs.OpSchema.Attribute("rotary_dim", _A.INT, "", required=True),
            defs.OpSchema.Attribute("inv_freq", _A.FLOATS, "", required=True),
            defs.OpSchema.Attribute("attention_scale", _A.FLOAT, "", required=False),
            defs.OpSchema.Attribute("interleaved", _A.INT, "", required=False),
            defs.OpSchema.Attribute("norm_eps", _A.FLOAT, "", required=False),
            defs.OpSchema.Attribute("dynamic_factor", _A.FLOAT, "", required=False),
            defs.OpSchema.Attribute("dynamic_max_positions", _A.INT, "", required=False),
            defs.OpSchema.Attribute("rope_theta", _A.FLOAT, "", required=False),
            defs.OpSchema.Attribute("long_inv_freq", _A.FLOATS, "", required=False),
            defs.OpSchema.Attribute("long_after", _A.INT, "", required=False),
        ],
    )
    weight_inputs = [
        _P("x", "T", "[batch, seq, K]"),
        _P("weight", "W", "[K, N] float weight, or uint4 codes when scales are given"),
        _P("scales", "S", "[K/block, N] Q4 scales", param_option=_OPT),
        _P("zero_points", "Z", "[K/block, N] uint4 zero points", param_option=_OPT),
        _P("bias", "T", "[N]", param_option=_OPT),
    ]
    weight_types = [
        ("T", _FLOATS, "float activations"),
        ("W", [*_FLOATS, "tensor(uint4)", "tensor(int4)"], "weight or codes"),
        ("S", _FLOATS, "scales"),
        ("Z", ["tensor(uint4)", "tensor(int4)"], "zero points"),
    ]
    qkv = defs.OpSchema(
        "FusedQKV",
        DOMAIN,
        DOMAIN_VERSION,
        doc="Q, K and V projections as one matmul over weights packed [Wq | Wk | Wv] along N.",
        inputs=weight_inputs,
        outputs=[_P("q", "T", ""), _P("k", "T", ""), _P("v", "T", "")],
        type_constraints=weight_types,
        attributes=[
            defs.OpSchema.Attribute("q_size", _A.INT, "", required=True),
            defs.OpSchema.Attribute("k_size", _A.INT, "", required=True),
            defs.OpSchema.Attribute("v_size", _A.INT, "", required=True),
            defs.OpSchema.Attribute("block_size", _A.INT, "", required=False),
        ],
    )
    gate_up = defs.OpSchema(
        "FusedGateUp",
        DOMAIN,
        DOMAIN_VERSION,
        doc="act(x @ Wg) * (x @ Wu) as one matmul over weights packed [Wg | Wu] along N.",
        inputs=weight_inputs,
        outputs=[_P("y", "T", "")],
        type_constraints=weight_types,
        attributes=[
            defs.OpSchema.Attribute("activation", _A.STRING, "", required=False),
            defs.OpSchema.Attribute("block_size", _A.INT, "", required=False),
        ],
    )
    affine = defs.OpSchema(
        "DequantizeAffine",
        DOMAIN,
        DOMAIN_VERSION,
        doc="Blocked dequantization with a float bias per block: y = codes * scale + bias "
            "(computed in float32, output in the scales' type); blocks of block_size along "
            "axis, as blocked DequantizeLinear.",
        inputs=[
            _P("codes", "C", "unsigned codes, e.g. [K, N]"),
            _P("scales", "S", "[K/block, N] scales (blocks along axis)"),
            _P("biases", "S", "[K/block, N] biases, the scales' shape"),
        ],
        outputs=[_P("y", "S", "the codes' shape")],
        type_constraints=[("C", ["tensor(uint4)", "tensor(uint8)"], "codes"),
                          ("S", _FLOATS, "scales, biases and output")],
        attributes=[
            defs.OpSchema.Attribute("axis", _A.INT, "", required=True),
            defs.OpSchema.Attribute("block_size", _A.INT, "", required=True),
        ],
    )
    unpack6 = defs.OpSchema(
        "UnpackUInt6",
        DOMAIN,
        DOMAIN_VERSION,
        doc="6-bit codes packed four in three bytes along axis 0 (a little-endian bit stream "
            "per column) -> one uint8 code a byte: [3K/4, N] -> [K, N].",
        inputs=[_P("packed", "tensor(uint8)", "[3K/4, N] packed bytes")],
        outputs=[_P("codes", "tensor(uint8)", "[K, N] codes, each < 64")],
    )
    return [rope, qkv, gate_up, affine, unpack6]


def _last_dim_as(ctx: onnx.shape_inference.InferenceContext, out: int, size: int | None) -> None:
    """Output `out` has x's (input 0's) element type and shape, last axis `size` (None: unknown)."""
    x = ctx.get_input_type(0)
    if x is None or not x.HasField("tensor_type"):
        return
    t = onnx.TypeProto()
    t.tensor_type.elem_type = x.tensor_type.elem_type
    if x.tensor_type.HasField("shape") and len(x.tensor_type.shape.dim):
        dims = list(x.tensor_type.shape.dim)
        for d in dims[:-1]:
            t.tensor_type.shape.dim.add().CopyFrom(d)
        last = t.tensor_type.shape.dim.add()
        if size is not None:
            last.dim_value = size
    ctx.set_output_type(out, t)


def _int_attr(ctx: onnx.shape_inference.InferenceContext, name: str) -> int | None:
    a = ctx.get_attribute(name)
    return None if a is None else int(a.i)


def _infer_rope(ctx: onnx.shape_inference.InferenceContext) -> None:
    for i in (0, 1):  # q_rot, k_rot: exactly the type and shape of q, k
        t = ctx.get_input_type(i)
        if t is not None:
            ctx.set_output_type(i, t)


def _infer_qkv(ctx: onnx.shape_inference.InferenceContext) -> None:
    for i, name in enumerate(("q_size", "k_size", "v_size")):
        _last_dim_as(ctx, i, _int_attr(ctx, name))


def _infer_gate_up(ctx: onnx.shape_inference.InferenceContext) -> None:
    w = ctx.get_input_type(1)
    n = None
    if w is not None and w.tensor_type.HasField("shape") and len(w.tensor_type.shape.dim) == 2:
        d = w.tensor_type.shape.dim[1]
        n = d.dim_value // 2 if d.HasField("dim_value") else None
    _last_dim_as(ctx, 0, n)


def _infer_affine(ctx: onnx.shape_inference.InferenceContext) -> None:
    codes, scales = ctx.get_input_type(0), ctx.get_input_type(1)
    if codes is None or scales is None:
        return
    t = onnx.TypeProto()
    t.tensor_type.elem_type = scales.tensor_type.elem_type
    if codes.tensor_type.HasField("shape"):
        t.tensor_type.shape.CopyFrom(codes.tensor_type.shape)
    ctx.set_output_type(0, t)


def _infer_unpack6(ctx: onnx.shape_inference.InferenceContext) -> None:
    packed = ctx.get_input_type(0)
    t = onnx.TypeProto()
    t.tensor_type.elem_type = onnx.TensorProto.UINT8
    if packed is not None and packed.tensor_type.HasField("shape") and \
            len(packed.tensor_type.shape.dim) == 2:
        rows, cols = packed.tensor_type.shape.dim
        out_rows = t.tensor_type.shape.dim.add()
        if rows.HasField("dim_value"):
            out_rows.dim_value = rows.dim_value * 4 // 3
        t.tensor_type.shape.dim.add().CopyFrom(cols)
    ctx.set_output_type(0, t)


_INFER = {"FusedRoPE": _infer_rope, "FusedQKV": _infer_qkv, "FusedGateUp": _infer_gate_up,
          "DequantizeAffine": _infer_affine, "UnpackUInt6": _infer_unpack6}


def register_schemas() -> None:
    """Make the fuselm ops known to onnx (checker, shape inference, torch's exporter).

    Each schema carries a type/shape inference function: without one, strict shape inference
    leaves every fuselm output untyped and fails on the first standard op that reads it.
    """
    for schema in _schemas():
        if not defs.has(schema.name, schema.domain):
            schema.set_type_and_shape_inference_function(_INFER[schema.name])
            defs.register_schema(schema)


register_schemas()

# ---------------------------------------------------------------------------------------------
# NumPy references
# ---------------------------------------------------------------------------------------------


def rms_norm_reference(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    xf = x.astype(np.float32)
    y = xf / np.sqrt(np.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * weight.astype(np.float32)).astype(x.dtype)


def dynamic_inv_freq(
    seq_len: int, rope_theta: float, rotary_dim: int, factor: float, max_positions: int
) -> np.ndarray:
    """HF's dynamic-NTK frequencies for a sequence of `seq_len` positions."""
    length = max(seq_len, max_positions)
    base = rope_theta * ((factor * length / max_positions) - (factor - 1)) ** (
        rotary_dim / (rotary_dim - 2)
    )
    exps = np.arange(0, rotary_dim, 2, dtype=np.float32) / np.float32(rotary_dim)
    return (1.0 / (np.float32(base) ** exps)).astype(np.float32)


def rope_cos_sin(
    position_ids: np.ndarray,
    inv_freq: np.ndarray,
    attention_scale: float = 1.0,
    interleaved: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin laid out [batch, seq, 1, rotary_dim]: they broadcast over heads (axis 2).

    The layout matters (seed step 10): with head_dim != hidden/heads, a table laid out as
    [seq, 1, dim, 1] still broadcasts for some shapes and silently rotates the wrong axis.
    """
    freqs = position_ids.astype(np.float32)[..., None] * inv_freq.astype(np.float32)
    emb = np.repeat(freqs, 2, axis=-1) if interleaved else np.concatenate([freqs, freqs], -1)
    cos = np.cos(emb) * np.float32(attention_scale)
    sin = np.sin(emb) * np.float32(attention_scale)
    return cos[:, :, None, :].astype(np.float32), sin[:, :, None, :].astype(np.float32)


def _rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleaved: int) -> np.ndarray:
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        rot = np.stack([-x2, x1], axis=-1).reshape(x.shape)
    else:
        half = x.shape[-1] // 2
        rot = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rot * sin


def fused_rope_reference(
    q: np.ndarray,
    k: np.ndarray,
    position_ids: np.ndarray,
    q_norm: np.ndarray | None = None,
    k_norm: np.ndarray | None = None,
    **attrs: object,
) -> tuple[np.ndarray, np.ndarray]:
    a = {**ROPE_ATTRS, **attrs}
    head_dim, rotary_dim = int(a["head_dim"]), int(a["rotary_dim"])
    inv_freq = np.asarray(a["inv_freq"], dtype=np.float32)
    if int(a["long_after"]) > 0 and int(position_ids.max()) + 1 > int(a["long_after"]):
        inv_freq = np.asarray(a["long_inv_freq"], dtype=np.float32)
    elif float(a["dynamic_factor"]) > 0:
        inv_freq = dynamic_inv_freq(
            int(position_ids.max()) + 1,
            float(a["rope_theta"]),
            rotary_dim,
            float(a["dynamic_factor"]),
            int(a["dynamic_max_positions"]),
        )
    cos, sin = rope_cos_sin(
        position_ids, inv_freq, float(a["attention_scale"]), int(a["interleaved"])
    )

    def one(x: np.ndarray, norm: np.ndarray | None) -> np.ndarray:
        b, s, _ = x.shape
        h = x.reshape(b, s, -1, head_dim)
        if norm is not None:
            h = rms_norm_reference(h, norm, float(a["norm_eps"]))
        hf = h.astype(np.float32)
        rot = _rotate(hf[..., :rotary_dim], cos, sin, int(a["interleaved"]))
        out = np.concatenate([rot, hf[..., rotary_dim:]], axis=-1).astype(x.dtype)
        return out.reshape(b, s, -1)

    return one(q, q_norm), one(k, k_norm)


def dequantize_reference(
    codes: np.ndarray, scales: np.ndarray, zero_points: np.ndarray, block_size: int
) -> np.ndarray:
    """Blocked DequantizeLinear along axis 0:
    w[k, n] = (codes[k, n] - zp[k // B, n]) * s[k // B, n].

    Returns the scales' dtype, as ONNX DequantizeLinear does.
    """
    rows = codes.shape[0]
    s = np.repeat(scales, block_size, axis=0)[:rows]
    z = np.repeat(zero_points.astype(np.int32), block_size, axis=0)[:rows]
    return ((codes.astype(np.int32) - z).astype(np.float32) * s.astype(np.float32)).astype(
        scales.dtype
    )


def dequantize_affine_reference(
    codes: np.ndarray, scales: np.ndarray, biases: np.ndarray, block_size: int, axis: int = 0
) -> np.ndarray:
    """DequantizeAffine: w = codes * s + b per block of `block_size` along `axis`, in float32,
    returned in the scales' dtype."""
    ax = axis % codes.ndim
    n = codes.shape[ax]
    s = np.repeat(scales.astype(np.float32), block_size, axis=ax).take(range(n), axis=ax)
    b = np.repeat(biases.astype(np.float32), block_size, axis=ax).take(range(n), axis=ax)
    return (codes.astype(np.float32) * s + b).astype(scales.dtype)


def pack_uint6(codes: np.ndarray) -> np.ndarray:
    """uint8 codes [K, N] (values < 64, K a multiple of 4) -> bytes [3K/4, N], UnpackUInt6's
    layout: codes 4j .. 4j+3 of a column in bytes 3j .. 3j+2, code 4j+i at bits 6i .. 6i+5."""
    k, n = codes.shape
    if k % 4:
        raise ValueError(f"6-bit codes pack four at a time; {k} rows is not a multiple of 4")
    c = np.ascontiguousarray(codes, dtype=np.uint8).reshape(k // 4, 4, n)
    out = np.empty((k // 4, 3, n), np.uint8)
    out[:, 0] = c[:, 0] | (c[:, 1] << 6)
    out[:, 1] = (c[:, 1] >> 2) | (c[:, 2] << 4)
    out[:, 2] = (c[:, 2] >> 4) | (c[:, 3] << 2)
    return out.reshape(3 * k // 4, n)


def unpack_uint6_reference(packed: np.ndarray) -> np.ndarray:
    """UnpackUInt6: bytes [3K/4, N] -> uint8 codes [K, N] (pack_uint6's inverse)."""
    rows, n = packed.shape
    if rows % 3:
        raise ValueError(f"UnpackUInt6: {rows} packed rows is not a multiple of 3")
    b = np.ascontiguousarray(packed, dtype=np.uint8).reshape(rows // 3, 3, n)
    out = np.empty((rows // 3, 4, n), np.uint8)
    out[:, 0] = b[:, 0] & 63
    out[:, 1] = (b[:, 0] >> 6) | ((b[:, 1] & 15) << 2)
    out[:, 2] = (b[:, 1] >> 4) | ((b[:, 2] & 3) << 4)
    out[:, 3] = b[:, 2] >> 2
    return out.reshape(4 * rows // 3, n)


def _project(
    x: np.ndarray,
    weight: np.ndarray,
    scales: np.ndarray | None,
    zero_points: np.ndarray | None,
    bias: np.ndarray | None,
    block_size: int,
) -> np.ndarray:
    if scales is not None:
        assert zero_points is not None
        weight = dequantize_reference(weight, scales, zero_points, block_size)
    y = (x.astype(np.float32) @ weight.astype(x.dtype).astype(np.float32)).astype(x.dtype)
    if bias is not None:
        y = y + bias.astype(x.dtype)
    return y


def fused_qkv_reference(
    x: np.ndarray,
    weight: np.ndarray,
    scales: np.ndarray | None = None,
    zero_points: np.ndarray | None = None,
    bias: np.ndarray | None = None,
    *,
    q_size: int,
    k_size: int,
    v_size: int,
    block_size: int = 32,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    y = _project(x, weight, scales, zero_points, bias, block_size)
    return y[..., :q_size], y[..., q_size : q_size + k_size], y[..., q_size + k_size :]


def fused_gate_up_reference(
    x: np.ndarray,
    weight: np.ndarray,
    scales: np.ndarray | None = None,
    zero_points: np.ndarray | None = None,
    bias: np.ndarray | None = None,
    *,
    activation: str = "silu",
    block_size: int = 32,
) -> np.ndarray:
    if activation not in GATE_ACTIVATIONS:
        raise ValueError(
            f"FusedGateUp: unsupported activation {activation!r} "
            f"(supported: {', '.join(GATE_ACTIVATIONS)})"
        )
    y = _project(x, weight, scales, zero_points, bias, block_size).astype(np.float32)
    n = y.shape[-1] // 2
    gate, up = y[..., :n], y[..., n:]
    return (gate_activation_reference(gate, activation) * up).astype(x.dtype)


def gate_activation_reference(gate: np.ndarray, activation: str) -> np.ndarray:
    if activation == "gelu_tanh":
        inner = np.float32(np.sqrt(2.0 / np.pi)) * (gate + np.float32(0.044715) * gate**3)
        return np.float32(0.5) * gate * (np.float32(1.0) + np.tanh(inner))
    return gate / (np.float32(1.0) + np.exp(-gate))


# ---------------------------------------------------------------------------------------------
# Function bodies
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    """What shapes a function body: which optional inputs a node uses, and dynamic NTK."""

    op_type: str
    present: tuple[bool, ...]  # per optional input, in schema order
    activation: str = "silu"  # FusedGateUp's
    dynamic: bool = False
    long: bool = False  # LongRoPE's switch to long_inv_freq
    partial: bool = False
    interleaved: bool = False


def _has(node: NodeProto, i: int) -> bool:
    return len(node.input) > i and node.input[i] != ""


def _attr(node: NodeProto, name: str, default: object = None) -> object:
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def variant_of(node: NodeProto) -> Variant:
    if node.op_type == "FusedRoPE":
        head_dim = int(_attr(node, "head_dim", 0))
        rotary_dim = int(_attr(node, "rotary_dim", head_dim))
        return Variant(
            "FusedRoPE",
            (_has(node, 3), _has(node, 4)),
            dynamic=float(_attr(node, "dynamic_factor", 0.0)) > 0,
            long=int(_attr(node, "long_after", 0)) > 0,
            partial=rotary_dim != head_dim,
            interleaved=bool(_attr(node, "interleaved", 0)),
        )
    if node.op_type == "FusedGateUp":
        act = _attr(node, "activation", b"silu")
        act = act.decode() if isinstance(act, bytes) else str(act)
        return Variant(node.op_type, (_has(node, 2), _has(node, 3), _has(node, 4)), act)
    if node.op_type == "FusedQKV":
        return Variant(node.op_type, (_has(node, 2), _has(node, 3), _has(node, 4)))
    if node.op_type in ("DequantizeAffine", "UnpackUInt6"):
        return Variant(node.op_type, ())
    raise ValueError(f"not a fuselm op: {node.op_type}")


def _ref(name: str, ref: str, kind: int) -> AttributeProto:
    return AttributeProto(name=name, ref_attr_name=ref, type=kind)


def _const_ref(out: str, ref: str, kind: str) -> NodeProto:
    """Constant whose value is the calling node's attribute `ref` (value_int/value_float/...)."""
    types = {
        "value_int": AttributeProto.INT,
        "value_float": AttributeProto.FLOAT,
        "value_floats": AttributeProto.FLOATS,
    }
    node = helper.make_node("Constant", [], [out])
    node.attribute.append(_ref(kind, ref, types[kind]))
    return node


def _c(out: str, value: np.ndarray | int | float | list) -> NodeProto:
    arr = np.asarray(value)
    if arr.dtype == np.float64:
        arr = arr.astype(np.float32)
    return helper.make_node("Constant", [], [out], value=onnx.numpy_helper.from_array(arr, out))


def _n(op: str, ins: list[str], outs: list[str], **kw: object) -> NodeProto:
    return helper.make_node(op, ins, outs, **kw)


def _rope_body(v: Variant) -> tuple[list[str], list[NodeProto]]:
    has_qn, has_kn = v.present
    # Formal inputs are always all five; the body reads only those this variant has.
    inputs = ["q", "k", "position_ids", "q_norm", "k_norm"]
    nodes: list[NodeProto] = [
        _const_ref("head_dim", "head_dim", "value_int"),
        _const_ref("rotary_dim", "rotary_dim", "value_int"),
        _const_ref("attention_scale", "attention_scale", "value_float"),
        _c("zero", np.array([0], np.int64)),
        _c("minus1", np.array([-1], np.int64)),
        _c("ax_last", np.array([-1], np.int64)),
        _c("ax_2", np.array([2], np.int64)),
        _c("one", np.array([1], np.int64)),
        _n("Reshape", ["head_dim", "one"], ["head_dim_1d"]),
        _n("Reshape", ["rotary_dim", "one"], ["rotary_dim_1d"]),
        _n("Concat", ["zero", "zero", "minus1", "head_dim_1d"], ["heads_shape"], axis=0),
        _n("Concat", ["zero", "zero", "minus1"], ["flat_shape"], axis=0),
    ]
    # inverse frequencies: the attribute, or dynamic NTK's from max(position_ids) + 1
    if v.dynamic:
        nodes += [
            _const_ref("theta", "rope_theta", "value_float"),
            _const_ref("factor", "dynamic_factor", "value_float"),
            _const_ref("maxpos_i", "dynamic_max_positions", "value_int"),
            _n("Cast", ["maxpos_i"], ["maxpos"], to=onnx.TensorProto.FLOAT),
            _n("ReduceMax", ["position_ids"], ["pmax"], keepdims=0),
            _c("one_i", np.array(1, np.int64)),
            _n("Add", ["pmax", "one_i"], ["len_i"]),
            _n("Cast", ["len_i"], ["len_f"], to=onnx.TensorProto.FLOAT),
            _n("Max", ["len_f", "maxpos"], ["length"]),
            _c("one_f", np.array(1.0, np.float32)),
            _n("Mul", ["factor", "length"], ["fl"]),
            _n("Div", ["fl", "maxpos"], ["flm"]),
            _n("Sub", ["factor", "one_f"], ["fm1"]),
            _n("Sub", ["flm", "fm1"], ["ratio"]),
            _n("Cast", ["rotary_dim"], ["rd_f"], to=onnx.TensorProto.FLOAT),
            _c("two_f", np.array(2.0, np.float32)),
            _n("Sub", ["rd_f", "two_f"], ["rd_m2"]),
            _n("Div", ["rd_f", "rd_m2"], ["ntk_exp"]),
            _n("Pow", ["ratio", "ntk_exp"], ["ntk"]),
            _n("Mul", ["theta", "ntk"], ["base"]),
            _c("zero_f", np.array(0.0, np.float32)),
            _n("Range", ["zero_f", "rd_f", "two_f"], ["evens"]),
            _n("Div", ["evens", "rd_f"], ["exps"]),
            _n("Pow", ["base", "exps"], ["base_pow"]),
            _n("Reciprocal", ["base_pow"], ["inv_freq"]),
        ]
    elif v.long:
        nodes += [
            _const_ref("short_freq", "inv_freq", "value_floats"),
            _const_ref("long_freq", "long_inv_freq", "value_floats"),
            _const_ref("long_after", "long_after", "value_int"),
            _n("ReduceMax", ["position_ids"], ["pmax"], keepdims=0),
            _n("GreaterOrEqual", ["pmax", "long_after"], ["use_long"]),  # max + 1 > after
            _n("Where", ["use_long", "long_freq", "short_freq"], ["inv_freq"]),
        ]
    else:
        nodes.append(_const_ref("inv_freq", "inv_freq", "value_floats"))
    # freqs [b, s, rd/2] -> cos/sin [b, s, 1, rd] (broadcast over the heads axis)
    nodes += [
        _n("Cast", ["position_ids"], ["pos_f"], to=onnx.TensorProto.FLOAT),
        _n("Unsqueeze", ["pos_f", "ax_last"], ["pos_3d"]),
        _n("Mul", ["pos_3d", "inv_freq"], ["freqs"]),
    ]
    if v.interleaved:
        nodes += [
            _n("Unsqueeze", ["freqs", "ax_last"], ["freqs_4d"]),
            _n("Concat", ["freqs_4d", "freqs_4d"], ["freqs_pairs"], axis=-1),
            _n("Concat", ["zero", "zero", "minus1"], ["emb_shape"], axis=0),
            _n("Reshape", ["freqs_pairs", "emb_shape"], ["emb"]),
        ]
    else:
        nodes.append(_n("Concat", ["freqs", "freqs"], ["emb"], axis=-1))
    nodes += [
        _n("Cos", ["emb"], ["cos_raw"]),
        _n("Sin", ["emb"], ["sin_raw"]),
        _n("Mul", ["cos_raw", "attention_scale"], ["cos_s"]),
        _n("Mul", ["sin_raw", "attention_scale"], ["sin_s"]),
        _n("Unsqueeze", ["cos_s", "ax_2"], ["cos"]),
        _n("Unsqueeze", ["sin_s", "ax_2"], ["sin"]),
    ]
    for x, norm_input, out in (
        ("q", "q_norm" if has_qn else None, "q_rot"),
        ("k", "k_norm" if has_kn else None, "k_rot"),
    ):
        p = f"{x}_"
        nodes.append(_n("Reshape", [x, "heads_shape"], [p + "heads"]))
        src = p + "heads"
        if norm_input is not None:
            nodes += [
                _n("Cast", [src], [p + "h32"], to=onnx.TensorProto.FLOAT),
                _n("Cast", [norm_input], [p + "w32"], to=onnx.TensorProto.FLOAT),
                helper.make_node(
                    "RMSNormalization", [p + "h32", p + "w32"], [p + "normed32"], axis=-1
                ),
                _n("CastLike", [p + "normed32", x], [p + "normed"]),
            ]
            nodes[-2].attribute.append(_ref("epsilon", "norm_eps", AttributeProto.FLOAT))
            src = p + "normed"
        nodes.append(_n("Cast", [src], [p + "f32"], to=onnx.TensorProto.FLOAT))
        src = p + "f32"
        if v.partial:
            nodes += [
                _n("Shape", [src], [p + "shape"]),
                _n("Gather", [p + "shape", "minus1"], [p + "hd"], axis=0),
                _n("Sub", [p + "hd", "rotary_dim_1d"], [p + "pass_dim"]),
                _n("Concat", ["rotary_dim_1d", p + "pass_dim"], [p + "split"], axis=0),
                _n("Split", [src, p + "split"], [p + "rot_in", p + "pass"], axis=-1),
            ]
            rot_in = p + "rot_in"
        else:
            rot_in = src
        if v.interleaved:
            nodes += [
                _n("Shape", [rot_in], [p + "rshape"]),
                _c(p + "pair", np.array([-1, 2], np.int64)),
                _n("Slice", [p + "rshape", "zero", "minus1"], [p + "lead"]),
                _n("Concat", [p + "lead", p + "pair"], [p + "pshape"], axis=0),
                _n("Reshape", [rot_in, p + "pshape"], [p + "pairs"]),
                _n("Split", [p + "pairs"], [p + "x1", p + "x2"], axis=-1, num_outputs=2),
                _n("Neg", [p + "x2"], [p + "nx2"]),
                _n("Concat", [p + "nx2", p + "x1"], [p + "rpairs"], axis=-1),
                _n("Shape", [rot_in], [p + "rshape2"]),
                _n("Reshape", [p + "rpairs", p + "rshape2"], [p + "rotated"]),
            ]
        else:
            nodes += [
                _n("Split", [rot_in], [p + "x1", p + "x2"], axis=-1, num_outputs=2),
                _n("Neg", [p + "x2"], [p + "nx2"]),
                _n("Concat", [p + "nx2", p + "x1"], [p + "rotated"], axis=-1),
            ]
        nodes += [
            _n("Mul", [rot_in, "cos"], [p + "xc"]),
            _n("Mul", [p + "rotated", "sin"], [p + "rs"]),
            _n("Add", [p + "xc", p + "rs"], [p + "roped"]),
        ]
        roped = p + "roped"
        if v.partial:
            nodes.append(_n("Concat", [roped, p + "pass"], [p + "joined"], axis=-1))
            roped = p + "joined"
        nodes += [
            _n("CastLike", [roped, x], [p + "cast"]),
            _n("Reshape", [p + "cast", "flat_shape"], [out]),
        ]
    return inputs, nodes


def _project_body(v: Variant, outputs: list[str]) -> tuple[list[str], list[NodeProto]]:
    quant = v.present[0]
    has_bias = v.present[2]
    inputs = ["x", "weight", "scales", "zero_points", "bias"]
    nodes: list[NodeProto] = []
    w = "weight"
    if quant:
        dq = _n("DequantizeLinear", ["weight", "scales", "zero_points"], ["w_dq"], axis=0)
        dq.attribute.append(_ref("block_size", "block_size", AttributeProto.INT))
        nodes += [dq, _n("CastLike", ["w_dq", "x"], ["w_cast"])]
        w = "w_cast"
    else:
        nodes.append(_n("CastLike", [w, "x"], ["w_cast"]))
        w = "w_cast"
    nodes.append(_n("MatMul", ["x", w], ["y_mm"]))
    y = "y_mm"
    if has_bias:
        nodes.append(_n("Add", [y, "bias"], ["y_b"]))
        y = "y_b"
    return inputs, nodes + [_n("Identity", [y], [outputs[0]])]


def _qkv_body(v: Variant) -> tuple[list[str], list[NodeProto]]:
    inputs, nodes = _project_body(v, ["y"])
    nodes += [
        _const_ref("qs", "q_size", "value_int"),
        _const_ref("ks", "k_size", "value_int"),
        _const_ref("vs", "v_size", "value_int"),
        _c("one", np.array([1], np.int64)),
        _n("Reshape", ["qs", "one"], ["qs1"]),
        _n("Reshape", ["ks", "one"], ["ks1"]),
        _n("Reshape", ["vs", "one"], ["vs1"]),
        _n("Concat", ["qs1", "ks1", "vs1"], ["sizes"], axis=0),
        _n("Split", ["y", "sizes"], ["q", "k", "v"], axis=-1),
    ]
    return inputs, nodes


def _gate_up_body(v: Variant) -> tuple[list[str], list[NodeProto]]:
    inputs, nodes = _project_body(v, ["gu"])
    nodes.append(_n("Split", ["gu"], ["gate", "up"], axis=-1, num_outputs=2))
    if v.activation == "gelu_tanh":
        nodes.append(_n("Gelu", ["gate"], ["act"], approximate="tanh"))
    else:
        nodes += [_n("Sigmoid", ["gate"], ["sig"]), _n("Mul", ["gate", "sig"], ["act"])]
    nodes.append(_n("Mul", ["act", "up"], ["y"]))
    return inputs, nodes


def _affine_body(v: Variant) -> tuple[list[str], list[NodeProto]]:
    del v  # one form
    inputs = ["codes", "scales", "biases"]

    def dq(ins: list[str], out: str) -> NodeProto:
        node = _n("DequantizeLinear", ins, [out])
        node.attribute.extend([_ref("axis", "axis", AttributeProto.INT),
                               _ref("block_size", "block_size", AttributeProto.INT)])
        return node

    nodes = [
        _n("Cast", ["scales"], ["s32"], to=onnx.TensorProto.FLOAT),
        _n("Cast", ["biases"], ["b32"], to=onnx.TensorProto.FLOAT),
        dq(["codes", "s32"], "qs"),
        _n("Shape", ["qs"], ["shape"]),  # (of the float32 values: no Shape kernel on uint4)
        _n("ConstantOfShape", ["shape"], ["ones"],
           value=helper.make_tensor("one", onnx.TensorProto.UINT8, [1], [1])),
        dq(["ones", "b32"], "bias_full"),
        _n("Add", ["qs", "bias_full"], ["y32"]),
        _n("CastLike", ["y32", "scales"], ["y"]),
    ]
    return inputs, nodes


def _unpack6_body(v: Variant) -> tuple[list[str], list[NodeProto]]:
    """unpack_uint6_reference in standard ops: the bytes [3K/4, N] transposed to [N, 3K/4] and
    read three at a time ([N, K/4, 3]), so every shape is a constant or copied (Reshape's 0)."""
    del v  # one form

    def const(name: str, values: list[int], dtype: int = onnx.TensorProto.INT64) -> NodeProto:
        return _n("Constant", [], [name],
                  value=helper.make_tensor(name, dtype, [len(values)], values))

    def shift(x: str, by: str, out: str, direction: str) -> NodeProto:
        return _n("BitShift", [x, by], [out], direction=direction)

    u8 = onnx.TensorProto.UINT8
    nodes = [
        const("triples", [0, -1, 3]), const("flat", [0, -1]),
        const("m63", [63], u8), const("m15", [15], u8), const("m3", [3], u8),
        const("two", [2], u8), const("four", [4], u8), const("six", [6], u8),
        _n("Transpose", ["packed"], ["cols"], perm=[1, 0]),
        _n("Reshape", ["cols", "triples"], ["b"]),
        _n("Split", ["b"], ["b0", "b1", "b2"], axis=-1, num_outputs=3),
        _n("BitwiseAnd", ["b0", "m63"], ["c0"]),
        shift("b0", "six", "b0h", "RIGHT"),
        _n("BitwiseAnd", ["b1", "m15"], ["b1l"]),
        shift("b1l", "two", "b1s", "LEFT"),
        _n("BitwiseOr", ["b0h", "b1s"], ["c1"]),
        shift("b1", "four", "b1h", "RIGHT"),
        _n("BitwiseAnd", ["b2", "m3"], ["b2l"]),
        shift("b2l", "four", "b2s", "LEFT"),
        _n("BitwiseOr", ["b1h", "b2s"], ["c2"]),
        shift("b2", "two", "c3", "RIGHT"),
        _n("Concat", ["c0", "c1", "c2", "c3"], ["c"], axis=-1),
        _n("Reshape", ["c", "flat"], ["rows"]),
        _n("Transpose", ["rows"], ["codes"], perm=[1, 0]),
    ]
    return ["packed"], nodes


_ATTRS = {
    "DequantizeAffine": ["axis", "block_size"],
    "UnpackUInt6": [],
    "FusedRoPE": list(ROPE_ATTRS),
    "FusedQKV": ["q_size", "k_size", "v_size", "block_size"],
    "FusedGateUp": ["activation", "block_size"],
}
_OUTPUTS = {"FusedRoPE": ["q_rot", "k_rot"], "FusedQKV": ["q", "k", "v"], "FusedGateUp": ["y"],
            "DequantizeAffine": ["y"], "UnpackUInt6": ["codes"]}


def function_for(v: Variant) -> FunctionProto:
    build = {"FusedRoPE": _rope_body, "FusedQKV": _qkv_body, "FusedGateUp": _gate_up_body,
             "DequantizeAffine": _affine_body, "UnpackUInt6": _unpack6_body}
    inputs, nodes = build[v.op_type](v)
    return helper.make_function(
        DOMAIN,
        v.op_type,
        [i for i in inputs],
        _OUTPUTS[v.op_type],
        nodes,
        [helper.make_opsetid("", ONNX_OPSET)],
        _ATTRS[v.op_type],
    )


def _iter_nodes(graph: onnx.GraphProto):  # noqa: ANN202 - generator over nested graphs
    for node in graph.node:
        yield node
        for a in node.attribute:
            if a.type == AttributeProto.GRAPH:
                yield from _iter_nodes(a.g)


def attach_functions(model: onnx.ModelProto) -> None:
    """Give `model` exactly one function body per fuselm op it uses (and the fuselm opset).

    Raises ValueError if one op appears in two variants (one body per op per model).
    """
    variants: dict[str, Variant] = {}
    for node in _iter_nodes(model.graph):
        if node.domain != DOMAIN:
            continue
        v = variant_of(node)
        seen = variants.setdefault(node.op_type, v)
        if seen != v:
            raise ValueError(
                f"{node.op_type} appears in two variants ({seen} and {v}); a model carries one "
                "function body per op, so all its nodes must use the same optional inputs"
            )
    kept = [f for f in model.functions if f.domain != DOMAIN]
    del model.functions[:]
    model.functions.extend(kept)
    for op_type in OP_TYPES:
        if op_type in variants:
            model.functions.append(function_for(variants[op_type]))
    imports = {o.domain: o for o in model.opset_import}
    if variants and DOMAIN not in imports:
        model.opset_import.append(helper.make_opsetid(DOMAIN, DOMAIN_VERSION))
    if not variants and DOMAIN in imports:
        keep = [o for o in model.opset_import if o.domain != DOMAIN]
        del model.opset_import[:]
        model.opset_import.extend(keep)
