"""A quantized embedding lookup for decode steps (mx.fast.cuda_kernel; QWeight.take_rows inside
qweight.gemv_kernel): the looked-up rows' codes, scales and biases gathered and dequantized in
one launch. MLX's path is three gathers, a dequantize and the Where that turns ONNX's negative
indices around: five launches and a dozen graph nodes a decode step. tests/runtime/
test_kernels.py checks it against that path.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from fuselm.runtime_metal.cuda_kernels import selection as kernels

_TAKE_ROWS = """
  // thread w of row r: the 8 codes of word w of packed row ids[r] -> out[r, 8w .. 8w+7]
  constexpr int KW = K / 8, KG = K / G;
  const int w = blockIdx.x * blockDim.x + threadIdx.x, r = blockIdx.y;
  if (w >= KW) return;
  int i = static_cast<int>(ids[r]);  // int32, or the uint32 an argmax hands over
  if (i < 0) i += V;  // ONNX Gather: a negative index counts from the end
  i = min(max(i, 0), V - 1);  // out of range (the caller checks ids): never read outside
  const uint32_t q = wq[(size_t)i * KW + w];
  const int g = w / (G / 8);
  const float s = static_cast<float>(sc[(size_t)i * KG + g]);
  const float bb = static_cast<float>(bi[(size_t)i * KG + g]);
  #pragma unroll
  for (int e = 0; e < 8; ++e)
    out[(size_t)r * K + w * 8 + e] = O(fmaf(s, static_cast<float>((q >> (4 * e)) & 15u), bb));
"""


@kernels.kernel_factory
def _take_kernel() -> Any:
    return kernels.cuda_kernel(name="fuselm_q4_take_rows", input_names=["ids", "wq", "sc", "bi"],
                               output_names=["out"], source=_TAKE_ROWS)


def take_fits(indices: mx.array, packed: mx.array, scales: mx.array, group_size: int,
              bits: int) -> bool:
    """int32 indices into a 4-bit table [V, K] (rows packed along K, groups along K), or uint32
    ones: the decode step takes the argmax's token as it is (no cast launch a step)."""
    return (bits == 4 and indices.dtype in (mx.int32, mx.uint32) and 0 < indices.size <= 65535
            and packed.ndim == 2 and packed.dtype == mx.uint32 and group_size in (32, 64, 128)
            and (packed.shape[1] * 8) % group_size == 0 and scales.dtype in kernels.DTYPES
            and scales.shape == (packed.shape[0], packed.shape[1] * 8 // group_size))


def q4_take_rows(indices: mx.array, packed: mx.array, scales: mx.array, biases: mx.array,
                 group_size: int, dtype: mx.Dtype) -> mx.array:
    """W[indices] dequantized to `dtype` (affine: scale * code + bias, in float32, rounded
    once), negative indices from the end; the caller checked `take_fits`."""
    k = packed.shape[1] * 8
    words = k // 8
    block = min(256, words)
    (out,) = _take_kernel()(
        inputs=[indices, packed, scales, biases],
        template=[("T", scales.dtype), ("O", dtype), ("K", k), ("G", group_size),
                  ("V", packed.shape[0])],
        grid=(-(-words // block) * block, indices.size, 1), threadgroup=(block, 1, 1),
        output_shapes=[(*indices.shape, k)], output_dtypes=[dtype])
    return out
