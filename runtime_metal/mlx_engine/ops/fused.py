"""The fuselm ops (passes/ops.py is the contract): FusedRoPE -> mx.fast.rope, FusedQKV and
FusedGateUp -> ONE matmul (float or quantized) over the packed weight."""

from __future__ import annotations

from types import ModuleType

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from fuselm.passes import ops as contract
from fuselm.runtime_metal.mlx_engine.ops.linear import project
from fuselm.runtime_metal.mlx_engine.ops.registry import op
from fuselm.runtime_metal.mlx_engine.qweight import QWeight

D = contract.DOMAIN


def _offsets(position_ids) -> mx.array | int | None:  # noqa: ANN001
    """Per-row start positions when every row is contiguous (what mx.fast.rope needs), else None.

    Positions are host values in the executor, so this check costs no device sync."""
    pos = np.asarray(position_ids) if isinstance(position_ids, np.ndarray) else np.array(
        position_ids)
    start = pos[:, :1]
    if not (pos == start + np.arange(pos.shape[1])).all():
        return None
    if (start == start[0, 0]).all():
        return int(start[0, 0])
    return mx.array(start[:, 0].astype(np.int32))


def _rope_general(h: mx.array, pos: np.ndarray, inv_freq: np.ndarray, rotary_dim: int,
                  interleaved: bool) -> mx.array:
    """Any positions (padding, gaps): cos/sin laid out [b, s, 1, rd] over h [b, s, H, D]."""
    cos, sin = contract.rope_cos_sin(pos, inv_freq, 1.0, int(interleaved))
    cos, sin = mx.array(cos), mx.array(sin)
    x = h[..., :rotary_dim].astype(mx.float32)
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        rot = mx.stack([-x2, x1], axis=-1).reshape(x.shape)
    else:
        half = rotary_dim // 2
        rot = mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    out = (x * cos + rot * sin).astype(h.dtype)
    return mx.concatenate([out, h[..., rotary_dim:]], axis=-1) if rotary_dim < h.shape[-1] else out


@op(D, "FusedRoPE", host=False, static=(2,))
def fused_rope(  # noqa: ANN201
    xp: ModuleType, q, k, position_ids, q_norm=None, k_norm=None, *,  # noqa: ANN001
    head_dim: int, rotary_dim: int = 0, inv_freq: list[float] | None = None,
    attention_scale: float = 1.0, interleaved: int = 0, norm_eps: float = 1e-6,
    dynamic_factor: float = 0.0, dynamic_max_positions: int = 0, rope_theta: float = 10000.0,
    long_inv_freq: list[float] | None = None, long_after: int = 0,
    device_offset: mx.array | None = None,
):
    """`device_offset` (the compiled program, mlx_engine/decode.py): the device-side start
    position of contiguous rows (a scalar, or [b] one per batch row), given instead of host
    `position_ids`, so one trace serves every step. The program refuses dynamic NTK, whose
    frequencies depend on host positions; LongRoPE's switch is a device-side select."""
    rotary_dim = rotary_dim or head_dim
    freqs_inv = np.asarray(inv_freq or [], np.float32)
    if device_offset is not None:
        pos, offset = None, device_offset
    else:
        pos = np.asarray(position_ids)
        if long_after > 0 and int(pos.max()) + 1 > long_after:
            freqs_inv = np.asarray(long_inv_freq or [], np.float32)
        elif dynamic_factor > 0:
            freqs_inv = contract.dynamic_inv_freq(int(pos.max()) + 1, rope_theta, rotary_dim,
                                                  dynamic_factor, dynamic_max_positions)
        offset = _offsets(pos)
    # MLX wants periods, not inverse frequencies (inv_freq itself gives garbage).
    periods = mx.array((1.0 / freqs_inv.astype(np.float64)).astype(np.float32))
    if device_offset is not None and long_after > 0:
        # LongRoPE on the device: the long frequencies once the chunk's last position
        # (offset + s - 1) reaches long_after, chosen in the graph (no host sync).
        long = np.asarray(long_inv_freq or [], np.float64)
        last = mx.max(device_offset) + q.shape[1]
        periods = mx.where(last > long_after, mx.array((1.0 / long).astype(np.float32)), periods)

    def one(x: mx.array, norm) -> mx.array:  # noqa: ANN001
        b, s, _ = x.shape
        h = x.reshape(b, s, -1, head_dim)
        if norm is not None:
            h = mx.fast.rms_norm(h, norm, norm_eps)
        if offset is None:
            out = _rope_general(h, pos, freqs_inv, rotary_dim, bool(interleaved))
        else:
            # mx.fast.rope rotates the second-to-last axis as time: [b, H, s, D].
            hh = h.transpose(0, 2, 1, 3)
            out = mx.fast.rope(hh, rotary_dim, traditional=bool(interleaved), base=None,
                               scale=1.0, offset=offset, freqs=periods).transpose(0, 2, 1, 3)
        if attention_scale != 1.0:  # YaRN's factor: mx.fast.rope does not apply it
            if rotary_dim == head_dim:
                out = out * attention_scale
            else:
                out = mx.concatenate(
                    [out[..., :rotary_dim] * attention_scale, out[..., rotary_dim:]], axis=-1)
        return out.reshape(b, s, -1)

    return one(q, q_norm), one(k, k_norm)


def _dense_or_q(weight, scales, zero_points, block_size: int):  # noqa: ANN001, ANN202
    if scales is None or isinstance(weight, QWeight):
        return weight
    from fuselm.runtime_metal.mlx_engine.ops.linear import dequantize_linear

    return dequantize_linear(mx, weight, scales, zero_points, axis=0, block_size=block_size)


@op(D, "FusedQKV", qweight=True)
def fused_qkv(  # noqa: ANN201
    xp: ModuleType, x, weight, scales=None, zero_points=None, bias=None, *,  # noqa: ANN001
    q_size: int, k_size: int, v_size: int, block_size: int = 32, joined: bool = False,
):
    """joined (a runtime keyword, not an attribute): also return the projection [..., q+k+v]
    the three are sliced from, for a decode kernel that reads them out of it
    (kernels_cuda.rope_attend's qkv)."""
    w = _dense_or_q(weight, scales, zero_points, block_size)
    y = project(x, w.astype(x.dtype) if isinstance(w, mx.array) else w, bias)
    q, k, v = y[..., :q_size], y[..., q_size:q_size + k_size], y[..., q_size + k_size:]
    return (q, k, v, y) if joined else (q, k, v)


@op(D, "FusedGateUp", qweight=True)
def fused_gate_up(  # noqa: ANN201
    xp: ModuleType, x, weight, scales=None, zero_points=None, bias=None, *,  # noqa: ANN001
    activation: str = "silu", block_size: int = 32,
):
    if activation not in contract.GATE_ACTIVATIONS:
        raise NotImplementedError(
            f"FusedGateUp activation {activation!r} (supported: "
            f"{', '.join(contract.GATE_ACTIVATIONS)})")
    w = _dense_or_q(weight, scales, zero_points, block_size)
    if isinstance(w, QWeight) and bias is None:  # one kernel with the gate in its epilogue
        fused = w.gated_matmul(x, activation)
        if fused is not None:
            return fused
    y = project(x, w.astype(x.dtype) if isinstance(w, mx.array) else w, bias)
    n = y.shape[-1] // 2
    gate, up = y[..., :n], y[..., n:]
    if activation == "gelu_tanh":
        return nn.gelu_approx(gate) * up
    return gate * mx.sigmoid(gate) * up
