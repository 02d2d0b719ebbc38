"""A Q4 (and 8-bit) matrix-vector kernel for decode steps (mx.fast.cuda_kernel), for R rows at
once (one token per sequence of a batch: R = the batch), with an optional gated epilogue.

8-bit weights (MLX's affine form with bits=8: 4 codes a uint32 word, code e at bits 8e) run
the same kernels with the template constant BITS = 8: a lane's 16-byte step then holds 16
codes instead of 32; everything else (groups, scales, biases, the order of the sums, the
epilogues) is the same. BITS comes from the packed width (K / 8 or K / 4 words a row).

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
  add+RMSNorm launch after them is gone (program_ops.fold_into_producers). eps is a Python
  float, compiled into the kernel as a template constant rather than passed as an array.
  h and y are ONE output array hy [2, ...] (h, then y: one output's MLX host cost, not two);
  the GEMVs reading them take hy and their element offset in it (template constants XO for
  x, RO for the residual), so the views h and y (`halves`) need never be evaluated
  (qweight.QWeight.matmul_add_norm registers them, the consumers look them up).
* The tensor-core form (`mma`, FUSELM_GEMV_MMA: from 2 rows of float16 / bfloat16 by default):
  the same three forms and results up to rounding, a block computing a tile of output columns
  for all rows with mma.sync (see _MMA_HEADER's comment for why and how); a row's result does
  not depend on the other rows of its batch from 2 rows to 16, but differs from the one-row
  kernel's in rounding.
Eligibility (`fits`) and the plain-MLX fallback are the caller's (qweight.QWeight.matmul,
ops/fused.fused_gate_up); the on/off switches are selection.py's; tests/runtime/test_kernels.py
checks it against the dequantized weights in float64.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from fuselm.runtime_metal.cuda_kernels import selection as kernels

MAX_ROWS = 16  # a server batch; more rows (a prefill chunk) go to MLX's tiled GEMM
ACTIVATIONS = {"silu": 1, "gelu_tanh": 2}
_WARPS = 8  # outputs per block

_HEADER = """
__device__ __forceinline__ float fl_warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
  return v;
}
// p + O (elements): an input read at a template-constant offset into its array (the add+norm's
// one output hy holds h, then y). A nonzero offset goes through an opaque register move: with
// the constant folded into every load's address, ptxas held the 16-row gated GEMV in ~2x the
// registers (127 -> 243, float32 spilling; what a separate pointer argument compiled to).
template <int O, typename T>
__device__ __forceinline__ const T* fl_at(const T* p) {
  p += O;
  if (O != 0) asm("mov.b64 %0, %0;" : "+l"(p));
  return p;
}
// 8 consecutive activations as float32 (16-byte loads; rows are 16-byte aligned: K is a
// multiple of the group size, >= 32)
__device__ __forceinline__ void fl_load8(const float* p, float* o) {
  const uint4 a = *reinterpret_cast<const uint4*>(p), b = *reinterpret_cast<const uint4*>(p + 4);
  o[0] = __uint_as_float(a.x); o[1] = __uint_as_float(a.y);
  o[2] = __uint_as_float(a.z); o[3] = __uint_as_float(a.w);
  o[4] = __uint_as_float(b.x); o[5] = __uint_as_float(b.y);
  o[6] = __uint_as_float(b.z); o[7] = __uint_as_float(b.w);
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

// The GEMV's main loop, one warp: v[j][r] = sum_k x[r, k] W[k, n + j NO] over the NR weight
// rows of output column n (NR = 2: the gated form's gate and up halves), for R rows of x,
// summed across the warp (every lane holds the sums).
// wq: [NR * NO, K * BITS / 32] uint32 (32 / BITS codes a word, code e at bits BITS * e),
// sc/bi: [NR * NO, K / G]. Each lane reads 16 bytes of a weight row at a time (CPS = 128 / BITS
// codes: 32 at 4 bits, 16 at 8, inside one group: G is a multiple of 32), so a warp has 512
// contiguous bytes in flight per row: 4-byte loads left the bandwidth-bound GEMVs (an LM head,
// an 8B model's layers) at ~1/3 of the H200's.
template <typename T, int K, int G, int NO, int R, int NR, int BITS>
__device__ __forceinline__ void fl_q4_dots(const T* x, const uint32_t* wq, const T* sc,
                                           const T* bi, int n, int lane, float (&v)[NR][R]) {
  constexpr int CPS = 128 / BITS, KQ = K / CPS, QPG = G / CPS, KG = K / G;
  const uint4* wq4 = reinterpret_cast<const uint4*>(wq);  // rows: K * BITS / 8 bytes, 16-aligned
  float acc[NR][R];
  #pragma unroll
  for (int j = 0; j < NR; ++j)
    #pragma unroll
    for (int r = 0; r < R; ++r) acc[j][r] = 0.f;
  // A lane's weight words, scales and biases for B of its 16-byte steps are loaded before any
  // is used, so B loads a lane are in flight at once: every step of the row when it takes at
  // most FL_UNROLL_MAX (kernels.Q4_UNROLL), else two at a time. The sums run in step order
  // whatever B is, so the result does not depend on it.
  constexpr int STEPS = (KQ + 31) / 32, B = STEPS <= FL_UNROLL_MAX ? STEPS : 2;
  for (int s0 = 0; s0 < STEPS; s0 += B) {
    uint4 q4[B][NR];
    float s[B][NR], bb[B][NR];
    #pragma unroll
    for (int u = 0; u < B; ++u) {
      const int w4 = lane + 32 * (s0 + u), g = w4 / QPG;
      #pragma unroll
      for (int j = 0; j < NR; ++j) {
        if (w4 < KQ) {
          const size_t row = (size_t)(n + j * NO);
          q4[u][j] = wq4[row * KQ + w4];
          s[u][j] = static_cast<float>(sc[row * KG + g]);
          bb[u][j] = static_cast<float>(bi[row * KG + g]);
        }
      }
    }
    #pragma unroll
    for (int u = 0; u < B; ++u) {
      const int w4 = lane + 32 * (s0 + u);
      if (w4 >= KQ) continue;
      #pragma unroll
      for (int c = 0; c < CPS / 8; ++c) {  // codes 8c .. 8c+7 of the step's CPS
        float f[NR][8];  // the codes as floats: 2^23 + c reinterpreted, minus 2^23 (exact)
        #pragma unroll
        for (int j = 0; j < NR; ++j) {
          const uint4 w = q4[u][j];
          const uint32_t wd[4] = {w.x, w.y, w.z, w.w};
          #pragma unroll
          for (int e = 0; e < 8; ++e) {
            // 4 bits: word c, nibble e; 8 bits: word 2c + e / 4, byte e % 4
            const uint32_t q = BITS == 4 ? (wd[c] >> (4 * e)) & 15u
                                         : (wd[2 * c + (e >> 2)] >> (8 * (e & 3))) & 255u;
            f[j][e] = __uint_as_float(0x4B000000u | q) - 8388608.f;
          }
        }
        #pragma unroll
        for (int r = 0; r < R; ++r) {
          float xv[8];
          fl_load8(x + (size_t)r * K + (size_t)w4 * CPS + c * 8, xv);
          float xs = 0.f;
          #pragma unroll
          for (int e = 0; e < 8; ++e) xs += xv[e];
          #pragma unroll
          for (int j = 0; j < NR; ++j) {
            float d = 0.f;
            #pragma unroll
            for (int e = 0; e < 8; ++e) d = fmaf(xv[e], f[j][e], d);
            acc[j][r] += s[u][j] * d + bb[u][j] * xs;  // sum_e x_e (s q_e + b)
          }
        }
      }
    }
  }
  #pragma unroll
  for (int r = 0; r < R; ++r)
    #pragma unroll
    for (int j = 0; j < NR; ++j) v[j][r] = fl_warp_sum(acc[j][r]);
}

// Column n's outputs for the R rows (lane 0): x @ W rounded to T (EPI 0), or the gated form
// act(gate) * up (EPI 1: silu, 2: gelu_tanh), gate and up rounded first as the plain path's
// matmul output would be, then act(gate), then the product. Written as O: T, or float for the
// LM head's logits (rounded to T first, then widened: the values of T's result cast to float32,
// without the cast's launch).
template <typename T, typename O>
__device__ __forceinline__ O fl_out(float v) {
  return static_cast<O>(static_cast<float>(T(v)));
}

// One output element from its float32 sums: x @ W (EPI 0: `gate`), or act(gate) * up.
template <typename T, typename O, int EPI>
__device__ __forceinline__ O fl_q4_value(float gate, float up) {
  if (EPI == 0) return fl_out<T, O>(gate);
  const float gt = static_cast<float>(T(gate)), u = static_cast<float>(T(up));
  float a;
  if (EPI == 1) {
    const float sg = static_cast<float>(T(1.f / (1.f + __expf(-gt))));
    a = static_cast<float>(T(gt * sg));
  } else {
    const float c = 0.7978845608028654f * (gt + 0.044715f * gt * gt * gt);
    a = static_cast<float>(T(0.5f * gt * (1.f + tanhf(c))));
  }
  return fl_out<T, O>(a * u);
}

template <typename T, typename O, int NO, int R, int NR, int EPI>
__device__ __forceinline__ void fl_q4_store(O* out, int n, const float (&v)[NR][R]) {
  #pragma unroll
  for (int r = 0; r < R; ++r)
    out[(size_t)r * NO + n] = fl_q4_value<T, O, EPI>(v[0][r], v[NR - 1][r]);
}
"""

_GEMV = """
  // warp `warp` of block b computes output column n = b * NW + warp for all R rows
  constexpr int NR = EPI ? 2 : 1;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int n = blockIdx.x * NW + warp;
  if (n >= NO) return;
  float v[NR][R];
  fl_q4_dots<T, K, G, NO, R, NR, BITS>(fl_at<XO>(x), wq, sc, bi, n, lane, v);
  if (lane == 0) fl_q4_store<T, O, NO, R, NR, EPI>(out, n, v);
"""


# The add+RMSNorm in the epilogue (FUSELM_FOLD_NORM=epilogue, the default): the GEMV
# producing x (a layer's o_proj or down projection) writes h = x + r, the next residual,
# rounded as the separate Add rounds it, and its block's share of each row's sum of squares
# (its NW columns, in warp order); the LAST block to finish (a ticket) sums the blocks' shares
# and normalizes the rows: y = RMSNorm(h) * nw. One launch instead of two, no block repeats
# the norm, and the tail is one L2 round trip (h and the shares read at once, every warp
# summing the shares itself, no barrier): the first form, which re-read h for the sum of
# squares and reduced it across the block like the separate kernel, measured ~5 µs of tail on
# the H200, as long as the separate launch. The order of sums differs from add_rms_norm's (a
# few units in the last place of y); it is fixed per row, so a row's result does not depend on
# its batch or on which block came last. NO % NW == 0: every warp has a column, so every
# thread of the last block reaches the tail's barriers. Returns true in the last block, after
# its y writes; it has set the ticket back to zero (for the next launch).
_ADD_NORM_BLOCK = """
// The add+norm's end, in every block once it has written its h and its share of each row's
// sum of squares (part[r * NB + blk]; NB blocks of NT threads, every thread here): the ticket,
// and in the last block the norm of the NO-wide rows. Returns true in the last block.
template <typename T, int NO, int R, int NB, int NT>
__device__ __forceinline__ bool fl_addnorm_last(unsigned int* tickets, const T* nw, float e0,
                                                const T* h, T* y, const float* part) {
  constexpr int PT = (NO + NT - 1) / NT;
  __shared__ unsigned int ticket;
  const int lane = threadIdx.x & 31;
  __threadfence();  // this block's h and share visible device-wide before its ticket
  __syncthreads();
  if (threadIdx.x == 0) ticket = atomicAdd(tickets, 1u);
  __syncthreads();
  if (ticket != NB - 1) return false;
  __threadfence();
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
  if (threadIdx.x == 0) *tickets = 0u;
  return true;
}

template <typename T, int K, int G, int NO, int R, int NW, int BITS>
__device__ __forceinline__ bool fl_q4_add_norm_block(
    int blk, unsigned int* tickets, const T* x, const uint32_t* wq, const T* sc, const T* bi,
    const T* rr, const T* nw, float e0, T* h, T* y, float* part) {
  constexpr int NB = NO / NW;
  __shared__ float hsq[R][NW];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int n = blk * NW + warp;
  float rrv[R];  // the residual, loaded with the weights rather than after the sums
  #pragma unroll
  for (int r = 0; r < R; ++r)
    rrv[r] = lane == 0 ? static_cast<float>(rr[(size_t)r * NO + n]) : 0.f;
  float v[1][R];
  fl_q4_dots<T, K, G, NO, R, 1, BITS>(x, wq, sc, bi, n, lane, v);
  if (lane == 0) {
    #pragma unroll
    for (int r = 0; r < R; ++r) {
      const T hv = T(static_cast<float>(T(v[0][r])) + rrv[r]);
      h[(size_t)r * NO + n] = hv;
      hsq[r][warp] = static_cast<float>(hv) * static_cast<float>(hv);
    }
  }
  __syncthreads();  // hsq is whole
  if (threadIdx.x < R) {  // this block's share of row r's sum of squares, in warp order
    float p = 0.f;
    for (int w = 0; w < NW; ++w) p += hsq[threadIdx.x][w];
    part[(size_t)threadIdx.x * NB + blk] = p;
  }
  return fl_addnorm_last<T, NO, R, NB, NW * 32>(tickets, nw, e0, h, y, part);
}
"""
# The ticket: zero when the module loads; the last block of every call sets it back to zero
# (launches on one stream never overlap; two streams decoding at once in one process are not
# supported). The blocks' shares of the sums of squares: scratch of the module, not an output
# of the launch: MLX-CUDA's host cost grows ~2 µs with each output array (allocation, graph
# bookkeeping, release), measured by benchmarks/host_launch_bench.py on the H200 host, and a
# decode step is host-bound there (BENCHMARKS.md 'Host cost of a launch on MLX-CUDA').
ADD_NORM_PARTS = 65536  # rows x blocks: MAX_ROWS rows of outputs up to 32,768 wide
_ADD_NORM_GLOBALS = ("__device__ unsigned int fuselm_addnorm_ticket = 0u;\n"
                     f"__device__ float fuselm_addnorm_part[{ADD_NORM_PARTS}];\n")
# One output hy: h at element 0, y after the R rows of h (MLX-CUDA's host cost is per output
# array, as above). x and the residual are read at element offsets XO and RO of their arrays:
# a previous add+norm's hy (its h as this one's residual), the view's Slice never evaluated.
_ADD_NORM = """
  fl_q4_add_norm_block<T, K, G, NO, R, NW, BITS>(blockIdx.x, &fuselm_addnorm_ticket,
                                                 fl_at<XO>(x),
                                           wq, sc, bi, fl_at<RO>(rr), nw, __int_as_float(EPSB),
                                           hy, hy + R * NO, fuselm_addnorm_part);
"""


# ---- the tensor-core form for batched rows (FUSELM_GEMV_MMA) -----------------------------------
# Why: the GEMV above re-reads every row of x for every output column (a warp a column): at 16
# rows a Qwen3-0.6B step issues ~19 GB of activation loads (16 x K x 2 bytes a column, counted)
# against ~0.4 GB of weights, and its GEMVs took 3.2 of 4.3 device ms (5.6x their one-row time;
# computing each dequantized weight once for all rows left that unchanged). Here a block
# computes NC = 8 NJ output columns for all R <= 16 rows with mma.sync m16n8k16: A = the rows
# of x (16, rows >= R zero), B = 8 weight columns dequantized to T (w = s q + b, rounded once),
# float32 accumulators; x is read once per block. The block's NWK warps split K in steps of 4 x CPS
# codes and add their partial tiles in shared memory in warp order.
#
# The k order inside an MMA is free as long as A and B agree: lane (g = lane / 4, t = lane % 4)
# holds the k-slots {2t, 2t+1, 2t+8, 2t+9} of both fragments (A: rows g and g+8; B: column g),
# so it gives them the physical k's of ONE 16-byte weight load: the CPS consecutive codes
# kq * CPS .. (kq + 1) * CPS - 1 of column g (kq = 4 step + t), 4 of them an MMA, and the same
# k's of rows g and g+8 of x (CPS / 8 16-byte loads a row). 8-bit codes: MMA j takes codes
# 4j .. 4j+3 in order (slots 2t, 2t+1 <- 4j, 4j+1; 2t+8, 2t+9 <- 4j+2, 4j+3); 4-bit codes are
# paired as one mask-and-or dequantizes two of them at once (fl_deq2, see fl_mma_dots). Those
# CPS codes lie in one group (G is a multiple of 32 >= CPS): one scale and bias a column a
# step. The weight is dequantized with T arithmetic (s q + b rounded once, as MLX's
# dequantize rounds it), 4 instructions per 2 codes at 4 bits. Every element of the product is a
# sum over k that no other row enters, in an order fixed by K, G, NJ and NWK (which the launch
# picks from the weight's shape alone): a row's result does not depend on the other rows of its
# batch, from 2 rows to 16. It differs from the one-row kernel's in rounding (the weight rounded
# to T, the sums' order).
_MMA_HEADER = """
__device__ __forceinline__ uint32_t fl_pack2(float lo, float hi, const __half*) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}
__device__ __forceinline__ uint32_t fl_pack2(float lo, float hi, const __nv_bfloat16*) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}
// A T value in both halves of a word
template <typename T>
__device__ __forceinline__ uint32_t fl_pair(T v) {
  const uint32_t u = *reinterpret_cast<const unsigned short*>(&v);
  return u | (u << 16);
}
// The 4-bit codes at bits 0-3 and 16-19 of v as the T pair (s q0 + b, s q1 + b), each rounded
// once: the codes go into the mantissas of M + q (M = 1024 for half, 128 for bfloat16: exact),
// M is taken off, then one fused multiply-add (s2, b2: fl_pair's)
__device__ __forceinline__ uint32_t fl_deq2(uint32_t v, uint32_t s2, uint32_t b2, const __half*) {
  const uint32_t m = 0x64006400u, c = (v & 0x000f000fu) | m;
  const __half2 w = __hfma2(__hsub2(*reinterpret_cast<const __half2*>(&c),
                                    *reinterpret_cast<const __half2*>(&m)),
                            *reinterpret_cast<const __half2*>(&s2),
                            *reinterpret_cast<const __half2*>(&b2));
  return *reinterpret_cast<const uint32_t*>(&w);
}
__device__ __forceinline__ uint32_t fl_deq2(uint32_t v, uint32_t s2, uint32_t b2,
                                            const __nv_bfloat16*) {
  const uint32_t m = 0x43004300u, c = (v & 0x000f000fu) | m;
  const __nv_bfloat162 w = __hfma2(__hsub2(*reinterpret_cast<const __nv_bfloat162*>(&c),
                                           *reinterpret_cast<const __nv_bfloat162*>(&m)),
                                   *reinterpret_cast<const __nv_bfloat162*>(&s2),
                                   *reinterpret_cast<const __nv_bfloat162*>(&b2));
  return *reinterpret_cast<const uint32_t*>(&w);
}
// d += A B: A 16 x 16 (a: rows g, g+8 x k-slots 2t, 2t+1; then 2t+8, 2t+9), B 16 x 8 (b0: k-slots
// 2t, 2t+1 of column g; b1: 2t+8, 2t+9), d 16 x 8 float32 (rows g, g+8 x columns 2t, 2t+1)
__device__ __forceinline__ void fl_mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                       uint32_t b1, const __half*) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void fl_mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                       uint32_t b1, const __nv_bfloat16*) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The block's partial tiles: red[(w * 16 + r) * NCR + c] = warp w's sum for row r, tile column
// c (c < NC: the columns n0 .. n0 + NC - 1 of M's first NO rows; c >= NC: of its second NO rows,
// the gated form's up half). The caller syncs the block before reading red.
template <typename T, int K, int G, int NO, int R, int NR, int NJ, int NWK, int BITS>
__device__ __forceinline__ void fl_mma_dots(const T* x, const uint32_t* wq, const T* sc,
                                            const T* bi, int n0, float* red) {
  constexpr int CPS = 128 / BITS, CPW = 32 / BITS, KQ = K / CPS, KG = K / G;
  constexpr int KS = (KQ + 3) / 4, NT = NR * NJ, NCR = 8 * NT;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const uint4* wq4 = reinterpret_cast<const uint4*>(wq);  // rows: K * BITS / 8 bytes, 16-aligned
  const uint4 zero = {0u, 0u, 0u, 0u};
  float acc[NT][4];
  #pragma unroll
  for (int j = 0; j < NT; ++j)
    #pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;
  for (int ks = warp; ks < KS; ks += NWK) {
    const int kq = 4 * ks + t;  // this lane's codes: k = kq * CPS .. kq * CPS + CPS - 1
    const bool on = kq < KQ;
    uint4 wv[NT];
    T sv[NT], bv[NT];
    #pragma unroll
    for (int j = 0; j < NT; ++j) {  // tile j: column n0 + 8 (j % NJ) + g of half j / NJ
      const size_t col = (size_t)((j / NJ) * NO + n0 + 8 * (j % NJ) + g);
      wv[j] = on ? wq4[col * KQ + kq] : zero;
      sv[j] = on ? sc[col * KG + kq * CPS / G] : T(0.f);
      bv[j] = on ? bi[col * KG + kq * CPS / G] : T(0.f);
    }
    uint32_t xa[2][CPS / 2];  // rows g and g + 8: the same CPS k's, two elements a word
    #pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int row = g + 8 * hf;
      const uint4* p = reinterpret_cast<const uint4*>(x + (size_t)row * K + (size_t)kq * CPS);
      #pragma unroll
      for (int i = 0; i < CPS / 8; ++i) {
        const uint4 u = on && row < R ? p[i] : zero;
        xa[hf][4 * i] = u.x;
        xa[hf][4 * i + 1] = u.y;
        xa[hf][4 * i + 2] = u.z;
        xa[hf][4 * i + 3] = u.w;
      }
    }
    if (BITS == 4) {
      // Word i of the lane's 4 holds codes 8i .. 8i+7 (code e at bits 4e); masking bits 4e
      // and 4e + 16 of it (shifted) into a T pair's mantissas gives codes (e, e + 4) at once
      // (fl_codes2), so its two MMAs pair the k's so: MMA 2i slots 2t, 2t+1 <- codes 0, 4 and
      // 2t+8, 2t+9 <- 1, 5; MMA 2i+1: 2, 6 and 3, 7. x's words are paired the same (byte
      // permutes, once for all tiles).
      #pragma unroll
      for (int i = 0; i < 4; ++i) {
        uint32_t a[2][4];  // MMA 2i + u's A: rows g (hf 0) and g + 8 (hf 1)
        #pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const uint32_t x01 = xa[hf][4 * i], x23 = xa[hf][4 * i + 1];
          const uint32_t x45 = xa[hf][4 * i + 2], x67 = xa[hf][4 * i + 3];
          a[0][hf] = __byte_perm(x01, x45, 0x5410);  // elements 0, 4
          a[0][2 + hf] = __byte_perm(x01, x45, 0x7632);  // 1, 5
          a[1][hf] = __byte_perm(x23, x67, 0x5410);  // 2, 6
          a[1][2 + hf] = __byte_perm(x23, x67, 0x7632);  // 3, 7
        }
        #pragma unroll
        for (int j = 0; j < NT; ++j) {
          const uint32_t wd[4] = {wv[j].x, wv[j].y, wv[j].z, wv[j].w};
          const uint32_t s2 = fl_pair(sv[j]), b2 = fl_pair(bv[j]);
          uint32_t w2[4];  // codes (e, e + 4) dequantized
          #pragma unroll
          for (int e = 0; e < 4; ++e) w2[e] = fl_deq2(wd[i] >> (4 * e), s2, b2, x);
          fl_mma(acc[j], a[0], w2[0], w2[1], x);
          fl_mma(acc[j], a[1], w2[2], w2[3], x);
        }
      }
    } else {
      #pragma unroll
      for (int m = 0; m < CPS / 4; ++m) {  // MMA m: codes 4m .. 4m + 3 of the lane's CPS
        const uint32_t a[4] = {xa[0][2 * m], xa[1][2 * m], xa[0][2 * m + 1], xa[1][2 * m + 1]};
        #pragma unroll
        for (int j = 0; j < NT; ++j) {
          const uint32_t wd[4] = {wv[j].x, wv[j].y, wv[j].z, wv[j].w};
          const float s = static_cast<float>(sv[j]), b = static_cast<float>(bv[j]);
          float f[4];  // the codes as floats (2^23 + q reinterpreted, minus 2^23), dequantized
          #pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int c = 4 * m + e;
            const uint32_t q = (wd[c / CPW] >> (BITS * (c % CPW))) & ((1u << BITS) - 1u);
            f[e] = fmaf(__uint_as_float(0x4B000000u | q) - 8388608.f, s, b);
          }
          fl_mma(acc[j], a, fl_pack2(f[0], f[1], x), fl_pack2(f[2], f[3], x), x);
        }
      }
    }
  }
  #pragma unroll
  for (int j = 0; j < NT; ++j) {
    float* o = red + (warp * 16 + g) * NCR + 8 * j + 2 * t;
    o[0] = acc[j][0];
    o[1] = acc[j][1];
    o[8 * NCR] = acc[j][2];  // row g + 8
    o[8 * NCR + 1] = acc[j][3];
  }
}

template <int NWK, int NCR>
__device__ __forceinline__ float fl_mma_sum(const float* red, int r, int c) {
  float v = 0.f;
  #pragma unroll
  for (int w = 0; w < NWK; ++w) v += red[(w * 16 + r) * NCR + c];
  return v;
}
"""

_MMA_GEMV = """
  // block b: output columns n0 = b * NC .. n0 + NC - 1 for the R rows
  constexpr int NR = EPI ? 2 : 1, NC = 8 * NJ, NCR = NR * NC;
  __shared__ float red[NWK * 16 * NCR];
  const int n0 = blockIdx.x * NC;
  fl_mma_dots<T, K, G, NO, R, NR, NJ, NWK, BITS>(fl_at<XO>(x), wq, sc, bi, n0, red);
  __syncthreads();
  for (int i = threadIdx.x; i < R * NC; i += NWK * 32) {
    const int r = i / NC, c = i % NC;
    out[(size_t)r * NO + n0 + c] = fl_q4_value<T, O, EPI>(
        fl_mma_sum<NWK, NCR>(red, r, c), fl_mma_sum<NWK, NCR>(red, r, c + (NR - 1) * NC));
  }
"""

# The add+norm epilogue as in _ADD_NORM_BLOCK: h = x @ W + r rounded as the Add rounds it, the
# block's share of each row's sum of squares (its NC columns in order), the last block norms.
_MMA_ADD_NORM = """
  constexpr int NC = 8 * NJ, NB = NO / NC;
  __shared__ float red[NWK * 16 * NC];
  __shared__ float hsq[R][NC];
  const int blk = blockIdx.x, n0 = blk * NC;
  const T* rr0 = fl_at<RO>(rr);
  T* h = hy;
  fl_mma_dots<T, K, G, NO, R, 1, NJ, NWK, BITS>(fl_at<XO>(x), wq, sc, bi, n0, red);
  __syncthreads();
  for (int i = threadIdx.x; i < R * NC; i += NWK * 32) {
    const int r = i / NC, c = i % NC;
    const size_t at = (size_t)r * NO + n0 + c;
    const T hv = T(static_cast<float>(T(fl_mma_sum<NWK, NC>(red, r, c)))
                   + static_cast<float>(rr0[at]));
    h[at] = hv;
    hsq[r][c] = static_cast<float>(hv) * static_cast<float>(hv);
  }
  __syncthreads();  // hsq is whole
  if (threadIdx.x < R) {
    float p = 0.f;
    for (int c = 0; c < NC; ++c) p += hsq[threadIdx.x][c];
    fuselm_addnorm_part[(size_t)threadIdx.x * NB + blk] = p;
  }
  fl_addnorm_last<T, NO, R, NB, NWK * 32>(&fuselm_addnorm_ticket, nw, __int_as_float(EPSB), h,
                                          hy + R * NO, fuselm_addnorm_part);
"""


def _header(unroll: int) -> str:
    """The shared device code with FL_UNROLL_MAX = unroll (kernels.Q4_UNROLL by default):
    every kernel's header comes from here, so _HEADER needs no default of its own."""
    return f"#define FL_UNROLL_MAX {unroll}\n" + _HEADER


@kernels.kernel_factory
def _kernel(unroll: int) -> Any:
    return kernels.cuda_kernel(name="fuselm_q4_gemv", input_names=["x", "wq", "sc", "bi"],
                               output_names=["out"], header=_header(unroll), source=_GEMV)


@kernels.kernel_factory
def _add_norm_kernel(unroll: int) -> Any:
    return kernels.cuda_kernel(
        name="fuselm_q4_gemv_addnorm", input_names=["x", "wq", "sc", "bi", "rr", "nw"],
        output_names=["hy"], header=_header(unroll) + _ADD_NORM_BLOCK + _ADD_NORM_GLOBALS,
        source=_ADD_NORM)



@kernels.kernel_factory
def _mma_kernel() -> Any:
    return kernels.cuda_kernel(name="fuselm_q4_gemv_mma", input_names=["x", "wq", "sc", "bi"],
                               output_names=["out"],
                               header=_header(kernels.Q4_UNROLL) + _MMA_HEADER,
                               source=_MMA_GEMV)


@kernels.kernel_factory
def _mma_add_norm_kernel() -> Any:
    return kernels.cuda_kernel(
        name="fuselm_q4_gemv_mma_addnorm", input_names=["x", "wq", "sc", "bi", "rr", "nw"],
        output_names=["hy"],
        header=_header(kernels.Q4_UNROLL) + _ADD_NORM_BLOCK + _ADD_NORM_GLOBALS + _MMA_HEADER,
        source=_MMA_ADD_NORM)

def fits(x: mx.array, packed: mx.array, scales: mx.array, group_size: int, bits: int,
         transposed: bool, act: str | None = None) -> bool:
    """x [..., K] of at most MAX_ROWS rows against a 4- or 8-bit M [N, K] grouped along K
    (W = M.T), scales/biases of x's dtype; for a gated epilogue, an even N."""
    if not (transposed and bits in (4, 8) and x.dtype in kernels.DTYPES and x.ndim >= 1):
        return False
    k = x.shape[-1]
    rows = x.size // k if k else 0
    n = packed.shape[0]
    return (0 < rows <= MAX_ROWS and packed.ndim == 2 and packed.dtype == mx.uint32
            and packed.shape[1] * (32 // bits) == k and group_size in (32, 64, 128)
            and k % group_size == 0
            and scales.shape == (n, k // group_size) and scales.dtype == x.dtype
            and (act is None or (act in ACTIVATIONS and n % 2 == 0)))



MMA_DTYPES = (mx.float16, mx.bfloat16)  # the tensor cores' input types
_MMA_MAX_WARPS = 32  # 1,024 threads a block
_MMA_MIN_BLOCKS = 128  # wider tiles only while they leave about a block an SM (132 on an H200)
_MMA_SHARED = 47 * 1024  # static shared memory a block may declare (48 KB), the ticket aside


def mma_fits(x: mx.array, packed: mx.array, act: str | None = None) -> bool:
    """Whether the tensor-core form takes a call that `fits` took: half-precision activations
    and output columns in whole tiles of 8."""
    n_out = packed.shape[0] // (2 if act else 1)
    return x.dtype in MMA_DTYPES and n_out % 8 == 0 and (act is None or packed.shape[0] % 2 == 0)


def _shared_bytes(nj: int, nwk: int, gated: bool) -> int:
    """A block's partial tiles (NWK x 16 rows x 8 NJ columns, twice when gated) and the
    add+norm's squares (16 x 8 NJ), float32."""
    return (nwk * (2 if gated else 1) + 1) * 16 * 8 * nj * 4


def mma_tiles(n_out: int, k: int, bits: int, gated: bool = False) -> tuple[int, int]:
    """(NJ, NWK) of the tensor-core form for an output of n_out columns over K = k: a block
    computes 8 NJ columns (x is read once a block: the widest tile that leaves about a block an
    SM) with NWK warps splitting K's steps of 512 / bits codes, a step each where the block
    holds that many (its loads all in flight at once: the down projection's 24 steps in 24
    warps rather than 3 after one another in 8). From the weight's shape alone, never the
    rows, so a row's result does not depend on its batch."""
    steps = -(-k * bits // 512)
    nj = next((j for j in (4, 2) if n_out % (8 * j) == 0 and n_out // (8 * j) >= _MMA_MIN_BLOCKS),
              1)
    nwk = min(steps, _MMA_MAX_WARPS)
    while _shared_bytes(nj, nwk, gated) > _MMA_SHARED:
        nwk -= 1
    return nj, nwk


def use_mma(x: mx.array, packed: mx.array, act: str | None = None, mma: bool | None = None
            ) -> bool:
    """Whether a call runs the tensor-core form. mma None: from kernels.gemv_mma_rows() rows
    on (FUSELM_GEMV_MMA) where mma_fits; True / False: that form / the one-column-a-warp
    kernel (True where it does not fit: ValueError)."""
    if mma is None:
        least = kernels.gemv_mma_rows()
        return 0 < least <= x.size // x.shape[-1] and mma_fits(x, packed, act)
    if mma and not mma_fits(x, packed, act):
        raise ValueError("the tensor-core Q4 GEMV takes float16 / bfloat16 activations and "
                         "outputs of a multiple of 8 columns")
    return mma


def _checked(tiles: tuple[int, int] | None, act: str | None) -> tuple[int, int] | None:
    """Tiles asked for (a benchmark's) that a block can hold: _shared_bytes in static shared
    memory, at most 32 warps; ValueError otherwise."""
    if tiles is not None:
        nj, nwk = tiles
        if not (nj >= 1 and 1 <= nwk <= _MMA_MAX_WARPS
                and _shared_bytes(nj, nwk, act is not None) <= _MMA_SHARED):
            raise ValueError(f"tensor-core GEMV tiles {nj}x{nwk}: a block holds at most 47 KB "
                             "of partial tiles (NWK x 16 x 8 NJ floats, twice when gated) and "
                             "32 warps")
    return tiles


Source = tuple[mx.array, int]  # (an array the kernel reads, an element offset in it)


def _bits(packed: mx.array, k: int) -> int:
    """Bits a code of a packed [N, K * bits / 32] matrix: 4 or 8 (what `fits` checked)."""
    return 32 * packed.shape[1] // k


def _source(x: mx.array, at: Source | None) -> Source:
    """Where a launch reads x: `at` = (a row-major array holding x's elements from an element
    offset on: the add+norm GEMV's output hy holding its h and y), else x itself at 0. Read out
    of hy so, the lazy view of h or y that x is stays unevaluated: no graph node (MLX's compile
    drops what nothing reads), ~1.7 µs of MLX host time a step less than a Slice each."""
    return (x, 0) if at is None else at


def q4_gemv(x: mx.array, packed: mx.array, scales: mx.array, biases: mx.array,
            group_size: int, act: str | None = None, out_dtype: mx.Dtype | None = None,
            unroll: int | None = None, x_at: Source | None = None, mma: bool | None = None,
            tiles: tuple[int, int] | None = None) -> mx.array:
    """See the module doc; the caller checked `fits`. out_dtype float32: the result rounded
    to x's dtype, then written widened (the LM head's logits: no separate cast launch).
    unroll: loads in flight a lane (kernels.Q4_UNROLL by default); the result is the same.
    x_at: where the kernel reads x (`_source`; x then gives only its shape and dtype): the
    template constant XO is its element offset. mma: the tensor-core form (`use_mma`; None:
    as FUSELM_GEMV_MMA says), tiles its (NJ, NWK) (default `mma_tiles`)."""
    k = x.shape[-1]
    n_out = packed.shape[0] // (2 if act else 1)
    blocks = -(-n_out // _WARPS)
    out_dtype = out_dtype or x.dtype
    xs, xo = _source(x, x_at)
    if use_mma(x, packed, act, mma):
        nj, nwk = _checked(tiles, act) or mma_tiles(n_out, k, _bits(packed, k),
                                                      act is not None)
        (out,) = _mma_kernel()(
            inputs=[xs, packed, scales, biases],
            template=[("T", x.dtype), ("O", out_dtype), ("K", k), ("G", group_size),
                      ("NO", n_out), ("R", x.size // k),
                      ("EPI", ACTIVATIONS[act] if act else 0), ("NJ", nj), ("NWK", nwk),
                      ("XO", xo), ("BITS", _bits(packed, k))],
            grid=(n_out // (8 * nj) * nwk * 32, 1, 1), threadgroup=(nwk * 32, 1, 1),
            output_shapes=[(*x.shape[:-1], n_out)], output_dtypes=[out_dtype])
        return out
    (out,) = _kernel(unroll or kernels.Q4_UNROLL)(
        inputs=[xs, packed, scales, biases],
        template=[("T", x.dtype), ("O", out_dtype), ("K", k), ("G", group_size),
                  ("NO", n_out), ("R", x.size // k), ("EPI", ACTIVATIONS[act] if act else 0),
                  ("NW", _WARPS), ("XO", xo), ("BITS", _bits(packed, k))],
        grid=(blocks * _WARPS * 32, 1, 1), threadgroup=(_WARPS * 32, 1, 1),
        output_shapes=[(*x.shape[:-1], n_out)], output_dtypes=[out_dtype])
    return out


def add_norm_fits(x: mx.array, packed: mx.array, residual: object, scale: object) -> bool:
    """The epilogue form's own conditions, beyond `fits` (the caller's): whole blocks of
    outputs whose shares fit the module's scratch, a residual of the output's shape and
    dtype, a 1-D scale of its width."""
    n = packed.shape[0]
    rows = x.size // x.shape[-1] if x.shape[-1] else 0
    return (n % _WARPS == 0 and rows * (n // _WARPS) <= ADD_NORM_PARTS
            and isinstance(residual, mx.array) and isinstance(scale, mx.array)
            and residual.shape == (*x.shape[:-1], n) and residual.dtype == x.dtype
            and scale.shape == (n,))


def halves(hy: mx.array) -> tuple[mx.array, mx.array]:
    """The add+norm GEMV's h and y as lazy views of its one output hy [2, *shape] (h, then y):
    a Slice and a Reshape each, no copy, and no graph node at all where nothing evaluates them
    (a consumer that reads them out of hy itself, at y_offset)."""
    return hy[0:1].reshape(hy.shape[1:]), hy[1:2].reshape(hy.shape[1:])


def y_offset(hy: mx.array) -> int:
    """y's element offset in hy (rows x N: h comes first)."""
    return hy.size // 2


def q4_gemv_add_norm(x: mx.array, packed: mx.array, scales: mx.array, biases: mx.array,
                     group_size: int, residual: mx.array, scale: mx.array, eps: float,
                     unroll: int | None = None, x_at: Source | None = None,
                     residual_at: Source | None = None, mma: bool | None = None,
                     tiles: tuple[int, int] | None = None) -> mx.array:
    """hy [2, *shape]: hy[0] = h = x @ W + residual, hy[1] = y = RMSNorm(h) * scale, in one
    launch with ONE output array (MLX-CUDA's host cost is ~2.1 µs an output array at every
    launch, and this one runs twice a layer); `halves` gives h and y. The caller checked
    `fits`, `add_norm_fits` and that eps is >= 0 (kernels.takes_float_bits): it is the
    template constant EPSB (kernels.float_bits), not an input array (~0.4 µs of MLX-CUDA host
    time an input, every launch). x_at / residual_at: where the kernel reads x / the residual
    (`_source`; e.g. the previous add+norm's hy for its h), template constants XO / RO.
    mma, tiles: the tensor-core form, as in q4_gemv."""
    k = x.shape[-1]
    n_out = packed.shape[0]
    shape, rows = (*x.shape[:-1], n_out), x.size // k
    (xs, xo), (rs, ro) = _source(x, x_at), _source(residual, residual_at)
    if use_mma(x, packed, None, mma):
        nj, nwk = _checked(tiles, None) or mma_tiles(n_out, k, _bits(packed, k))
        (hy,) = _mma_add_norm_kernel()(
            inputs=[xs, packed, scales, biases, rs, scale],
            template=[("T", x.dtype), ("K", k), ("G", group_size), ("NO", n_out),
                      ("R", rows), ("NJ", nj), ("NWK", nwk), ("EPSB", kernels.float_bits(eps)),
                      ("XO", xo), ("RO", ro), ("BITS", _bits(packed, k))],
            grid=(n_out // (8 * nj) * nwk * 32, 1, 1), threadgroup=(nwk * 32, 1, 1),
            output_shapes=[(2, *shape)], output_dtypes=[x.dtype])
        return hy
    (hy,) = _add_norm_kernel(unroll or kernels.Q4_UNROLL)(
        inputs=[xs, packed, scales, biases, rs, scale],
        template=[("T", x.dtype), ("K", k), ("G", group_size), ("NO", n_out),
                  ("R", rows), ("NW", _WARPS), ("EPSB", kernels.float_bits(eps)),
                  ("XO", xo), ("RO", ro), ("BITS", _bits(packed, k))],
        grid=(n_out * 32, 1, 1), threadgroup=(_WARPS * 32, 1, 1),
        output_shapes=[(2, *shape)], output_dtypes=[x.dtype])
    return hy
