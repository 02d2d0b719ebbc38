"""ONNX element types as NumPy and MLX dtypes, and moving values between host and device."""

from __future__ import annotations

from types import ModuleType

import ml_dtypes
import mlx.core as mx
import numpy as np
from onnx import TensorProto

from fuselm.runtime_metal.errors import RuntimeUserError

_NP = {
    TensorProto.FLOAT: np.dtype(np.float32),
    TensorProto.FLOAT16: np.dtype(np.float16),
    TensorProto.BFLOAT16: np.dtype(ml_dtypes.bfloat16),
    TensorProto.DOUBLE: np.dtype(np.float64),
    TensorProto.INT64: np.dtype(np.int64),
    TensorProto.INT32: np.dtype(np.int32),
    TensorProto.INT16: np.dtype(np.int16),
    TensorProto.INT8: np.dtype(np.int8),
    TensorProto.UINT64: np.dtype(np.uint64),
    TensorProto.UINT32: np.dtype(np.uint32),
    TensorProto.UINT16: np.dtype(np.uint16),
    TensorProto.UINT8: np.dtype(np.uint8),
    TensorProto.BOOL: np.dtype(np.bool_),
    TensorProto.UINT4: np.dtype(ml_dtypes.uint4),
    TensorProto.INT4: np.dtype(ml_dtypes.int4),
}
_MX = {
    TensorProto.FLOAT: mx.float32,
    TensorProto.FLOAT16: mx.float16,
    TensorProto.BFLOAT16: mx.bfloat16,
    # MLX has no float64 on the GPU; ONNX doubles (rare in LLM graphs) compute in float32.
    TensorProto.DOUBLE: mx.float32,
    TensorProto.INT64: mx.int64,
    TensorProto.INT32: mx.int32,
    TensorProto.INT16: mx.int16,
    TensorProto.INT8: mx.int8,
    TensorProto.UINT64: mx.uint64,
    TensorProto.UINT32: mx.uint32,
    TensorProto.UINT16: mx.uint16,
    TensorProto.UINT8: mx.uint8,
    TensorProto.BOOL: mx.bool_,
}
FOUR_BIT = (np.dtype(ml_dtypes.uint4), np.dtype(ml_dtypes.int4))  # no MLX element type
_NP_TO_MX = {np.dtype(k): v for k, v in (
    (np.float32, mx.float32), (np.float16, mx.float16), (ml_dtypes.bfloat16, mx.bfloat16),
    (np.float64, mx.float32), (np.int64, mx.int64), (np.int32, mx.int32), (np.int16, mx.int16),
    (np.int8, mx.int8), (np.uint64, mx.uint64), (np.uint32, mx.uint32), (np.uint16, mx.uint16),
    (np.uint8, mx.uint8), (np.bool_, mx.bool_),
)}
_MX_TO_NP = {v: k for k, v in _NP_TO_MX.items() if k != np.dtype(np.float64)}
_HALF = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))


def half(dtype: mx.Dtype = mx.float16) -> mx.Dtype:
    """The MLX dtype 16-bit float values (float16, or bfloat16 given `dtype`) compute in: their
    own, but float32 where MLX runs on the CPU. MLX's CPU backend has no fast 16-bit float
    arithmetic on x86: a float16 Q4 matmul there is ~30x slower than the same in float32
    (BENCHMARKS.md, "MLX on a CPU"), and a float16 graph decoded at 0.1 tokens/s. float32 also
    holds every float16 and bfloat16 value exactly."""
    return mx.float32 if mx.default_device() == mx.cpu else dtype


def onnx_dtype(xp: ModuleType, elem_type: int):  # noqa: ANN201 - np.dtype or mx.Dtype
    table = _NP if xp is np else _MX
    if elem_type not in table:
        name = TensorProto.DataType.Name(elem_type)
        raise RuntimeUserError(f"element type {name} is not supported by fuselm's runtime")
    if xp is not np and elem_type in (TensorProto.FLOAT16, TensorProto.BFLOAT16):
        return half(table[elem_type])
    return table[elem_type]


def like_dtype(xp: ModuleType, like: object):  # noqa: ANN201
    """The dtype of `like` expressed in `xp`'s terms."""
    d = like.dtype  # type: ignore[attr-defined]
    if xp is np:
        return d if isinstance(d, np.dtype) else _MX_TO_NP[d]
    if isinstance(d, np.dtype):
        return half(_NP_TO_MX[d]) if d in _HALF else _NP_TO_MX[d]
    return d


def bfloat16_to_float32(arr: np.ndarray) -> np.ndarray:
    """bfloat16 (ml_dtypes') → float32, exactly: its bits are a float32's upper half (a shift,
    where ml_dtypes' astype converts value by value)."""
    bits = np.ascontiguousarray(arr).view(np.uint16).astype(np.uint32) << 16
    return bits.view(np.float32)


def to_device(value: object) -> object:
    """NumPy -> MLX (other values unchanged). bfloat16 goes through float32 (MLX takes no
    ml_dtypes buffer), and stays float32 where bfloat16 computes in it (`half`)."""
    if isinstance(value, np.ndarray | np.generic):
        arr = np.asarray(value)
        if arr.dtype == ml_dtypes.bfloat16:
            wide = mx.array(bfloat16_to_float32(arr))
            return wide if half(mx.bfloat16) == mx.float32 else wide.astype(mx.bfloat16)
        if arr.dtype == np.float64 or (arr.dtype == np.float16 and half() == mx.float32):
            arr = arr.astype(np.float32)
        elif arr.dtype in FOUR_BIT:
            # MLX has no 4-bit element type; the general DequantizeLinear reads bytes.
            arr = arr.astype(np.uint8 if arr.dtype == np.dtype(ml_dtypes.uint4) else np.int8)
        # Row-major always: MLX keeps a column-major buffer's layout, and some kernels
        # (MLX-CUDA's quantized matmuls) accept row-major operands only.
        return mx.array(np.ascontiguousarray(arr))
    return value


def to_host(value: object) -> np.ndarray:
    """MLX -> NumPy (forces evaluation: used only for small shape-like values and results)."""
    if isinstance(value, mx.array):
        if value.dtype == mx.bfloat16:
            return np.array(value.astype(mx.float32)).astype(ml_dtypes.bfloat16)
        return np.array(value)
    return np.asarray(value)
