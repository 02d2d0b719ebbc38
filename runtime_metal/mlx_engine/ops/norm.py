"""RMSNormalization -> mx.fast.rms_norm (seed step 6); LayerNormalization -> mx.fast.layer_norm."""

from __future__ import annotations

from types import ModuleType

import mlx.core as mx

from fuselm.runtime_metal.mlx_engine.ops.registry import op


def _flatten_trailing(x: mx.array, axis: int) -> tuple[mx.array, tuple[int, ...]]:
    axis = axis % x.ndim
    return x.reshape(*x.shape[:axis], -1), tuple(x.shape)


@op("", "RMSNormalization", since=23)
def rms_normalization(xp: ModuleType, x, scale, *, axis: int = -1,  # noqa: ANN001, ANN201
                      epsilon: float = 1e-5):
    if axis % x.ndim == x.ndim - 1 and scale.ndim <= 1:
        return mx.fast.rms_norm(x, scale.reshape(-1) if scale.size == x.shape[-1] else
                                mx.broadcast_to(scale.reshape(-1), (x.shape[-1],)), epsilon)
    # Normalizing over several trailing axes: one rms_norm over them flattened, then the scale.
    flat, shape = _flatten_trailing(x, axis)
    return mx.fast.rms_norm(flat, None, epsilon).reshape(shape) * scale


@op("", "LayerNormalization", since=17)
def layer_normalization(xp: ModuleType, x, scale, bias=None, *, axis: int = -1,  # noqa: ANN001, ANN201
                        epsilon: float = 1e-5):
    if axis % x.ndim == x.ndim - 1 and scale.ndim <= 1:
        return mx.fast.layer_norm(x, scale, bias, epsilon)
    flat, shape = _flatten_trailing(x, axis)
    y = mx.fast.layer_norm(flat, None, None, epsilon).reshape(shape) * scale
    return y if bias is None else y + bias
