"""A Q4 matrix-vector kernel for decode steps (mx.fast.cuda_kernel), for R rows at once (one
token per sequence of a batch: R = the batch), with an optional gated epilogue.

Why not MLX's own quantized matmul: MLX-CUDA picks its vector kernel only for one row
(M = 1 and no batch); an input of R > 1 rows goes to its tiled GEMM, which costs about what a
512-token prefill costs (a batched decode step of 16 rows measured ~14 ms for Qwen3-0.6B on
an H200 against ~3 ms for one row). Here each warp computes one output column for all R rows:
the weight row is read once and dequantized once, each row's input only multiplies it.

* `q4_gemv(x, w)`: x [..., K] with R = x.size / K rows, w a QWeight stored as M [N, K]
  (W = M.T, groups along K): x @ W -> [..., N].
* `q4_gemv(x, w, act)`: the FusedGateUp form: M's first N/2 rows are the gate, the rest the
  up projection; one warp computes both for its column and writes act(gate) * up -> [..., N/2]
  (the separate SwiGLU/GeGLU launch is gone). act: "silu" | "gelu_tanh".

Arithmetic: float32 accumulation (MLX's vector kernel accumulates half-precision inputs in
half precision); each row's sum is formed in the same order whatever R is, so a row's result
does not depend on the batch it runs in (batch-invariance of the server). The results round
to the activation dtype like a matmul output; the gated epilogue rounds gate and up first, as
the plain path's matmul output would be, then act(gate), then the product.

* `q4_gemv_add_norm(x, w, residual, scale, eps)`: the plain form whose epilogue adds the
  residual (h = x @ W + r, the next residual) and whose last block normalizes h:
  y = RMSNorm(h) * scale. The layer's o_proj and down projection run so: the separate
  add+RMSNorm launch after them is gone (the default; program_ops.fold_into_producers).
* `q4_take_rows(ids, table)`: a quantized embedding lookup (QWeight.take_rows inside
  gemv_kernel): the rows' codes, scales and biases gathered and dequantized in one launch.

Eligibility (`fits`) and the plain-MLX fallback are the caller's (qweight.QWeight.matmul,
ops/fused.fused_gate_up); the on/off switches are kernels.py's; tests/runtime/test_kernels.py
checks it against the dequantized weights in float64.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import mlx.core as mx

MAX_ROWS = 16  # a server batch; more rows (a prefill chunk) go to MLX's tiled GEMM
ACTIVATIONS = {"silu": 1, "gelu_tanh": 2}
_DTYPES = (mx.float16, mx.bfloat16, mx.float32)
_WARPS = 8  # outputs per block

_HEADER = """
__device__ __forceinline__ float fl_warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
  return v;
}
// 8 consecutive activations as float32 (16-byte loads for half types; rows are 16-byte
// aligned: K is a multiple of the group size, >= 32)
__device__ __forceinline__ void fl_load8(const float* p, float* o) {
  const float4 a = *reinterpret_cast<const float4*>(p);
  const float4 b = *reinterpret_cast<const float4*>(p + 4);
  o[0] = a.x; o[1] = a.y; o[2] = a.z; o[3] = a.w; o[4] = b.x; o[5] = b.y; o[6] = b.z; o[7] = b.w;
}
__device__ __forceinline__ void fl_load8(const __half* p, float* o) {
  const uint4 u = *reinterpret_cast<const uint4*>(p);
  const __half2* h = reinterpret_cast<const __half2*>(&u);
  for (int i = 0; i < 4; ++i) {
    const float2 f = __half22float2(h[i]);
    o[2 * i] = f.x;
    o[2 * i + 1] = f.y;
  }
}
__device__ __forceinline__ void fl_load8(const __nv_bfloat16* p, float* o) {
  const uint4 u = *reinterpret_cast<const uint4*>(p);
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    o[2 * i] = f.x;
    o[2 * i + 1] = f.y;
  }
}
"""

_GEMV = """
  // warp `warp` of block b computes output column n = b * NW + warp for all R rows.
  // wq: [NR * NO, K / 8] uint32 (8 codes a word, code e at bits 4e), sc/bi: [NR * NO, K / G].
  // Each lane reads 16 bytes of a weight row at a time (32 codes, inside one group: G is a
  // multiple of 32), so a warp has 512 contiguous bytes in flight per row: 4-byte loads left
  // the bandwidth-bound GEMVs (an LM head, an 8B model's layers) at ~1/3 of the H200's.
  constexpr int KQ = K / 32, QPG = G / 32, KG = K / G, NR = EPI ? 2 : 1;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int n = blockIdx.x * NW + warp;
  if (n >= NO) return;
/*PRE*/
  const uint4* wq4 = reinterpret_cast<const uint4*>(wq);  // rows are K / 2 bytes: 16-aligned
  float acc[NR][R];
  #pragma unroll
  for (int j = 0; j < NR; ++j)
    #pragma unroll
    for (int r = 0; r < R; ++r) acc[j][r] = 0.f;
  #pragma unroll 2
  for (int w4 = lane; w4 < KQ; w4 += 32) {
    const int g = w4 / QPG;
    uint4 q4[NR];
    float s[NR], bb[NR];
    #pragma unroll
    for (int j = 0; j < NR; ++j) {
      const size_t row = (size_t)(n + j * NO);
      q4[j] = wq4[row * KQ + w4];
      s[j] = static_cast<float>(sc[row * KG + g]);
      bb[j] = static_cast<float>(bi[row * KG + g]);
    }
    #pragma unroll
    for (int c = 0; c < 4; ++c) {  // the four words, codes 8c .. 8c+7 of the 32
      float f[NR][8];  // the codes as floats: 2^23 + c reinterpreted, minus 2^23 (exact)
      #pragma unroll
      for (int j = 0; j < NR; ++j) {
        const uint32_t q = c == 0 ? q4[j].x : c == 1 ? q4[j].y : c == 2 ? q4[j].z : q4[j].w;
        #pragma unroll
        for (int e = 0; e < 8; ++e)
          f[j][e] = __uint_as_float(0x4B000000u | ((q >> (4 * e)) & 15u)) - 8388608.f;
      }
      #pragma unroll
      for (int r = 0; r < R; ++r) {
        float xv[8];
        fl_load8(x + (size_t)r * K + (size_t)w4 * 32 + c * 8, xv);
        float xs = 0.f;
        #pragma unroll
        for (int e = 0; e < 8; ++e) xs += xv[e];
        #pragma unroll
        for (int j = 0; j < NR; ++j) {
          float d = 0.f;
          #pragma unroll
          for (int e = 0; e < 8; ++e) d = fmaf(xv[e], f[j][e], d);
          acc[j][r] += s[j] * d + bb[j] * xs;  // sum_e x_e (s q_e + b)
        }
      }
    }
  }
  #pragma unroll
  for (int r = 0; r < R; ++r) {
    float v[NR];
    #pragma unroll
    for (int j = 0; j < NR; ++j) v[j] = fl_warp_sum(acc[j][r]);
    if (lane == 0) {
      if (EPI == 0) {
        out[(size_t)r * NO + n] = T(v[0]);
      } else {
        const float gt = static_cast<float>(T(v[0])), up = static_cast<float>(T(v[NR - 1]));
        float a;
        if (EPI == 1) {
          const float sg = static_cast<float>(T(1.f / (1.f + __expf(-gt))));
          a = static_cast<float>(T(gt * sg));
        } else {
          const float c = 0.7978845608028654f * (gt + 0.044715f * gt * gt * gt);
          a = static_cast<float>(T(0.5f * gt * (1.f + tanhf(c))));
        }
        out[(size_t)r * NO + n] = T(a * up);
      }
    }
  }
"""


# The add+RMSNorm in the epilogue (kernels.fold_norm_mode() "epilogue", the default):
# the GEMV producing x (a layer's o_proj or down projection) writes h = x + r, the next
# residual, rounded as the separate Add rounds it, and its block's share of each row's sum of
# squares (its NW columns, in warp order); the LAST block to finish (a ticket) sums the blocks'
# shares and normalizes the rows: y = RMSNorm(h) * nw. One launch instead of two, no block
# repeats the norm, and the tail is one L2 round trip (h and the shares read at once, every
# warp summing the shares itself, no barrier): the first form, which re-read h for the sum of
# squares and reduced it across the block like the separate kernel, measured ~5 µs of tail on
# the H200, as long as the separate launch. The order of sums differs from add_rms_norm's (a
# few units in the last place of y); it is fixed per row, so a row's result does not depend on
# its batch or on which block came last. NO % NW == 0: no warp leaves early, so every thread of
# the last block reaches the tail's barriers.
_PLAIN_WRITE = "        out[(size_t)r * NO + n] = T(v[0]);"
_ADD_WRITE = """        const T hv = T(static_cast<float>(T(v[0])) + rrv[r]);
        h[(size_t)r * NO + n] = hv;
        hsq[r][warp] = static_cast<float>(hv) * static_cast<float>(hv);"""
_ADD_NORM_TICKET = """
// zero when the module loads; the last block of every call sets it back to zero (launches on
// one stream never overlap; two streams decoding at once in one process are not supported)
__device__ unsigned int fuselm_addnorm_ticket = 0u;
"""
_ADD_NORM_HEAD = "  T* out = h;  // only named in the gated branch, dead at EPI = 0\n" \
    "  __shared__ float hsq[R][NW];\n"
# the residual's values, loaded with the weights rather than after the sums (a round trip)
_ADD_NORM_PRE = """  float rrv[R];
  #pragma unroll
  for (int r = 0; r < R; ++r)
    rrv[r] = lane == 0 ? static_cast<float>(rr[(size_t)r * NO + n]) : 0.f;"""
_ADD_NORM_TAIL = """
  constexpr int NB = NO / NW, NT = NW * 32, PT = (NO + NT - 1) / NT;
  __shared__ unsigned int ticket;
  __syncthreads();  // hsq is whole
  if (threadIdx.x < R) {  // this block's share of row r's sum of squares, in warp order
    float p = 0.f;
    for (int w = 0; w < NW; ++w) p += hsq[threadIdx.x][w];
    part[(size_t)threadIdx.x * NB + blockIdx.x] = p;
  }
  __threadfence();  // this block's h and share visible device-wide before its ticket
  __syncthreads();
  if (threadIdx.x == 0) ticket = atomicAdd(&fuselm_addnorm_ticket, 1u);
  __syncthreads();
  if (ticket != gridDim.x - 1) return;
  __threadfence();
  const float e0 = eps[0];
  float wv[PT];  // the norm's scale, loaded with h and the shares
  #pragma unroll
  for (int t = 0; t < PT; ++t) {
    const int i = threadIdx.x + t * NT;
    wv[t] = i < NO ? static_cast<float>(nw[i]) : 0.f;
  }
  #pragma unroll 1
  for (int r = 0; r < R; ++r) {  // read through L2: other blocks wrote h and the shares
    const size_t base = (size_t)r * NO;
    float hv[PT];
    #pragma unroll
    for (int t = 0; t < PT; ++t) {
      const int i = threadIdx.x + t * NT;
      hv[t] = i < NO ? static_cast<float>(__ldcg(h + base + i)) : 0.f;
    }
    float ss = 0.f;  // every warp sums all the shares in the same order: no barrier needed
    for (int i = lane; i < NB; i += 32) ss += __ldcg(part + (size_t)r * NB + i);
    ss = fl_warp_sum(ss);
    const float rs = rsqrtf(ss / NO + e0);
    #pragma unroll
    for (int t = 0; t < PT; ++t) {
      const int i = threadIdx.x + t * NT;
      if (i < NO) y[base + i] = T(hv[t] * rs * wv[t]);
    }
  }
  if (threadIdx.x == 0) fuselm_addnorm_ticket = 0u;
"""

@cache
def _kernel() -> Any:
    return mx.fast.cuda_kernel(name="fuselm_q4_gemv", input_names=["x", "wq", "sc", "bi"],
                               output_names=["out"], header=_HEADER,
                               source=_GEMV.replace("/*PRE*/", ""))


@cache
def _add_norm_kernel() -> Any:
    assert _PLAIN_WRITE in _GEMV
    source = _ADD_NORM_HEAD + _GEMV.replace(_PLAIN_WRITE, _ADD_WRITE).replace(
        "/*PRE*/", _ADD_NORM_PRE) + _ADD_NORM_TAIL
    return mx.fast.cuda_kernel(
        name="fuselm_q4_gemv_addnorm", input_names=["x", "wq", "sc", "bi", "rr", "nw", "eps"],
        output_names=["h", "y", "part"], header=_HEADER + _ADD_NORM_TICKET, source=source)


def fits(x: mx.array, packed: mx.array, scales: mx.array, group_size: int, bits: int,
         transposed: bool, act: str | None = None) -> bool:
    """x [..., K] of at most MAX_ROWS rows against a 4-bit M [N, K] grouped along K (W = M.T),
    scales/biases of x's dtype; for a gated epilogue, an even N."""
    if not (transposed and bits == 4 and x.dtype in _DTYPES and x.ndim >= 1):
        return False
    k = x.shape[-1]
    rows = x.size // k if k else 0
    n = packed.shape[0]
    return (0 < rows <= MAX_ROWS and packed.ndim == 2 and packed.dtype == mx.uint32
            and packed.shape[1] * 8 == k and group_size in (32, 64, 128) and k % group_size == 0
            and scales.shape == (n, k // group_size) and scales.dtype == x.dtype
            and (act is None or (act in ACTIVATIONS and n % 2 == 0)))


def q4_gemv(x: mx.array, packed: mx.array, scales: mx.array, biases: mx.array,
            group_size: int, act: str | None = None) -> mx.array:
    """See the module doc; the caller checked `fits`."""
    k = x.shape[-1]
    n_out = packed.shape[0] // (2 if act else 1)
    blocks = -(-n_out // _WARPS)
    (out,) = _kernel()(
        inputs=[x, packed, scales, biases],
        template=[("T", x.dtype), ("K", k), ("G", group_size), ("NO", n_out), ("R", x.size // k),
                  ("EPI", ACTIVATIONS[act] if act else 0), ("NW", _WARPS)],
        grid=(blocks * _WARPS * 32, 1, 1), threadgroup=(_WARPS * 32, 1, 1),
        output_shapes=[(*x.shape[:-1], n_out)], output_dtypes=[x.dtype])
    return out


def add_norm_fits(x: mx.array, packed: mx.array, residual: object, scale: object) -> bool:
    """The epilogue form's own conditions, beyond `fits` (the caller's): whole blocks of
    outputs, a residual of the output's shape and dtype, a 1-D scale of its width."""
    n = packed.shape[0]
    return (n % _WARPS == 0 and isinstance(residual, mx.array) and isinstance(scale, mx.array)
            and residual.shape == (*x.shape[:-1], n) and residual.dtype == x.dtype
            and scale.shape == (n,))


def q4_gemv_add_norm(x: mx.array, packed: mx.array, scales: mx.array, biases: mx.array,
                     group_size: int, residual: mx.array, scale: mx.array, eps: mx.array
                     ) -> tuple[mx.array, mx.array]:
    """(h, y): h = x @ W + residual, y = RMSNorm(h) * scale (eps: float32 [1]), in one launch;
    the caller checked `fits` and `add_norm_fits`."""
    k = x.shape[-1]
    n_out = packed.shape[0]
    shape, rows = (*x.shape[:-1], n_out), x.size // k
    h, y, _ = _add_norm_kernel()(
        inputs=[x, packed, scales, biases, residual, scale, eps],
        template=[("T", x.dtype), ("K", k), ("G", group_size), ("NO", n_out),
                  ("R", rows), ("EPI", 0), ("NW", _WARPS)],
        grid=(n_out * 32, 1, 1), threadgroup=(_WARPS * 32, 1, 1),
        output_shapes=[shape, shape, (rows, n_out // _WARPS)],
        output_dtypes=[x.dtype, x.dtype, mx.float32])
    return h, y


# ---- a quantized embedding lookup: the looked-up rows' codes, scales and biases gathered and
# dequantized in one launch (MLX's path: three gathers, a dequantize, and the Where that turns
# ONNX's negative indices around: five launches and a dozen graph nodes a decode step)
_TAKE_ROWS = """
  // thread w of row r: the 8 codes of word w of packed row ids[r] -> out[r, 8w .. 8w+7]
  constexpr int KW = K / 8, KG = K / G;
  const int w = blockIdx.x * blockDim.x + threadIdx.x, r = blockIdx.y;
  if (w >= KW) return;
  int i = ids[r];
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


@cache
def _take_kernel() -> Any:
    return mx.fast.cuda_kernel(name="fuselm_q4_take_rows", input_names=["ids", "wq", "sc", "bi"],
                               output_names=["out"], source=_TAKE_ROWS)


def take_fits(indices: mx.array, packed: mx.array, scales: mx.array, group_size: int,
              bits: int) -> bool:
    """int32 indices into a 4-bit table [V, K] (rows packed along K, groups along K)."""
    return (bits == 4 and indices.dtype == mx.int32 and 0 < indices.size <= 65535
            and packed.ndim == 2 and packed.dtype == mx.uint32 and group_size in (32, 64, 128)
            and (packed.shape[1] * 8) % group_size == 0 and scales.dtype in _DTYPES
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
