"""MatMul / Gemm and DequantizeLinear: float weights as MLX matmuls, Q4 weights as ONE
`mx.quantized_matmul` each (the planner folds constant blocked DequantizeLinear into a QWeight)."""

from __future__ import annotations

from types import ModuleType

import mlx.core as mx
import numpy as np

from fuselm.passes import ops as contract
from fuselm.runtime_metal.dtypes import like_dtype
from fuselm.runtime_metal.mlx_engine.ops.registry import op
from fuselm.runtime_metal.mlx_engine.qweight import QWeight


def project(x: mx.array, w, bias=None) -> mx.array:  # noqa: ANN001
    """x @ w (+ bias) for a float or Q4 weight."""
    y = w.matmul(x) if isinstance(w, QWeight) else x @ w
    return y if bias is None else y + bias


@op("", "MatMul", since=13, qweight=True)
def matmul(xp: ModuleType, a, b):  # noqa: ANN001, ANN201
    if isinstance(a, QWeight):
        a = a.dense()
    return project(a, b)


@op("", "Gemm", since=13, qweight=True)
def gemm(xp: ModuleType, a, b, c=None, *, alpha: float = 1.0, beta: float = 1.0,  # noqa: ANN001, ANN201
         transA: int = 0, transB: int = 0):  # noqa: N803 - ONNX attribute names
    if isinstance(a, QWeight):
        a = a.dense()
    a = a.T if transA else a
    if isinstance(b, QWeight):
        b = b.T() if transB else b
    else:
        b = b.T if transB else b
    y = project(a, b)
    if alpha != 1.0:
        y = y * alpha
    if c is not None:
        y = y + (c * beta if beta != 1.0 else c)
    return y


@op("", "DequantizeLinear", since=21)
def dequantize_linear(xp: ModuleType, x, scale, zero_point=None, *, axis: int = 1,  # noqa: ANN001, ANN201
                      block_size: int = 0, output_dtype: int = 0):
    """The general form, for what the planner could not fold into a QWeight (computed densely)."""
    xi = x.astype(mx.int32)
    s, z = scale, zero_point
    if block_size and s.ndim:
        ax = axis % x.ndim
        s = mx.repeat(s, block_size, axis=ax)
        z = None if z is None else mx.repeat(z, block_size, axis=ax)
        cut = [slice(None)] * x.ndim
        cut[ax] = slice(0, x.shape[ax])
        s = s[tuple(cut)]
        z = None if z is None else z[tuple(cut)]
    elif s.ndim == 1 and x.ndim > 1:  # per-axis
        shape = [1] * x.ndim
        shape[axis % x.ndim] = -1
        s = s.reshape(shape)
        z = None if z is None else z.reshape(shape)
    q = xi if z is None else xi - z.astype(mx.int32)
    return (q.astype(mx.float32) * s.astype(mx.float32)).astype(like_dtype(mx, scale))




@op("fuselm", "DequantizeAffine")
def dequantize_affine(xp: ModuleType, x, scale, bias, *, axis: int, block_size: int):  # noqa: ANN001, ANN201
    """w = codes * scale + bias per block (passes/ops.py), computed densely in float32, for
    what the planner could not fold into a QWeight (gathered rows of a table)."""
    ax = axis % x.ndim
    n = x.shape[ax]
    cut = [slice(None)] * x.ndim
    cut[ax] = slice(0, n)
    s = mx.repeat(scale.astype(mx.float32), block_size, axis=ax)[tuple(cut)]
    b = mx.repeat(bias.astype(mx.float32), block_size, axis=ax)[tuple(cut)]
    return (x.astype(mx.float32) * s + b).astype(like_dtype(mx, scale))


@op("fuselm", "UnpackUInt6")
def unpack_uint6(xp: ModuleType, packed):  # noqa: ANN001, ANN201
    """6-bit codes to one uint8 a code (passes/ops.py): folded once at load, where the planner
    packs them again as a 6-bit QWeight; computed on the host (a constant's bytes)."""
    return contract.unpack_uint6_reference(np.asarray(packed))
