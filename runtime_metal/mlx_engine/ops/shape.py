"""Shape and data-movement ops. Shape-valued inputs are `static` (host ints), so building a shape
never sends a tensor to the device or waits for it."""

from __future__ import annotations

from types import ModuleType

import mlx.core as mx
import numpy as np

from fuselm.runtime_metal.dtypes import onnx_dtype
from fuselm.runtime_metal.mlx_engine.ops.registry import op
from fuselm.runtime_metal.mlx_engine.qweight import QWeight


def _ints(v) -> list[int]:  # noqa: ANN001
    return [int(i) for i in np.asarray(v).reshape(-1)]


@op("", "Identity", host=True, qweight=True)
def identity(xp: ModuleType, x):  # noqa: ANN001, ANN201
    return x


@op("", "Shape", host=True)
def shape(xp: ModuleType, x, *, start: int = 0, end: int | None = None):  # noqa: ANN001, ANN201
    # Shapes are known without evaluating x: the result is always a host value.
    dims = list(x.shape)
    return np.array(dims[start:end] if end is not None else dims[start:], dtype=np.int64)


@op("", "Size", host=True)
def size(xp: ModuleType, x):  # noqa: ANN001, ANN201
    return np.array(int(np.prod(x.shape)), dtype=np.int64)


@op("", "Reshape", since=5, host=True, static=(1,))
def reshape(xp: ModuleType, x, shape, *, allowzero: int = 0):  # noqa: ANN001, ANN201
    dims = _ints(shape)
    if not allowzero:
        dims = [x.shape[i] if d == 0 else d for i, d in enumerate(dims)]
    return x.reshape(dims)


@op("", "Flatten", host=True)
def flatten(xp: ModuleType, x, *, axis: int = 1):  # noqa: ANN001, ANN201
    axis = axis % x.ndim if x.ndim else 0
    lead = int(np.prod(x.shape[:axis]))
    return x.reshape(lead, -1) if x.size else x.reshape(lead, int(np.prod(x.shape[axis:])))


@op("", "Transpose", host=True, qweight=True)
def transpose(xp: ModuleType, x, *, perm: list[int] | None = None):  # noqa: ANN001, ANN201
    if isinstance(x, QWeight):  # MatMul(h, Transpose(embed)): flip the layout flag, no copy
        if perm not in (None, [1, 0]):
            return transpose(mx, x.dense(), perm=perm)
        return x.T()
    perm = list(range(x.ndim))[::-1] if perm is None else list(perm)
    return xp.transpose(x, perm)


def _norm_axes(axes: list[int], rank: int) -> list[int]:
    return sorted(a % rank for a in axes)


@op("", "Unsqueeze", since=13, host=True, static=(1,))
def unsqueeze(xp: ModuleType, x, axes):  # noqa: ANN001, ANN201
    rank = x.ndim + len(_ints(axes))
    out = x
    for a in _norm_axes(_ints(axes), rank):
        out = xp.expand_dims(out, a)
    return out


@op("", "Squeeze", since=13, host=True, static=(1,))
def squeeze(xp: ModuleType, x, axes=None):  # noqa: ANN001, ANN201
    if axes is None:
        return xp.squeeze(x)
    return xp.squeeze(x, axis=tuple(_norm_axes(_ints(axes), x.ndim)))


@op("", "Concat", host=True)
def concat(xp: ModuleType, *xs, axis: int):  # noqa: ANN001, ANN201
    return xp.concatenate(list(xs), axis=axis)


@op("", "Split", since=13, host=True, static=(1,))
def split(xp: ModuleType, x, sizes=None, *, axis: int = 0,  # noqa: ANN001, ANN201
          num_outputs: int | None = None, n_outputs: int = 0):
    dim = x.shape[axis]
    if sizes is not None:
        parts = _ints(sizes)
    else:
        n = num_outputs or n_outputs
        chunk = -(-dim // n)  # the last chunk is smaller when dim % n != 0 (opset 18)
        parts = [chunk] * (n - 1) + [dim - chunk * (n - 1)]
    cuts = list(np.cumsum(parts)[:-1])
    return tuple(xp.split(x, cuts, axis=axis))


@op("", "Slice", since=10, host=True, static=(1, 2, 3, 4))
def slice_(xp: ModuleType, x, starts, ends, axes=None, steps=None):  # noqa: ANN001, ANN201
    st, en = _ints(starts), _ints(ends)
    ax = _ints(axes) if axes is not None else list(range(len(st)))
    sp = _ints(steps) if steps is not None else [1] * len(st)
    index = [slice(None)] * x.ndim
    for s, e, a, p in zip(st, en, ax, sp, strict=True):
        dim = x.shape[a]
        # Clamp as ONNX does; Python slices would misread e.g. INT64_MIN with a negative step.
        s = s + dim if s < 0 else s
        e = e + dim if e < 0 else e
        if p > 0:
            s, e = min(max(s, 0), dim), min(max(e, 0), dim)
        else:
            s, e = min(max(s, -1), dim - 1), min(max(e, -1), dim - 1)
        index[a] = slice(s, None if (p < 0 and e < 0) else e, p)
    return x[tuple(index)]


@op("", "Gather", since=13, host=True, qweight=True)
def gather(xp: ModuleType, data, indices, *, axis: int = 0):  # noqa: ANN001, ANN201
    if isinstance(data, QWeight):  # quantized embedding: dequantize only the rows looked up
        if axis == 0 and not data.transposed:
            return data.take_rows(indices)
        data = data.dense()
    dim = data.shape[axis]
    indices = xp.where(indices < 0, indices + dim, indices)
    return xp.take(data, indices, axis=axis)


@op("", "Expand", since=8, host=True, static=(1,))
def expand(xp: ModuleType, x, shape):  # noqa: ANN001, ANN201
    return xp.broadcast_to(x, np.broadcast_shapes(tuple(x.shape), tuple(_ints(shape))))


@op("", "Tile", host=True, static=(1,))
def tile(xp: ModuleType, x, repeats):  # noqa: ANN001, ANN201
    return xp.tile(x, _ints(repeats))


@op("", "Range", since=11, host=True, static=(0, 1, 2))
def range_(xp: ModuleType, start, limit, delta):  # noqa: ANN001, ANN201
    s, lim, d = np.asarray(start), np.asarray(limit), np.asarray(delta)
    n = max(int(np.ceil((lim - s) / d)), 0)
    return (s + np.arange(n, dtype=s.dtype) * d).astype(s.dtype)


@op("", "ConstantOfShape", since=9, host=True, static=(0,))
def constant_of_shape(xp: ModuleType, shape, *, value=None):  # noqa: ANN001, ANN201
    fill = np.zeros(1, np.float32) if value is None else np.asarray(value).reshape(-1)
    return np.full(_ints(shape), fill[0], dtype=fill.dtype)


@op("", "Trilu", since=14, host=True, static=(1,))
def trilu(xp: ModuleType, x, k=None, *, upper: int = 1):  # noqa: ANN001, ANN201
    kk = _ints(k)[0] if k is not None else 0
    rows, cols = x.shape[-2], x.shape[-1]
    i = np.arange(rows)[:, None]
    j = np.arange(cols)[None, :]
    keep = (j - i >= kk) if upper else (j - i <= kk)
    keep_x = keep if xp is np else mx.array(keep)
    return xp.where(keep_x, x, xp.zeros((), dtype=x.dtype))


@op("", "CumSum", since=11, host=True, static=(1,))
def cumsum(xp: ModuleType, x, axis, *, exclusive: int = 0, reverse: int = 0):  # noqa: ANN001, ANN201
    a = _ints(axis)[0]
    if xp is mx:
        return mx.cumsum(x, axis=a, reverse=bool(reverse), inclusive=not exclusive)
    y = np.flip(x, a) if reverse else x
    out = np.cumsum(y, axis=a, dtype=x.dtype)
    if exclusive:
        out = out - y
    return np.flip(out, a) if reverse else out


@op("", "EyeLike", host=True)
def eye_like(xp: ModuleType, x, *, dtype: int | None = None, k: int = 0):  # noqa: ANN001, ANN201
    dt = onnx_dtype(np, dtype) if dtype is not None else np.asarray(x).dtype
    return np.eye(x.shape[0], x.shape[1], k=k, dtype=dt)
