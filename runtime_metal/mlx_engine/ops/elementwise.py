"""Elementwise, comparison, logic, cast and reduction ops (NumPy-compatible, so host-capable)."""

from __future__ import annotations

import functools
import math
from types import ModuleType

import mlx.core as mx
import numpy as np

from fuselm.runtime_metal.dtypes import like_dtype, onnx_dtype
from fuselm.runtime_metal.mlx_engine.ops.registry import op
from fuselm.runtime_metal.mlx_engine.qweight import QWeight


def _binary(op_type: str, fn) -> None:  # noqa: ANN001
    op("", op_type, host=True)(lambda xp, a, b: fn(xp, a, b))


def _int_div(xp: ModuleType, a, b):  # noqa: ANN001, ANN202
    # ONNX integer Div truncates toward zero (C semantics), unlike floor division.
    q = xp.abs(a) // xp.abs(b)
    return xp.where((a < 0) != (b < 0), -q, q).astype(like_dtype(xp, a))


def _div(xp: ModuleType, a, b):  # noqa: ANN001, ANN202
    kind = np.dtype(like_dtype(np, a)).kind
    return _int_div(xp, a, b) if kind in "iu" else a / b


_binary("Add", lambda xp, a, b: a + b)
_binary("Sub", lambda xp, a, b: a - b)
_binary("Mul", lambda xp, a, b: a * b)
_binary("Div", _div)
_binary("Pow", lambda xp, a, b: xp.power(a, b.astype(like_dtype(xp, a))))
_binary("Equal", lambda xp, a, b: a == b)
_binary("Less", lambda xp, a, b: a < b)
_binary("LessOrEqual", lambda xp, a, b: a <= b)
_binary("Greater", lambda xp, a, b: a > b)
_binary("GreaterOrEqual", lambda xp, a, b: a >= b)
_binary("And", lambda xp, a, b: xp.logical_and(a, b))
_binary("Or", lambda xp, a, b: xp.logical_or(a, b))
_binary("Xor", lambda xp, a, b: xp.logical_xor(a, b) if xp is np else a != b)


def _unary(op_type: str, fn, host: bool = True) -> None:  # noqa: ANN001
    op("", op_type, host=host)(lambda xp, x: fn(xp, x))


_unary("Neg", lambda xp, x: -x)
_unary("Abs", lambda xp, x: xp.abs(x))
_unary("Not", lambda xp, x: xp.logical_not(x))
_unary("Sqrt", lambda xp, x: xp.sqrt(x))
_unary("Reciprocal", lambda xp, x: xp.reciprocal(x))
_unary("Exp", lambda xp, x: xp.exp(x))
_unary("Log", lambda xp, x: xp.log(x))
_unary("Cos", lambda xp, x: xp.cos(x))
_unary("Sin", lambda xp, x: xp.sin(x))
_unary("Tanh", lambda xp, x: xp.tanh(x))
_unary("Floor", lambda xp, x: xp.floor(x))
_unary("Ceil", lambda xp, x: xp.ceil(x))
_unary("Relu", lambda xp, x: xp.maximum(x, xp.zeros((), like_dtype(xp, x))))
_unary("Sigmoid", lambda xp, x: mx.sigmoid(x), host=False)
_unary("Erf", lambda xp, x: mx.erf(x), host=False)


@op("", "Gelu", since=20)
def gelu(xp: ModuleType, x, *, approximate: str = "none"):  # noqa: ANN001, ANN201
    """ONNX Gelu: exact (erf) or approximate="tanh" (Gemma's GeGLU gate in a plain graph, where
    the Gate/Up pairing that folds it into FusedGateUp did not run)."""
    if approximate == "tanh":
        return 0.5 * x * (1 + mx.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    if approximate != "none":
        raise ValueError(f"Gelu approximate={approximate!r} (ONNX: 'none' or 'tanh')")
    return 0.5 * x * (1 + mx.erf(x * (1 / math.sqrt(2))))


@op("", "Softmax", since=13)
def softmax(xp: ModuleType, x, *, axis: int = -1):  # noqa: ANN001, ANN201
    return mx.softmax(x, axis=axis, precise=True)


@op("", "Where", host=True)
def where(xp: ModuleType, cond, a, b):  # noqa: ANN001, ANN201
    return xp.where(cond, a, b)


@op("", "Max", host=True)
def maximum(xp: ModuleType, *xs):  # noqa: ANN001, ANN201
    return functools.reduce(xp.maximum, xs)


@op("", "Min", host=True)
def minimum(xp: ModuleType, *xs):  # noqa: ANN001, ANN201
    return functools.reduce(xp.minimum, xs)


@op("", "Cast", host=True, qweight=True)
def cast(xp: ModuleType, x, *, to: int):  # noqa: ANN001, ANN201
    if isinstance(x, QWeight):  # DequantizeLinear -> Cast -> MatMul stays one quantized matmul
        return x.astype(onnx_dtype(mx, to))
    return x.astype(onnx_dtype(xp, to))


@op("", "CastLike", host=True, qweight=True)
def cast_like(xp: ModuleType, x, like):  # noqa: ANN001, ANN201
    if isinstance(x, QWeight):
        return x.astype(like_dtype(mx, like))
    return x.astype(like_dtype(xp, like))


def _reduce(op_type: str, name: str) -> None:
    # Opset 18 moved `axes` from an attribute to input 1 (ReduceSum: opset 13); accept both.
    def fn(xp: ModuleType, x, axes_in=None, *, axes=None, keepdims: int = 1,  # noqa: ANN001
           noop_with_empty_axes: int = 0):  # noqa: ANN202
        ax = axes_in if axes_in is not None else axes
        ax = None if ax is None else [int(a) for a in np.asarray(ax).reshape(-1)]
        if not ax:
            if noop_with_empty_axes:
                return x
            ax = list(range(x.ndim))
        return getattr(xp, name)(x, axis=tuple(ax) if xp is np else ax, keepdims=bool(keepdims))

    op("", op_type, host=True, static=(1,))(fn)


for _op_type, _name in (("ReduceMean", "mean"), ("ReduceMax", "max"), ("ReduceMin", "min"),
                        ("ReduceSum", "sum"), ("ReduceProd", "prod")):
    _reduce(_op_type, _name)
