"""CUDA sources for the decode step's fused kernels (mx.fast.cuda_kernel, JIT-compiled by MLX
on first use). Each replaces a run of MLX launches that its built-ins leave separate:

* `add_rms_norm`: the residual Add and the RMSNorm that reads it -> one launch, two outputs
  (the sum, kept as the next residual, and the normalized row).
* `rope_attend`: one decoded token's (per batch row, each at its own position) q/k RMSNorm
  (Qwen3), RoPE at the device-side position,
  and attention over the fixed-capacity cache rows 0..pos (the new key/value taken from
  registers, not the cache) -> one launch instead of norm x2, rope x2 and MLX-CUDA's SDPA,
  which has no vector kernel for an array mask and falls back to matmul/softmax/matmul.
  It writes the new key/value rows into the cache itself (no scatter launches).
  Two forms, one launch each: a block per query head, and a split (flash-decoding) form
  with a block per KV head's query heads and key split whose last block merges the splits
  (kernels.auto_splits picks how many: FUSELM_ATTN_SPLIT=auto).
  Over an 8-bit KV cache (kv_cache.KVQuant, bits 8: rows stored rotated and quantized) the
  split form's 8-bit variant (`_Q8_CACHE`, the same kernel text with its cache reads and
  writes swapped) also rotates q and the new k/v rows, quantizes the new rows as mx.quantize
  does, writes codes, scales and biases in place, reads the keys as code * scale + bias and
  rotates its output back: still one launch a layer, where the plain path dequantizes the
  layer's cache for MLX's float matmuls. Over a 4-bit cache (keys per channel, KIVI) the
  4-bit variant (`_Q4_CACHE`) runs in the decode steps whose write completes no key group (63
  of a row's 64; a sealing step, which quantizes the completed group, runs the plain path):
  the new key goes into the row's float tail, the new value row is rotated and quantized to 4
  bits in place, the keys of the row's open group are read from the tail, the older ones from
  their per-channel codes, the values from theirs.

The plain-MLX paths they replace are in runtime_metal/mlx_engine/program_ops.py, eligibility and the
on/off switch in runtime_metal/cuda_kernels/selection.py, the equivalence tests in
tests/runtime/test_kernels.py and (the 8-bit cache) test_kv_kernels.py. Arithmetic is float32
with the same roundings to the activation dtype as the plain path (after the Add, after the
norm, after RoPE; the 8-bit form: after the rotation, the scales and biases), so the two agree
to a few units in the last place of that dtype.
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx

from fuselm.runtime_metal.cuda_kernels import selection as kernels
from fuselm.runtime_metal.kv_cache import KEY_GROUP, Buffer

_HEADER = """
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
  return v;
}
// RoPE's pairing of element e < rd of a head, for both attention kernels: the frequency index
// m, the partner element and the sign of the partner's term; pairs (2i, 2i+1) when
// interleaved (GPT-J), else the halves [0, rd/2) and [rd/2, rd) (rotate_half)
template <bool INTERLEAVED_, int RD_>
__device__ __forceinline__ void rope_pair(int e, int& m, int& partner, float& sign) {
  if (INTERLEAVED_) {
    m = e >> 1; partner = e ^ 1; sign = (e & 1) ? 1.f : -1.f;
  } else {
    constexpr int HALF = RD_ / 2;
    m = e < HALF ? e : e - HALF;
    partner = e < HALF ? e + HALF : e - HALF;
    sign = e < HALF ? -1.f : 1.f;
  }
}
"""

_ADD_RMS_NORM = """
  // one block per row: h = x + r (rounded to T like the separate Add), y = rms_norm(h) * w
  const int row = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const size_t base = (size_t)row * H;
  float ss = 0.f;
  for (int i = tid; i < H; i += BLOCK) {
    T v = T(static_cast<float>(x[base + i]) + static_cast<float>(r[base + i]));
    h[base + i] = v;
    float f = static_cast<float>(v);
    ss += f * f;
  }
  __shared__ float part[32];
  ss = warp_sum(ss);
  if (lane == 0) part[warp] = ss;
  __syncthreads();
  if (warp == 0) {
    float t = lane < BLOCK / 32 ? part[lane] : 0.f;
    t = warp_sum(t);
    if (lane == 0) part[0] = t;
  }
  __syncthreads();
  const float rs = rsqrtf(part[0] / H + __int_as_float(EPSB));
  for (int i = tid; i < H; i += BLOCK) {
    y[base + i] = T(static_cast<float>(h[base + i]) * rs * static_cast<float>(w[i]));
  }
"""

_ROPE_ATTEND_BODY = """
  // block (h, b) = query head h of batch row b; NW warps; lane l owns elements
  // [l*VPT, (l+1)*VPT) of a row. Row b decodes at its own position offset[b].
  constexpr int VPT = D / 32, G = HQ / HK;
  const int h = blockIdx.x, g = h / G, b = blockIdx.y;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int pos = offset[b];
  const int cap = kc_shape[2];
  const size_t qh = (size_t)b * HQ + h, kh = (size_t)b * HK + g;
/*KVROW*/  const size_t prow = kv_row(pos);
  __shared__ float sq[D], sk[D], sv[D], tq[D], tk[D], rs[2];
  __shared__ float wm[NW], wl[NW], wacc[NW][D];
  if (tid < D) {  // q/k/v rows: QRW / KRW elements wide, k and v from element KO / VO
    sq[tid] = static_cast<float>(q[(size_t)b * QRW + h * D + tid]);
    sk[tid] = static_cast<float>(k[(size_t)b * KRW + KO + g * D + tid]);
    sv[tid] = static_cast<float>(v[(size_t)b * KRW + VO + g * D + tid]);
  }
  __syncthreads();
  if (warp < 2) {  // warp 0: q's sum of squares, warp 1: k's
    const float* src = warp == 0 ? sq : sk;
    float ss = 0.f;
    for (int i = lane; i < D; i += 32) ss += src[i] * src[i];
    ss = warp_sum(ss);
    if (lane == 0) rs[warp] = rsqrtf(ss / D + __int_as_float(PE));
  }
  __syncthreads();
  if (tid < D) {
    float a = sq[tid], b = sk[tid];
    if (HAS_QN) a = static_cast<float>(T(a * rs[0] * static_cast<float>(qn[tid])));
    if (HAS_KN) b = static_cast<float>(T(b * rs[1] * static_cast<float>(kn[tid])));
    tq[tid] = a;
    tk[tid] = b;
  }
  __syncthreads();
  if (tid < D) {
    float a = tq[tid], b = tk[tid];
    if (tid < RD) {
      int m, partner;
      float sign;
      rope_pair<INTERLEAVED, RD>(tid, m, partner, sign);
      const float th = static_cast<float>(pos) * inv_freq[m];
      const float c = cosf(th), s = sinf(th);
      a = (a * c + sign * tq[partner] * s) * __int_as_float(PA);
      b = (b * c + sign * tk[partner] * s) * __int_as_float(PA);
    }
    const T qa = T(a), kb = T(b), vb = T(sv[tid]);
    sq[tid] = static_cast<float>(qa) * __int_as_float(PQ);  // the softmax scale, in q
    sk[tid] = static_cast<float>(kb);
    sv[tid] = static_cast<float>(vb);
    if (h % G == 0) {  // the new row goes into the cache in place (see rope_attend)
      const_cast<T*>(kc)[prow * D + tid] = kb;
      const_cast<T*>(vc)[prow * D + tid] = vb;
    }
  }
  __syncthreads();
  float qr[VPT], acc[VPT];
  for (int e = 0; e < VPT; ++e) { qr[e] = sq[lane * VPT + e]; acc[e] = 0.f; }
/*KEYS*/  if (lane == 0) { wm[warp] = m; wl[warp] = l; }
  for (int e = 0; e < VPT; ++e) wacc[warp][lane * VPT + e] = acc[e];
  __syncthreads();
  if (tid < D) {  // merge the warps' partial softmaxes
    float mx_ = __int_as_float(0xff800000);
    for (int w = 0; w < NW; ++w) mx_ = fmaxf(mx_, wm[w]);
    float den = 0.f, num = 0.f;
    for (int w = 0; w < NW; ++w) {
      const float c = wl[w] > 0.f ? __expf(wm[w] - mx_) : 0.f;
      den += wl[w] * c;
      num += wacc[w][tid] * c;
    }
    out[qh * D + tid] = T(num / den);
  }
"""


_KEYS_ONE = """  float m = __int_as_float(0xff800000), l = 0.f;  // -infinity
  for (int j = warp; j <= pos; j += NW) {  // online softmax over this warp's keys
    float kr[VPT], vr[VPT];
    if (j < pos) {
      const size_t at = kv_row(j) * D + lane * VPT;
      for (int e = 0; e < VPT; ++e) {
        kr[e] = static_cast<float>(kc[at + e]);
        vr[e] = static_cast<float>(vc[at + e]);
      }
    } else {  // the token being decoded: not in the cache yet
      for (int e = 0; e < VPT; ++e) { kr[e] = sk[lane * VPT + e]; vr[e] = sv[lane * VPT + e]; }
    }
    float s = 0.f;
    for (int e = 0; e < VPT; ++e) s += qr[e] * kr[e];
    s = warp_sum(s);
    const float mn = fmaxf(m, s), corr = __expf(m - mn), p = __expf(s - mn);
    l = l * corr + p;
    for (int e = 0; e < VPT; ++e) acc[e] = acc[e] * corr + p * vr[e];
    m = mn;
  }
"""

# The cache row of position j for KV head g of batch row b (both kernels): row kh * cap + j of
# [rows, HK, cap, D] buffers, or, with a block table (BT: kv_cache.BlockCache), slot j % BS of
# block bt[b][j / BS] (MB blocks a row) of [blocks, HK, BS, D] pools. BS is a power of two.
_KV_ROW = """  auto kv_row = [&](int j) -> size_t {
    return BT ? ((size_t)bt[(size_t)b * MB + j / BS] * HK + g) * BS + j % BS
              : kh * cap + j;
  };
"""

_ROPE_ATTEND = _ROPE_ATTEND_BODY.replace("/*KEYS*/", _KEYS_ONE).replace("/*KVROW*/", _KV_ROW)

# ---- the split (flash-decoding) variant: FUSELM_ATTN_SPLIT=auto (kernels.auto_splits) --------
# Measured on the H200: the kernel above runs one block per query head (16 blocks on 132 SMs at
# Qwen3-0.6B), each warp walking keys one at a time with scalar loads: 26 µs a layer in the
# decode step. Here a block serves GB query heads of one KV head (K/V rows read once for them)
# over one of S splits of the keys 0..pos, with vector loads and KB keys per warp in flight;
# each split leaves its partial softmax (max, sum, weighted values) and the LAST of the S
# blocks of a head group to finish (a ticket counter) merges them, so there is no merge launch
# (S = 1: the block writes the output itself). Same arithmetic and roundings as the kernel
# above; only the order of the float32 softmax sums differs; the merge always runs over the
# splits in order 0..S-1, so the result does not depend on which block came last.

_VEC_HEADER = """
// N consecutive elements of a cache row as float32, in the widest loads their bytes allow
// (rows start 64-byte aligned: D is a multiple of 32)
template <typename V, typename TT, int N>
__device__ __forceinline__ void fl_load_as(const TT* p, float* o) {
  constexpr int PER = sizeof(V) / sizeof(TT);
  #pragma unroll
  for (int i = 0; i < N / PER; ++i) {
    const V u = reinterpret_cast<const V*>(p)[i];
    const TT* t = reinterpret_cast<const TT*>(&u);
    #pragma unroll
    for (int e = 0; e < PER; ++e) o[i * PER + e] = static_cast<float>(t[e]);
  }
}
template <typename TT, int N>
__device__ __forceinline__ void fl_load_row(const TT* p, float* o) {
  constexpr int B = N * (int)sizeof(TT);
  if (B % 16 == 0) {  // B is a constant: the other branches compile away
    fl_load_as<uint4, TT, N>(p, o);
  } else if (B % 8 == 0) {
    fl_load_as<uint2, TT, N>(p, o);
  } else if (B % 4 == 0) {
    fl_load_as<unsigned int, TT, N>(p, o);
  } else {
    #pragma unroll
    for (int e = 0; e < N; ++e) o[e] = static_cast<float>(p[e]);
  }
}
"""

_ATTEND_SPLIT = """
  // block (x, b): x = (g * NGB + gb) * S + s serves KV head g's query heads h0 .. h0+GB-1
  // (h0 = g * G + gb * GB) of batch row b over split s of the keys 0..pos. Every block ropes
  // and norms its q heads and the new k (a few hundred flops); block (gb 0, split 0) writes
  // the new K/V row into the cache in place (no other block reads that row: the key being
  // decoded comes from shared memory).
  constexpr int VPT = D / 32, G = HQ / HK, NGB = G / GB, NT = NW * 32;
  const int s = blockIdx.x % S, gb = (blockIdx.x / S) % NGB, g = blockIdx.x / (S * NGB);
  const int h0 = g * G + gb * GB, b = blockIdx.y;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  // Every global load the prologue needs is issued here, at once, and the first keys' loads
  // are in flight through it (ncu had the kernel ~77 % stalled on dependent loads). Measured
  // in the H200 step: 17.3 -> 17.0 us, so those stalls are not where its time goes.
  const int pos = offset[b];
  const int cap = /*CAP*/;
  const size_t kh = (size_t)b * HK + g;
/*KVROW*/  const float eps = __int_as_float(PE), qscale = __int_as_float(PQ);
  const float ascale = __int_as_float(PA);
  // The splits this row's keys fill, at least 64 keys each: splits past them hold no keys and
  // only leave an empty partial, so a batch of short rows does not pay S blocks' prologue a
  // row. The count depends on the row's own length alone, never on its batch.
  const int SE = min(S, (pos + 64) / 64);
  if (s < SE) {
  __shared__ float sq[GB][D], tq[GB][D], sk[D], tk[D], sv[D], rs[GB + 1];
  __shared__ float sqn[D], skn[D], sif[RD / 2 + 1];
  __shared__ float wm[NW][GB], wl[NW][GB], wacc[NW][GB][D];
  // this split's keys [j_begin, j_end) of the pos + 1 (the last one: the token being decoded)
/*SPAN*/  const int j_first = j_begin + warp * KB;
/*KVPTR*//*FIRST*/
  for (int i = tid; i < GB * D; i += NT)  // q/k/v rows as in the kernel above (QRW, KRW, KO, VO)
    sq[i / D][i % D] = static_cast<float>(q[(size_t)b * QRW + h0 * D + i]);
  for (int i = tid; i < D; i += NT) {
    sk[i] = static_cast<float>(k[(size_t)b * KRW + KO + g * D + i]);
    sv[i] = static_cast<float>(v[(size_t)b * KRW + VO + g * D + i]);
    if (HAS_QN) sqn[i] = static_cast<float>(qn[i]);
    if (HAS_KN) skn[i] = static_cast<float>(kn[i]);
    if (i < RD / 2) sif[i] = inv_freq[i];
  }
  __syncthreads();
  for (int r = warp; r <= GB; r += NW) {  // r < GB: query head r's sum of squares; GB: k's
    const float* src = r < GB ? sq[r] : sk;
    float ss = 0.f;
    for (int i = lane; i < D; i += 32) ss += src[i] * src[i];
    ss = warp_sum(ss);
    if (lane == 0) rs[r] = rsqrtf(ss / D + eps);
  }
  __syncthreads();
  for (int i = tid; i < (GB + 1) * D; i += NT) {
    const int r = i / D, e = i % D;
    if (r < GB) {
      float a = sq[r][e];
      if (HAS_QN) a = static_cast<float>(T(a * rs[r] * sqn[e]));
      tq[r][e] = a;
    } else {
      float a = sk[e];
      if (HAS_KN) a = static_cast<float>(T(a * rs[GB] * skn[e]));
      tk[e] = a;
    }
  }
  __syncthreads();
  for (int i = tid; i < (GB + 1) * D; i += NT) {
    const int r = i / D, e = i % D;
    const float* src = r < GB ? tq[r] : tk;
    float a = src[e];
    if (e < RD) {
      int m, partner;
      float sign;
      rope_pair<INTERLEAVED, RD>(e, m, partner, sign);
      const float th = static_cast<float>(pos) * sif[m];
      a = (a * cosf(th) + sign * src[partner] * sinf(th)) * ascale;
    }
    const T ta = T(a);
    if (r < GB) {
      sq[r][e] = static_cast<float>(ta)/*QSCALE*/;
    } else {
      const T tv = T(sv[e]);
      sk[e] = static_cast<float>(ta);
      sv[e] = static_cast<float>(tv);
/*PUTROW*/    }
  }
  __syncthreads();
/*QUANT*/  float qr[GB][VPT], acc[GB][VPT], m[GB], l[GB];
  #pragma unroll
  for (int hh = 0; hh < GB; ++hh) {
    m[hh] = __int_as_float(0xff800000);  // -infinity
    l[hh] = 0.f;
    #pragma unroll
    for (int e = 0; e < VPT; ++e) { qr[hh][e] = sq[hh][lane * VPT + e]; acc[hh][e] = 0.f; }
  }
/*KEYS*/  #pragma unroll
  for (int hh = 0; hh < GB; ++hh) {
    if (lane == 0) { wm[warp][hh] = m[hh]; wl[warp][hh] = l[hh]; }
    #pragma unroll
    for (int e = 0; e < VPT; ++e) wacc[warp][hh][lane * VPT + e] = acc[hh][e];
  }
  __syncthreads();
  for (int i = tid; i < GB * D; i += NT) {  // merge the warps' partial softmaxes
    const int hh = i / D, e = i % D;
    float mx_ = __int_as_float(0xff800000);
    for (int w = 0; w < NW; ++w) mx_ = fmaxf(mx_, wm[w][hh]);
    float den = 0.f, num = 0.f;
    for (int w = 0; w < NW; ++w) {
      const float c = wl[w][hh] > 0.f ? __expf(wm[w][hh] - mx_) : 0.f;
      den += wl[w][hh] * c;
      num += wacc[w][hh][e] * c;
    }
    const size_t qh = (size_t)b * HQ + h0 + hh;
/*WRITE*/
  }
/*AFTER*/  } else if (tid < GB) {  // an empty split (S > 1 only: SE >= 1)
    const size_t qh = (size_t)b * HQ + h0 + tid;
/*EMPTY*/
  }
/*TAIL*/"""
# The float and 8-bit forms' keys: a warp step of KB keys (keys j_first + u, then NW * KB on),
# each key's row read whole (/*LOAD*/), the first step's rows loaded before the prologue;
# filled into the split kernel's /*SPAN*/ (the keys of a split), /*FIRST*/ and /*KEYS*/ places.
_ROW_KEYS = {
    "/*SPAN*/": """  const int n = pos + 1, chunk = (n + SE - 1) / SE;
  const int j_begin = s * chunk, j_end = min(n, j_begin + chunk);
""",
    "/*FIRST*/": """  float kr[KB][VPT], vr[KB][VPT];
  #pragma unroll
  for (int u = 0; u < KB; ++u) {  // the first keys' loads, in flight through the prologue
    const int j = j_first + u;
    if (j < j_end && j < pos) {
/*LOAD*/
    }
  }
""",
    "/*KEYS*/": """  for (int j0 = j_first; j0 < j_end; j0 += NW * KB) {
    float sc[KB][GB];
    #pragma unroll
    for (int u = 0; u < KB; ++u) {  // all KB rows' loads in flight before the first score
      const int j = j0 + u;
      if (j < j_end && j < pos) {
        if (j0 != j_first) {  // the first step's rows were loaded before the prologue
/*LOAD*/
        }
      } else {
        const bool now = j == pos && j < j_end;  // the token being decoded, else weighed 0
        #pragma unroll
        for (int e = 0; e < VPT; ++e) {
          kr[u][e] = now ? sk[lane * VPT + e] : 0.f;
          vr[u][e] = now ? sv[lane * VPT + e] : 0.f;
        }
      }
    }
    #pragma unroll
    for (int u = 0; u < KB; ++u)
      #pragma unroll
      for (int hh = 0; hh < GB; ++hh) {
        float d = 0.f;
        #pragma unroll
        for (int e = 0; e < VPT; ++e) d += qr[hh][e] * kr[u][e];
        sc[u][hh] = d;
      }
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1)
      #pragma unroll
      for (int u = 0; u < KB; ++u)
        #pragma unroll
        for (int hh = 0; hh < GB; ++hh) sc[u][hh] += __shfl_xor_sync(0xffffffff, sc[u][hh], o);
    #pragma unroll
    for (int hh = 0; hh < GB; ++hh) {
      float mn = m[hh];  // j0 < j_end: the first key counts, so mn is finite
      #pragma unroll
      for (int u = 0; u < KB; ++u)
        if (j0 + u < j_end) mn = fmaxf(mn, sc[u][hh]);
      const float corr = __expf(m[hh] - mn);
      l[hh] *= corr;
      #pragma unroll
      for (int e = 0; e < VPT; ++e) acc[hh][e] *= corr;
      #pragma unroll
      for (int u = 0; u < KB; ++u) {
        if (j0 + u < j_end) {
          const float p = __expf(sc[u][hh] - mn);
          l[hh] += p;
          #pragma unroll
          for (int e = 0; e < VPT; ++e) acc[hh][e] += p * vr[u][e];
        }
      }
      m[hh] = mn;
    }
  }
""",
}

# The split kernel's cache forms, filled into its /*KVPTR*/, /*LOAD*/ (_ROW_KEYS' rows; the 4-bit
# form has its own keys loop), /*QSCALE*/, /*PUTROW*/, /*QUANT*/ and /*AFTER*/ places
# (_split_source). A float cache (the activation dtype): rows read as they are, the new row
# written as the last step of the prologue.
_FLOAT_CACHE = {
    "/*CAP*/": "kc_shape[2]",
    "/*KVPTR*/": """  const T* kb = kc + lane * VPT;
  const T* vb = vc + lane * VPT;
""",
    "/*LOAD*/": """      fl_load_row<T, VPT>(kb + kv_row(j) * D, kr[u]);
      fl_load_row<T, VPT>(vb + kv_row(j) * D, vr[u]);""",
    "/*QSCALE*/": " * qscale",  # the softmax scale, folded into q
    "/*PUTROW*/": """      if (s == 0 && gb == 0) {
        const size_t prow = kv_row(pos);
        const_cast<T*>(kc)[prow * D + e] = ta;
        const_cast<T*>(vc)[prow * D + e] = tv;
      }
""",
    "/*QUANT*/": "",
    "/*AFTER*/": "",
}

# An 8-bit cache (kv_cache.KVQuant, bits 8): each of K and V the triple mx.quantize makes, codes
# kc / vc (uint32 words: a row's D bytes, code e at byte e), scales kcs / vcs and biases kcb /
# vcb (T, a row's D / GS), rows stored rotated (kv_cache.rotate). A lane's VPT values lie in one
# group (rope_attend_fits: VPT divides GS), so a key's read is its code bytes, one scale and one
# bias. The prologue then rotates q and the new k and v rows (kv_cache.rotate: Sylvester-Hadamard
# blocks of P = D & -D times T(1/sqrt(P)), the constant PR, as rotate's matrix in T holds it),
# rounding each to T as rotate's matmul does; quantizes k and v as mx.quantize does (q8_group)
# and keeps their dequantized values, which the keys loop reads for the token being decoded, as
# the plain path reads back the row it has just written; block (gb 0, split 0) writes the codes,
# scales and biases in place (no other block reads that row). The output, a mix of rotated
# values, is rotated back before it is written (R is symmetric: the same transform).
_Q8_CACHE = {
    "/*CAP*/": "kc_shape[2]",
    "/*KVPTR*/": """  constexpr int NG = D / GS;  // groups a row
  const unsigned char* kb = (const unsigned char*)kc + lane * VPT;
  const unsigned char* vb = (const unsigned char*)vc + lane * VPT;
  const int lg = lane * VPT / GS;  // the group of this lane's values
""",
    "/*LOAD*/": """      const size_t at = kv_row(j);
      q8_load_row<T, VPT>(kb + at * D, kcs[at * NG + lg], kcb[at * NG + lg], kr[u]);
      q8_load_row<T, VPT>(vb + at * D, vcs[at * NG + lg], vcb[at * NG + lg], vr[u]);""",
    "/*QSCALE*/": "",  # the softmax scale: after the rotation, below
    "/*PUTROW*/": "",
    "/*QUANT*/": """  auto row_of = [&](int r) -> float* {
    return r < GB ? sq[r] : r == GB ? sk : sv;
  };
  fwht_rows<D, NT>(row_of, GB + 2, tid);
  const float rh = static_cast<float>(T(__int_as_float(PR)));
  for (int i = tid; i < (GB + 2) * D; i += NT) {
    float* x = row_of(i / D);
    const float y = static_cast<float>(T(x[i % D] * rh));
    x[i % D] = i < GB * D ? y * qscale : y;
  }
  __syncthreads();
  for (int r = warp; r < 2 * NG; r += NW) {  // a warp a group: r < NG the key's, else the value's
    const int grp = r % NG;
    const size_t prow = kv_row(pos) * NG + grp;
    unsigned char* codes = (unsigned char*)(r < NG ? kc : vc) + prow * GS;
    q8_group<T, GS>((r < NG ? sk : sv) + grp * GS, lane, s == 0 && gb == 0, codes,
                    const_cast<T*>(r < NG ? kcs : vcs) + prow,
                    const_cast<T*>(r < NG ? kcb : vcb) + prow);
  }
  __syncthreads();
  __shared__ float smx[GB], sden[GB];
""",
    "/*AFTER*/": """  __syncthreads();
  fwht_rows<D, NT>([&](int r) -> float* { return tq[r]; }, GB, tid);
  for (int i = tid; i < GB * D; i += NT) {  // the output rotated back
    const int hh = i / D, e = i % D;
    const size_t qh = (size_t)b * HQ + h0 + hh;
    const float num = tq[hh][e] * rh, den = sden[hh], mx_ = smx[hh];
    (void)mx_;
/*WRITE*/
  }
""",
}
# the 8-bit form's merge of the warps leaves each head's sums in shared memory (tq: the q rows'
# RoPE buffer, free by then) for the rotation back
_Q8_STASH = """    tq[hh][e] = num;
    if (e == 0) { smx[hh] = mx_; sden[hh] = den; }"""

# A 4-bit cache (kv_cache.KVQuant bits 4, keys per channel: KIVI), in the decode steps that
# complete no key group (the step_open / paged_open programs: a sealing step, whose write
# quantizes the completed group, runs the plain path). Keys: four arrays, per-channel codes kc
# (uint32 [.., D, KG * 8]: channel e's group of KGP positions in 8 words, position jj of it at
# nibble jj % 8 of word jj / 8, low nibble first), scales kcs and biases kcb ([.., D, KG]: one per
# channel and group), unrotated, and the float tail kct ([rows, HK, KT, D]: position j at slot
# j % KT); a block pool holds one group a block (KG = 1) and each row's tail is its slot tr[b].
# As Attention._channels reads them, the keys of the row's open group (the one holding pos,
# from g0) come from the tail (the token being decoded: from shared memory), the others from
# the codes, code * scale + bias. Values: per token as the 8-bit form's, 4 bits (8 codes a word,
# low nibble first), rows rotated. The prologue rounds q * scale to T (the plain path's
# `(q * scale).astype(dt)`; no rotation: the keys are not rotated), writes the new key, unrotated,
# into the tail slot, rotates the new value row and quantizes it as mx.quantize does (q4_group),
# written in place by block (gb 0, split 0); the output is rotated back as the 8-bit form's.
# The keys' reads (_Q4_KEYS): a channel's codes of one group are one 32-byte sector of its own
# row (rows KG * 32 bytes apart), its scales and biases in rows of their own too, so a warp's load
# of a word (or a scale) per lane touches 32 cache lines. Read a key at a time, that would be
# 3 * D lines a key (a word, a scale and a bias per channel), against 2 for a float key's 2 * D
# contiguous bytes (D 128, 16 bits); read in steps of KB keys, it is 3 * D lines a step (each
# channel's KB / 8 words in one load, its scale and bias once): 3 * D / KB a key (D 128, KB 16:
# 24), each word serving 8 keys' scores. Still more L1 lines a key than a float key's, for about
# a quarter of its DRAM bytes: which of the two bounds the step on the H200 is a measurement
# (`gpu_run.sh kvbench`).
_Q4_CACHE = {
    "/*CAP*/": "vc_shape[2]",
    "/*KVPTR*/": """  constexpr int NG = D / GS, VW = D / 8;  // value groups and uint32 words a row
  const unsigned int* vb = (const unsigned int*)vc + lane * VPT / 8;
  const int lg = lane * VPT / GS, vsh = lane * VPT % 8 * 4;  // this lane's group, its nibble
  const int g0 = pos - pos % KGP;  // the open key group's first position
  const size_t trow = BT ? (size_t)tr[b] * HK + g : kh;  // the row's tail
  const T* kt = kct + trow * KT * D + lane * VPT;
  // channel lane * VPT's group slot of key j (the next channel's: KG slots on)
  auto kslot = [&](int j) -> size_t {
    return BT ? ((size_t)bt[(size_t)b * MB + j / BS] * HK + g) * D + lane * VPT
              : (kh * D + lane * VPT) * KG + j / KGP;
  };
""",
    "/*QSCALE*/": "",  # below: rounded to T as the plain path's scaled queries
    "/*PUTROW*/": """      if (s == 0 && gb == 0)
        const_cast<T*>(kct)[(trow * KT + pos % KT) * D + e] = ta;
""",
    "/*QUANT*/": """  const float qst = static_cast<float>(T(qscale));
  for (int i = tid; i < GB * D; i += NT)
    sq[i / D][i % D] = static_cast<float>(T(sq[i / D][i % D] * qst));
  fwht_rows<D, NT>([&](int r) -> float* { return sv; }, 1, tid);
  const float rh = static_cast<float>(T(__int_as_float(PR)));
  for (int i = tid; i < D; i += NT) sv[i] = static_cast<float>(T(sv[i] * rh));
  __syncthreads();
  for (int r = warp; r < NG; r += NW) {  // a warp a value group
    const size_t prow = kv_row(pos);
    q4_group<T, GS>(sv + r * GS, lane, s == 0 && gb == 0,
                    const_cast<unsigned int*>((const unsigned int*)vc) + prow * VW + r * GS / 8,
                    const_cast<T*>(vcs) + prow * NG + r, const_cast<T*>(vcb) + prow * NG + r);
  }
  __syncthreads();
  __shared__ float smx[GB], sden[GB];
""",
    "/*AFTER*/": _Q8_CACHE["/*AFTER*/"],
}

# The 4-bit form's keys, in steps of KB keys a warp (KB a multiple of 8 dividing KGP: a split
# spans whole steps, so every step starts at a multiple of KB and its keys lie in one key
# group; the splits take the row's steps evenly, none left empty while there are as many steps
# as splits, which rounding each split's keys up to a step would leave at the end): a step
# in the sealed groups (before g0) reads, for each of the lane's VPT channels, the KB / 8 code
# words holding its codes of the step's keys (one load) and the channel's scale and bias once;
# a step in the open group reads the tail's float rows (the token being decoded: shared memory).
# Each run of 8 keys is then scored at once: each lane's partial dot products of the 8 keys,
# summed over the warp by a transposing butterfly (lanes halve the keys they keep at each of the
# offsets 16, 8, 4: key (lane >> 2) & 7 ends in lane, summed over the offsets 2 and 1 too; 9
# shuffles a head instead of 40) and handed to every lane (8 more); online softmax over the run.
_Q4_KEYS = {
    "/*SPAN*/": """  const int n = pos + 1, steps = (n + KB - 1) / KB;  // shared by the splits
  const int j_begin = s * steps / SE * KB, j_end = min(n, (s + 1) * steps / SE * KB);
""",
    "/*FIRST*/": """  static_assert(KB % 8 == 0 && KGP % KB == 0, "whole words, one key group");
  constexpr int RW = KB / 8;  // code words of a channel a step reads
  unsigned int kw[VPT][RW];
  float ks[VPT], kz[VPT];
  auto load_codes = [&](int j0) {  // the step's codes, scales and biases of the lane's channels
    const size_t at = kslot(j0);
    #pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const size_t c = at + (size_t)i * KG;
      q4_words<RW>((const unsigned int*)kc + c * (KGP / 8) + j0 % KGP / 8, kw[i]);
      ks[i] = static_cast<float>(kcs[c]);
      kz[i] = static_cast<float>(kcb[c]);
    }
  };
  if (j_first < j_end && j_first < g0) load_codes(j_first);  // in flight through the prologue
""",
    "/*KEYS*/": """  for (int j0 = j_first; j0 < j_end; j0 += NW * KB) {
    const bool coded = j0 < g0;  // then every key of the step is before g0 and in the split
    if (coded && j0 != j_first) load_codes(j0);
    #pragma unroll
    for (int r = 0; r < RW; ++r) {
      const int jr = j0 + 8 * r;  // the run's first key
      if (jr < j_end) {
        unsigned int vw[8];
        T vs8[8], vz8[8];
        #pragma unroll
        for (int u = 0; u < 8; ++u) {  // the run's value loads, in flight before the scores
          const int j = jr + u;
          if (j < j_end && j < pos) {
            const size_t at = kv_row(j);
            vw[u] = vb[at * VW];
            vs8[u] = vcs[at * NG + lg];
            vz8[u] = vcb[at * NG + lg];
          } else {
            vw[u] = 0u;
            vs8[u] = vz8[u] = T(0.f);
          }
        }
        float sc[8][GB];
        if (coded) {
          #pragma unroll
          for (int u = 0; u < 8; ++u)
            #pragma unroll
            for (int hh = 0; hh < GB; ++hh) sc[u][hh] = 0.f;
          #pragma unroll
          for (int i = 0; i < VPT; ++i)
            #pragma unroll
            for (int u = 0; u < 8; ++u) {
              const float kv = fmaf(static_cast<float>((kw[i][r] >> (4 * u)) & 15u), ks[i], kz[i]);
              #pragma unroll
              for (int hh = 0; hh < GB; ++hh) sc[u][hh] += qr[hh][i] * kv;
            }
        } else {
          #pragma unroll
          for (int u = 0; u < 8; ++u) {
            const int j = jr + u;
            float kr[VPT];
            if (j < j_end && j < pos) {
              fl_load_row<T, VPT>(kt + (size_t)(j % KT) * D, kr);
            } else {
              const bool now = j == pos && j < j_end;  // the token being decoded, else weighed 0
              #pragma unroll
              for (int e = 0; e < VPT; ++e) kr[e] = now ? sk[lane * VPT + e] : 0.f;
            }
            #pragma unroll
            for (int hh = 0; hh < GB; ++hh) {
              float d = 0.f;
              #pragma unroll
              for (int e = 0; e < VPT; ++e) d += qr[hh][e] * kr[e];
              sc[u][hh] = d;
            }
          }
        }
        #pragma unroll
        for (int hh = 0; hh < GB; ++hh) {
          float t4[4], t2[2], t1;
          const bool b4 = lane & 16, b3 = lane & 8, b2 = lane & 4;
          #pragma unroll
          for (int i = 0; i < 4; ++i)
            t4[i] = (b4 ? sc[i + 4][hh] : sc[i][hh])
                    + __shfl_xor_sync(0xffffffff, b4 ? sc[i][hh] : sc[i + 4][hh], 16);
          #pragma unroll
          for (int i = 0; i < 2; ++i)
            t2[i] = (b3 ? t4[i + 2] : t4[i])
                    + __shfl_xor_sync(0xffffffff, b3 ? t4[i] : t4[i + 2], 8);
          t1 = (b2 ? t2[1] : t2[0]) + __shfl_xor_sync(0xffffffff, b2 ? t2[0] : t2[1], 4);
          t1 += __shfl_xor_sync(0xffffffff, t1, 2);
          t1 += __shfl_xor_sync(0xffffffff, t1, 1);
          #pragma unroll
          for (int u = 0; u < 8; ++u) sc[u][hh] = __shfl_sync(0xffffffff, t1, u << 2);
          float mn = m[hh];  // jr < j_end: the first key counts, so mn is finite
          #pragma unroll
          for (int u = 0; u < 8; ++u)
            if (jr + u < j_end) mn = fmaxf(mn, sc[u][hh]);
          const float corr = __expf(m[hh] - mn);
          l[hh] *= corr;
          #pragma unroll
          for (int e = 0; e < VPT; ++e) acc[hh][e] *= corr;
          #pragma unroll
          for (int u = 0; u < 8; ++u) {  // the weights
            sc[u][hh] = jr + u < j_end ? __expf(sc[u][hh] - mn) : 0.f;
            l[hh] += sc[u][hh];
          }
          m[hh] = mn;
        }
        #pragma unroll
        for (int u = 0; u < 8; ++u) {
          if (jr + u < j_end) {
            float vr[VPT];
            if (jr + u < pos) {
              q4_load_row<T, VPT>(vw[u], vsh, vs8[u], vz8[u], vr);
            } else {
              #pragma unroll
              for (int e = 0; e < VPT; ++e) vr[e] = sv[lane * VPT + e];
            }
            #pragma unroll
            for (int hh = 0; hh < GB; ++hh)
              #pragma unroll
              for (int e = 0; e < VPT; ++e) acc[hh][e] += sc[u][hh] * vr[e];
          }
        }
      }
    }
  }
""",
}

_Q4_HEADER = """
// The 4-bit cache's helpers (kv_cache.KVQuant bits 4; fwht_rows from the 8-bit header).
// q4_group: q8_group at 4 bits (MLX-CUDA's affine_quantize with n_bins 15), the codes packed 8
// a uint32 word, low nibble first (its byte packing read as little-endian words): the lanes
// holding one word's codes OR their nibbles together and the first of them writes it.
template <typename TT, int GS_>
__device__ __forceinline__ void q4_group(float* x, int lane, bool put, unsigned int* codes,
                                         TT* sc, TT* bi) {
  constexpr int VPR = GS_ / 32, LPW = 8 / VPR;  // values a lane, lanes a word
  float w[VPR], scale, bias;
  affine_group<VPR>(x, lane, 15.f, w, scale, bias);
  const TT ts = TT(scale), tb = TT(bias);
  const float fs = static_cast<float>(ts), fb = static_cast<float>(tb);
  unsigned int word = 0u;
  #pragma unroll
  for (int i = 0; i < VPR; ++i) {
    const float c = fminf(roundf(__fdiv_rn(w[i] - bias, scale)), 15.f);
    x[lane * VPR + i] = fmaf(c, fs, fb);
    word |= ((unsigned int)c & 15u) << ((lane * VPR + i) % 8 * 4);
  }
  #pragma unroll
  for (int o = 1; o < LPW; o <<= 1) word |= __shfl_xor_sync(0xffffffff, word, o);
  if (put && lane % LPW == 0) codes[lane * VPR / 8] = word;
  if (put && lane == 0) {
    *sc = ts;
    *bi = tb;
  }
}
// N values of a 4-bit row from one word (nibbles sh / 4 .. sh / 4 + N - 1) as
// code * scale + bias in float32
template <typename TT, int N>
__device__ __forceinline__ void q4_load_row(unsigned int w, int sh, TT sc, TT bi, float* o) {
  const float fs = static_cast<float>(sc), fb = static_cast<float>(bi);
  #pragma unroll
  for (int e = 0; e < N; ++e) o[e] = fmaf(static_cast<float>((w >> (sh + 4 * e)) & 15u), fs, fb);
}
// N consecutive code words at p (N 1, 2 or 4; p aligned to N words) in one load
template <int N>
__device__ __forceinline__ void q4_words(const unsigned int* p, unsigned int* o) {
  if (N == 4) {
    const uint4 w = *reinterpret_cast<const uint4*>(p);
    o[0] = w.x; o[1] = w.y; o[2] = w.z; o[3] = w.w;
  } else if (N == 2) {
    const uint2 w = *reinterpret_cast<const uint2*>(p);
    o[0] = w.x; o[1] = w.y;
  } else {
    #pragma unroll
    for (int i = 0; i < N; ++i) o[i] = p[i];
  }
}
"""

_Q8_HEADER = """
// The 8-bit cache's helpers (kv_cache.KVQuant). fwht_rows: the rows row_of(0..nrows-1) of D_
// floats (shared memory) times kron(I, H_P), H_P the Sylvester-Hadamard matrix of
// P = D_ & -D_, unscaled: in-place butterflies, the whole block's threads, synced after each
// stage (the caller syncs before)
template <int D_, int NT_, typename F>
__device__ __forceinline__ void fwht_rows(F row_of, int nrows, int tid) {
  constexpr int P = D_ & -D_, HALF = D_ / 2;
  for (int h = 1; h < P; h <<= 1) {
    for (int i = tid; i < nrows * HALF; i += NT_) {
      float* x = row_of(i / HALF);
      const int t = i % HALF, lo = (t / h) * 2 * h + t % h;
      const float a = x[lo], c = x[lo + h];
      x[lo] = a + c;
      x[lo + h] = a - c;
    }
    __syncthreads();
  }
}
// One warp: a group of 32 * VPR_ values at x (lane l holds [l * VPR_, (l+1) * VPR_), loaded
// into w) and the scale and bias MLX-CUDA's affine_quantize gives it for `levels` + 1 codes
// (mlx/backend/cuda/quantized/affine_quantize.cu: its min from FLT_MAX and max from 0, eps
// 1e-7, the edge of larger magnitude exact, IEEE divisions), for q8_group and q4_group alike
template <int VPR_>
__device__ __forceinline__ void affine_group(const float* x, int lane, float levels, float* w,
                                             float& scale, float& bias) {
  float wmin = 3.402823466e+38f, wmax = 0.f;
  #pragma unroll
  for (int i = 0; i < VPR_; ++i) {
    w[i] = x[lane * VPR_ + i];
    wmin = fminf(wmin, w[i]);
    wmax = fmaxf(wmax, w[i]);
  }
  #pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    wmin = fminf(wmin, __shfl_xor_sync(0xffffffff, wmin, o));
    wmax = fmaxf(wmax, __shfl_xor_sync(0xffffffff, wmax, o));
  }
  scale = fmaxf(__fdiv_rn(wmax - wmin, levels), 1e-7f);
  const bool side = fabsf(wmin) > fabsf(wmax);
  scale = side ? scale : -scale;
  const float edge = side ? wmin : wmax;
  const float q0 = roundf(__fdiv_rn(edge, scale));
  const bool at_zero = q0 == 0.f;
  scale = at_zero ? scale : __fdiv_rn(edge, q0);
  bias = at_zero ? 0.f : edge;
}
// One warp: GS_ values at x (each T-exact; lane l holds [l * GS_/32, (l+1) * GS_/32)) quantized
// to 8 bits as MLX-CUDA's affine_quantize does (mlx/backend/cuda/quantized/affine_quantize.cu:
// its min from FLT_MAX and max from 0, eps 1e-7, the edge of larger magnitude exact, round half
// away from zero, IEEE divisions), left in x as their dequantized values code * T(scale) +
// T(bias); with `put`, the codes, the scale and the bias (rounded to TT) written out.
template <typename TT, int GS_>
__device__ __forceinline__ void q8_group(float* x, int lane, bool put, unsigned char* codes,
                                         TT* sc, TT* bi) {
  constexpr int VPR = GS_ / 32;
  float w[VPR], scale, bias;
  affine_group<VPR>(x, lane, 255.f, w, scale, bias);
  const TT ts = TT(scale), tb = TT(bias);
  const float fs = static_cast<float>(ts), fb = static_cast<float>(tb);
  #pragma unroll
  for (int i = 0; i < VPR; ++i) {
    const float c = fminf(roundf(__fdiv_rn(w[i] - bias, scale)), 255.f);
    x[lane * VPR + i] = fmaf(c, fs, fb);
    if (put) codes[lane * VPR + i] = (unsigned char)c;
  }
  if (put && lane == 0) {
    *sc = ts;
    *bi = tb;
  }
}
// N codes of a row (bytes) read back as code * scale + bias in float32
template <typename TT, int N>
__device__ __forceinline__ void q8_load_row(const unsigned char* p, TT sc, TT bi, float* o) {
  if (N % 4 != 0 && N % 2 == 0) {
    fl_load_as<unsigned short, unsigned char, N>(p, o);
  } else {
    fl_load_row<unsigned char, N>(p, o);
  }
  const float fs = static_cast<float>(sc), fb = static_cast<float>(bi);
  #pragma unroll
  for (int e = 0; e < N; ++e) o[e] = fmaf(o[e], fs, fb);
}
"""

# S = 1: every key in this block; S > 1: the split's partial (an empty split: l = 0, max -inf)
_WRITE_OUT = "    out[qh * D + e] = T(num / den);"
_EMPTY_PART = "    pm[qh * S + s] = __int_as_float(0xff800000); pl[qh * S + s] = 0.f;"
_WRITE_PART = """    pacc[(qh * S + s) * D + e] = num;
    if (e == 0) { pm[qh * S + s] = mx_; pl[qh * S + s] = den; }"""

# S > 1: the last block of the head group to finish merges the S partials (read through L2:
# other blocks wrote them) as the split kernel merges its warps'; then resets the ticket.
_ATTEND_SPLIT = _ATTEND_SPLIT.replace("/*KVROW*/", _KV_ROW)

_MERGE_LAST = """
  __threadfence();  // this block's partials visible device-wide before its ticket
  __shared__ unsigned int ticket;
  __syncthreads();
  const size_t slot = ((size_t)b * HK + g) * NGB + gb;
  if (tid == 0) ticket = atomicAdd(&fuselm_split_tickets[slot], 1u);
  __syncthreads();
  if (ticket != S - 1) return;
  __threadfence();
  for (int i = tid; i < GB * D; i += NT) {
    const int hh = i / D, e = i % D;
    const size_t qh = (size_t)b * HQ + h0 + hh;
    float mx_ = __int_as_float(0xff800000);
    for (int t = 0; t < S; ++t)
      if (__ldcg(pl + qh * S + t) > 0.f) mx_ = fmaxf(mx_, __ldcg(pm + qh * S + t));
    float den = 0.f, num = 0.f;
    for (int t = 0; t < S; ++t) {
      const float lt = __ldcg(pl + qh * S + t);
      if (lt > 0.f) {  // an empty split's accumulator is never written
        const float c = __expf(__ldcg(pm + qh * S + t) - mx_);
        den += lt * c;
        num += __ldcg(pacc + (qh * S + t) * D + e) * c;
      }
    }
    out[qh * D + e] = T(num / den);
  }
  if (tid == 0) fuselm_split_tickets[slot] = 0u;  // ready for the next call
"""
# One ticket per (batch row, KV head, head group): zero when the module loads, and back to zero
# after every call (the last block resets it). Launches on one stream never overlap, so calls
# (layers, steps) share the tickets safely; two engines decoding at the same moment on two
# streams of one process would share them too, which is why that is not supported on CUDA
# (README). A ticket buffer owned by each program would lift that.
TICKET_SLOTS = 65536
_TICKETS = f"__device__ unsigned int fuselm_split_tickets[{TICKET_SLOTS}] = {{}};\n"
_SPLIT_WARPS = 8  # 256 threads a block; the splits give the parallelism
_SPLIT_KEYS = 4  # keys per warp step in flight: 32 a block, 16 KB of K/V loads outstanding
# The 4-bit form's keys a warp step (_Q4_KEYS: 8, 16 or 32, whole code words of one key group):
# 16 keeps a block's 8 warps busy on a split of 128 keys (a 4,096-key row at 32 splits) while
# halving the scale and bias reads a key of a step of 8.
_Q4_SPLIT_KEYS = 16
_Q4_STEPS = (8, 16, 32)
_SPLIT_LANE_FLOATS = 16  # GB * VPT: each lane's q and accumulator floats per kept head


# The splits' partials (max, sum, accumulator: rows x HQ x S x (D + 2) floats) in scratch of
# the module rather than as outputs of the launch: MLX-CUDA's host cost grows ~2 µs with each
# output array, and the decode step is host-bound on the H200 (benchmarks/host_launch_bench.py,
# BENCHMARKS.md 'Host cost of a launch on MLX-CUDA'). A launch whose partials do not fit (a
# batch of many rows at many splits) takes them as outputs instead: the same arithmetic, only
# where the partials live.
SPLIT_SCRATCH = 1 << 21  # floats (8 MB a module)
_SCRATCH = f"__device__ float fuselm_split_scratch[{SPLIT_SCRATCH}];\n"
_SCRATCH_PARTS = """
  float* pm = fuselm_split_scratch;
  float* pl = pm + (size_t)gridDim.y * HQ * S;
  float* pacc = pl + (size_t)gridDim.y * HQ * S;
"""


# Inputs a launch does not need are left out: MLX-CUDA's host cost is ~0.4 µs an input array
# at every launch, and the decode step is host-bound on the H200. So the float constants (eps,
# softmax scale, attention scale) are template arguments PE, PQ, PA (kernels.float_bits), the
# fused projection (joined: q, k and v are slices of it) is one input `q` that k and v alias,
# and absent q/k-norm scales are no inputs (null pointers, never read: HAS_QN / HAS_KN).
def _attend_inputs(joined: bool, norms: tuple[bool, bool], paged: bool = False,
                   cache: str = "float") -> list[str]:
    """The attention kernels' input names: q (k, v unless joined), qn / kn where present, the
    caches kc, vc (`cache` "q8": each a triple of codes, scales, biases; "q4": the keys' four
    arrays, the tail kct last, and the values' triple), the block table bt when the caches are
    block pools (paged; a 4-bit cache's rows' tail slots tr too)."""
    caches = {"float": ["kc", "vc"], "q8": ["kc", "kcs", "kcb", "vc", "vcs", "vcb"],
              "q4": ["kc", "kcs", "kcb", "kct", "vc", "vcs", "vcb"]}[cache]
    return (["q"] + ([] if joined else ["k", "v"]) + (["qn"] if norms[0] else [])
            + (["kn"] if norms[1] else []) + ["inv_freq", "offset", *caches]
            + (["bt"] if paged else []) + (["tr"] if paged and cache == "q4" else []))


def _attend_prelude(joined: bool, norms: tuple[bool, bool], paged: bool = False,
                    cache: str = "float") -> str:
    """The kernel body's first lines: the names of the inputs _attend_inputs leaves out
    (MLX puts the body after the kernel's parameters, so these come before any use)."""
    return (("  const T* k = q;\n  const T* v = q;\n" if joined else "")
            + ("" if norms[0] else "  const T* qn = nullptr;\n")
            + ("" if norms[1] else "  const T* kn = nullptr;\n")
            + ("" if paged else "  const int* bt = nullptr;\n")
            + ("  const int* tr = nullptr;\n" if cache == "q4" and not paged else ""))


def _attend_suffix(joined: bool, norms: tuple[bool, bool], paged: bool = False,
                   cache: str = "float") -> str:
    """A kernel name per input set, so profiles (ncu, kernel_bench, step_profile) tell the
    variants apart (MLX-CUDA keeps one module per text in any case: custom_kernel.cpp names it
    by the kernel's name and a hash of its source)."""
    return (("_qkv" if joined else "") + ("_qn" if norms[0] else "") + ("_kn" if norms[1] else "")
            + ("_bt" if paged else "") + ("" if cache == "float" else "_" + cache))


def _attend_args(q: mx.array, k: mx.array, v: mx.array, qn: mx.array | None,
                 kn: mx.array | None, inv_freq: mx.array, offset: mx.array, kc: Buffer,
                 vc: Buffer, joined: bool, table: mx.array | None = None,
                 tails: mx.array | None = None) -> list[mx.array]:
    """The input arrays, in _attend_inputs' order (its names pick them)."""
    arrays: dict[str, Any] = {"q": q, "k": k, "v": v, "qn": qn, "kn": kn,
                              "inv_freq": inv_freq, "offset": offset, "bt": table, "tr": tails}
    for name, c in (("kc", kc), ("vc", vc)):
        names = (name, name + "s", name + "b", name + "t")[:len(c)] if isinstance(c, tuple) else ()
        arrays.update(zip(names, c, strict=True) if isinstance(c, tuple) else [(name, c)])
    return [arrays[n] for n in _attend_inputs(joined, (qn is not None, kn is not None),
                                              table is not None, _cache_kind(kc))]


def _cache_kind(kc: Buffer) -> str:
    """"float", "q8" (an 8-bit cache's key triple) or "q4" (a 4-bit cache's per-channel keys:
    four arrays, kv_cache.key_groups_zeros / key_blocks_zeros)."""
    return "float" if not isinstance(kc, tuple) else "q4" if len(kc) == 4 else "q8"


def _table_consts(vc: Buffer, table: mx.array | None) -> list[tuple[str, Any]]:
    """BT (block pools), BS (positions a block: the value pool's axis 2) and MB (blocks a row)
    template constants."""
    if table is None:
        return [("BT", False), ("BS", 1), ("MB", 1)]
    return [("BT", True), ("BS", _codes(vc).shape[2]), ("MB", table.shape[1])]


def _codes(c: Buffer) -> mx.array:
    """A cache's array with the position axis 2 (an 8-bit cache's codes)."""
    return c[0] if isinstance(c, tuple) else c


def _head_dim(kc: Buffer, vc: Buffer) -> int:
    """D: a float cache's last axis; an 8-bit cache's codes hold 4 a uint32 word, a 4-bit
    cache's values 8 (its keys: the tail's last axis)."""
    kind = _cache_kind(kc)
    return (kc.shape[-1] if kind == "float" else  # type: ignore[union-attr]
            _codes(vc).shape[-1] * (8 if kind == "q4" else 4))


def _act_dtype(c: Buffer) -> mx.Dtype:
    """The activation dtype T: a float cache's, an 8-bit cache's scales'."""
    return c[1].dtype if isinstance(c, tuple) else c.dtype


def _quant_consts(kc: Buffer, vc: Buffer, d: int) -> list[tuple[str, Any]]:
    """A quantized cache's value group size GS and rotation constant PR (kv_cache.rotate's
    1/sqrt(P) as float32 bits, P the largest power of two dividing D); a 4-bit cache's key
    groups a channel's row KG (1 in a block pool), positions a key group KGP and tail slots KT:
    none for a float cache."""
    if not isinstance(kc, tuple) or not isinstance(vc, tuple):
        return []
    consts = [("GS", d // vc[1].shape[-1]), ("PR", kernels.float_bits(1 / math.sqrt(d & -d)))]
    if len(kc) == 4:
        consts += [("KG", kc[1].shape[-1]), ("KGP", KEY_GROUP), ("KT", kc[3].shape[2])]
    return consts


def _attend_consts(prm: tuple[float, float, float]) -> list[tuple[str, int]]:
    """prm = (eps, softmax scale, RoPE attention scale) as the template constants PE, PQ, PA."""
    eps, qscale, ascale = prm
    return [("PE", kernels.float_bits(eps)), ("PQ", kernels.float_bits(qscale)),
            ("PA", kernels.float_bits(ascale))]


def _split_source(form: str, cache: str) -> str:
    """The split kernel's body for a form (_attend_split_kernel's) and cache ("float", "q8",
    "q4")."""
    write = _WRITE_OUT if form == "merged" else _WRITE_PART
    fill = dict({"float": _FLOAT_CACHE, "q8": _Q8_CACHE, "q4": _Q4_CACHE}[cache])
    fill["/*AFTER*/"] = fill["/*AFTER*/"].replace("/*WRITE*/", write)
    # after AFTER's: it holds a /*WRITE*/
    fill["/*WRITE*/"] = write if cache == "float" else _Q8_STASH
    fill["/*TAIL*/"] = "" if form == "merged" else _MERGE_LAST
    fill["/*EMPTY*/"] = "" if form == "merged" else _EMPTY_PART
    source = _ATTEND_SPLIT
    for place, text in (_Q4_KEYS if cache == "q4" else _ROW_KEYS).items():  # hold /*LOAD*/
        source = source.replace(place, text)
    for place in ("/*AFTER*/", "/*WRITE*/", *fill):
        source = source.replace(place, fill[place])
    return source


@kernels.kernel_factory
def _attend_split_kernel(form: str, joined: bool, norms: tuple[bool, bool], paged: bool = False,
                         cache: str = "float") -> Any:
    """form "merged": S = 1, the block writes the output; else it writes the split's partial
    and the last block of its head group merges them, the partials in the module's scratch
    ("scratch") or in three more outputs ("outputs"). joined / norms: the inputs
    (_attend_inputs). cache: "float", "q8" (_Q8_CACHE) or "q4" (_Q4_CACHE)."""
    scratch = form == "scratch"
    return kernels.cuda_kernel(
        name={"merged": "fuselm_rope_attend_split1", "scratch": "fuselm_rope_attend_split",
              "outputs": "fuselm_rope_attend_split_out"}[form]
        + _attend_suffix(joined, norms, paged, cache),
        input_names=_attend_inputs(joined, norms, paged, cache),
        output_names=["out", "pm", "pl", "pacc"] if form == "outputs" else ["out"],
        source=_attend_prelude(joined, norms, paged, cache) + (_SCRATCH_PARTS if scratch else "")
        + _split_source(form, cache),
        header=_HEADER + _VEC_HEADER + ("" if cache == "float" else _Q8_HEADER)
        + (_Q4_HEADER if cache == "q4" else "")
        + ("" if form == "merged" else _TICKETS) + (_SCRATCH if scratch else ""))


def split_heads_per_block(hq: int, hk: int, head_dim: int) -> int:
    """GB: the most query heads of one KV head a split block serves (K/V read once for them)
    whose q and accumulator fit a lane's register budget (GB * D / 32 <= 16 floats each)."""
    group = hq // hk
    return max(gb for gb in range(1, group + 1)
               if group % gb == 0 and gb * (head_dim // 32) <= _SPLIT_LANE_FLOATS)


def _rope_attend_split(q: mx.array, k: mx.array, v: mx.array, qn: mx.array | None,
                       kn: mx.array | None, inv_freq: mx.array,
                       prm: tuple[float, float, float], offset: mx.array, kc: Buffer,
                       vc: Buffer, *, hq: int, hk: int, rotary_dim: int, interleaved: bool,
                       splits: int, rows_at: list[Any], joined: bool,
                       warps: int = _SPLIT_WARPS, keys: int | None = None,
                       table: mx.array | None = None,
                       tails: mx.array | None = None) -> mx.array:
    d, dtype, rows = _head_dim(kc, vc), _act_dtype(kc), q.shape[0]
    q4 = _cache_kind(kc) == "q4"
    if keys is None:
        keys = _Q4_SPLIT_KEYS if q4 else _SPLIT_KEYS
    elif q4 and keys not in _Q4_STEPS:
        raise ValueError(f"split_keys {keys}: the 4-bit form takes a step of {_Q4_STEPS} keys")
    gb = split_heads_per_block(hq, hk, d)
    blocks = hk * (hq // hk // gb) * splits
    form = ("merged" if splits == 1 else
            "scratch" if rows * hq * splits * (d + 2) <= SPLIT_SCRATCH else "outputs")
    partials = form == "outputs"
    outs = _attend_split_kernel(form, joined, (qn is not None, kn is not None),
                                table is not None, _cache_kind(kc))(
        inputs=_attend_args(q, k, v, qn, kn, inv_freq, offset, kc, vc, joined, table, tails),
        template=[("T", dtype), ("D", d), ("HQ", hq), ("HK", hk), ("RD", rotary_dim),
                  ("INTERLEAVED", interleaved), ("HAS_QN", qn is not None),
                  ("HAS_KN", kn is not None), ("NW", warps), ("GB", gb), ("S", splits),
                  ("KB", keys), *rows_at, *_attend_consts(prm), *_table_consts(vc, table),
                  *_quant_consts(kc, vc, d)],
        grid=(blocks * warps * 32, rows, 1), threadgroup=(warps * 32, 1, 1),
        output_shapes=[(rows, 1, hq * d)] + (
            [(rows, hq, splits), (rows, hq, splits), (rows, hq, splits, d)] if partials else []),
        output_dtypes=[dtype] + ([mx.float32] * 3 if partials else []))
    return outs[0]


@kernels.kernel_factory
def _add_rms_norm_kernel() -> Any:
    return kernels.cuda_kernel(
        name="fuselm_add_rms_norm", input_names=["x", "r", "w"],
        output_names=["h", "y"], source=_ADD_RMS_NORM, header=_HEADER)


@kernels.kernel_factory
def _rope_attend_kernel(joined: bool, norms: tuple[bool, bool], paged: bool = False) -> Any:
    """joined / norms / paged: the inputs (_attend_inputs)."""
    return kernels.cuda_kernel(
        name="fuselm_rope_attend" + _attend_suffix(joined, norms, paged),
        input_names=_attend_inputs(joined, norms, paged), output_names=["out"],
        source=_attend_prelude(joined, norms, paged) + _ROPE_ATTEND, header=_HEADER)


def add_rms_norm(x: mx.array, r: mx.array, w: mx.array, eps: float
                 ) -> tuple[mx.array, mx.array]:
    """x, r: [..., H] of one dtype (row-contiguous); w: [H]; eps: >= 0, passed as the template
    constant EPSB (kernels.float_bits: no input array, ~0.4 µs of MLX-CUDA host time less)."""
    hidden = x.shape[-1]
    rows = x.size // hidden
    block = 1024 if hidden >= 4096 else 256
    h, y = _add_rms_norm_kernel()(
        inputs=[x, r, w], template=[("T", x.dtype), ("H", hidden), ("BLOCK", block),
                                    ("EPSB", kernels.float_bits(eps))],
        grid=(rows * block, 1, 1), threadgroup=(block, 1, 1),
        output_shapes=[x.shape, x.shape], output_dtypes=[x.dtype, x.dtype])
    return h, y


def rope_attend(q: mx.array, k: mx.array, v: mx.array, qn: mx.array | None,
                kn: mx.array | None, inv_freq: mx.array, prm: tuple[float, float, float],
                offset: mx.array, kc: Buffer, vc: Buffer, *, hq: int, hk: int,
                rotary_dim: int, interleaved: bool, splits: int | None = None,
                split_warps: int = _SPLIT_WARPS, split_keys: int | None = None,
                qkv: mx.array | None = None, table: mx.array | None = None,
                tails: mx.array | None = None) -> tuple[mx.array, Buffer, Buffer]:
    """One token per batch row: q [b, 1, hq*D], k/v [b, 1, hk*D], the caches
    [b, hk, capacity, D], row i holding positions 0..offset[i]-1 (offset: int32 [b]); or,
    with a block `table` (int32 [b, W]: kv_cache.BlockCache), the caches are block pools
    [blocks, hk, BLOCK, D] and row i's position j lies in block table[i, j // BLOCK]
    (capacity W * BLOCK).
    prm = (eps, softmax scale, RoPE attention scale): Python floats, each finite with the sign
    bit clear (kernels.takes_float_bits), passed as template constants (kernels.float_bits),
    not an input array. qn / kn: the q/k-norm scales [D], or None (no norm: no input either).
    Returns the attention output [b, 1, hq*D] and the caches kc, vc themselves: the kernel
    wrote each row's new key/value (RoPE'd, normed) at position offset[i] IN PLACE, so no
    scatter launch follows.

    In place means outside MLX's value semantics: the caller must own kc/vc (the compiled
    program's cache buffers: row-contiguous, so MLX passes them uncopied) and give up the
    old value, as a donated buffer would be; later readers of the cache depend on this step
    through the decoded token, so they run after the write. Rows past offset[i] are never
    read by this call, so the write races with no reader.

    splits: 0 = one block per query head (_ROPE_ATTEND); N >= 1 = the split kernel over N key
    splits (_ATTEND_SPLIT), one launch either way; None: kernels.auto_splits (from the
    capacity and heads; the default, FUSELM_ATTN_SPLIT=auto). split_warps / split_keys: the split
    kernel's warps per block and keys per warp step in flight (benchmarks/kernel_bench.py
    compares them; the defaults are what the program runs; split_keys None: 4, the 4-bit
    form's 16, which takes 8, 16 or 32 only).

    qkv: the fused projection [b, 1, (hq + 2 hk) * D] that q, k and v are slices of: the
    kernel reads them from it (q, k, v then only give the shapes), so the three slices are
    not in the step's graph (a Qwen3-0.6B step: 274 nodes -> 151 with the other reshapes gone;
    the H200 host's dispatch time did not change: it follows kernel launches, not nodes). It
    is the launch's one input for all three (k and v alias it in the kernel).

    kc / vc 8-bit (each a kv_cache.KVQuant triple of bits 8: codes, scales, biases, the same
    leading axes; rows stored rotated): the split kernel's 8-bit form (_Q8_CACHE; splits 0 runs
    it with one split): q and the new k and v rotated, the new rows quantized as mx.quantize
    does and written in place (codes, scales and biases, the same ownership as above), the
    keys read as code * scale + bias, the output rotated back; what the plain path
    (attention.Attention.over_cache) computes over the same buffers.

    kc a 4-bit cache's per-channel keys (kv_cache.key_groups_zeros' four arrays, or a block
    pool's, key_blocks_zeros', with `tails`: int32 [b], each row's tail slot, BlockIndex.tails)
    and vc its 4-bit values: the split kernel's 4-bit form (_Q4_CACHE), for a step in which no
    row's write completes a key group (over_cache's seal=False; the caller knows the offsets):
    the new key written into the row's float tail, the new value row rotated, quantized and
    written in place, the keys of each row's open group read from the tail, the others from
    their per-channel codes, as Attention._channels reads them."""
    d, rows = _head_dim(kc, vc), q.shape[0]
    capacity = _codes(vc).shape[2] * (1 if table is None else table.shape[1])
    joined = qkv is not None
    if qkv is not None:
        q = k = v = qkv
        rows_at = [("QRW", qkv.shape[-1]), ("KRW", qkv.shape[-1]), ("KO", hq * d),
                   ("VO", (hq + hk) * d)]
    else:
        rows_at = [("QRW", hq * d), ("KRW", hk * d), ("KO", 0), ("VO", 0)]
    gb = split_heads_per_block(hq, hk, d)
    n_split = (kernels.auto_splits(capacity, hk, hq // hk // gb)
               if splits is None else splits)
    if n_split > 1 and rows * hq // gb > TICKET_SLOTS:
        n_split = 0  # more head groups than tickets (a batch of thousands): no split
    if isinstance(kc, tuple):  # quantized: the split kernel's forms only (one split at least)
        n_split = max(n_split, 1)
    if n_split > 0:
        out = _rope_attend_split(q, k, v, qn, kn, inv_freq, prm, offset, kc, vc, hq=hq, hk=hk,
                                 rotary_dim=rotary_dim, interleaved=interleaved,
                                 splits=n_split, rows_at=rows_at, joined=joined,
                                 warps=split_warps, keys=split_keys, table=table,
                                 tails=tails)
        return out, kc, vc
    warps = 32 if d <= 128 else 16  # 1024 threads need <= 64 registers each; wide heads use more
    (out,) = _rope_attend_kernel(joined, (qn is not None, kn is not None), table is not None)(
        inputs=_attend_args(q, k, v, qn, kn, inv_freq, offset, kc, vc, joined, table),
        template=[("T", kc.dtype), ("D", d), ("HQ", hq), ("HK", hk), ("RD", rotary_dim),
                  ("INTERLEAVED", interleaved), ("HAS_QN", qn is not None),
                  ("HAS_KN", kn is not None), ("NW", warps), *rows_at, *_attend_consts(prm),
                  *_table_consts(kc, table)],
        grid=(hq * warps * 32, rows, 1), threadgroup=(warps * 32, 1, 1),
        output_shapes=[(rows, 1, hq * d)], output_dtypes=[kc.dtype])
    return out, kc, vc
