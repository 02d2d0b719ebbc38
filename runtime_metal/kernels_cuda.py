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

The plain-MLX paths they replace are in runtime_metal/program_ops.py, eligibility and the
on/off switch in runtime_metal/kernels.py, the equivalence tests in
tests/runtime/test_kernels.py. Arithmetic is float32 with the same
roundings to the activation dtype as the plain path (after the Add, after the norm, after
RoPE), so the two agree to a few units in the last place of that dtype.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import mlx.core as mx

from fuselm.runtime_metal import kernels

_HEADER = """
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
  return v;
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
  const float rs = rsqrtf(part[0] / H + eps[0]);
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
  __shared__ float sq[D], sk[D], sv[D], tq[D], tk[D], rs[2];
  __shared__ float wm[NW], wl[NW], wacc[NW][D];
  if (tid < D) {
    sq[tid] = static_cast<float>(q[qh * D + tid]);
    sk[tid] = static_cast<float>(k[kh * D + tid]);
    sv[tid] = static_cast<float>(v[kh * D + tid]);
  }
  __syncthreads();
  if (warp < 2) {  // warp 0: q's sum of squares, warp 1: k's
    const float* src = warp == 0 ? sq : sk;
    float ss = 0.f;
    for (int i = lane; i < D; i += 32) ss += src[i] * src[i];
    ss = warp_sum(ss);
    if (lane == 0) rs[warp] = rsqrtf(ss / D + prm[0]);
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
      if (INTERLEAVED) {
        m = tid >> 1; partner = tid ^ 1; sign = (tid & 1) ? 1.f : -1.f;
      } else {
        constexpr int HALF = RD / 2;
        m = tid < HALF ? tid : tid - HALF;
        partner = tid < HALF ? tid + HALF : tid - HALF;
        sign = tid < HALF ? -1.f : 1.f;
      }
      const float th = static_cast<float>(pos) * inv_freq[m];
      const float c = cosf(th), s = sinf(th);
      a = (a * c + sign * tq[partner] * s) * prm[2];
      b = (b * c + sign * tk[partner] * s) * prm[2];
    }
    const T qa = T(a), kb = T(b), vb = T(sv[tid]);
    sq[tid] = static_cast<float>(qa) * prm[1];  // the softmax scale, folded into q
    sk[tid] = static_cast<float>(kb);
    sv[tid] = static_cast<float>(vb);
    if (h % G == 0) {  // the new row goes into the cache in place (see rope_attend)
      const_cast<T*>(kc)[(kh * cap + pos) * D + tid] = kb;
      const_cast<T*>(vc)[(kh * cap + pos) * D + tid] = vb;
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
  const T* kb = kc + kh * cap * D;
  const T* vb = vc + kh * cap * D;
  for (int j = warp; j <= pos; j += NW) {  // online softmax over this warp's keys
    float kr[VPT], vr[VPT];
    if (j < pos) {
      for (int e = 0; e < VPT; ++e) {
        kr[e] = static_cast<float>(kb[(size_t)j * D + lane * VPT + e]);
        vr[e] = static_cast<float>(vb[(size_t)j * D + lane * VPT + e]);
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

# KB keys per warp step (kernels.attend_keys > 1); the rest of the kernel is the same.
_KEYS_MANY = """  float m = __int_as_float(0xff800000), l = 0.f;  // -infinity
  const T* kb = kc + kh * cap * D;
  const T* vb = vc + kh * cap * D;
  // KB keys of this warp at a time (warp*KB .. +KB, then NW*KB further on): all their loads
  // are issued before the first score needs one; the KB shuffle reductions interleave.
  for (int j0 = warp * KB; j0 <= pos; j0 += NW * KB) {
    float kr[KB][VPT], vr[KB][VPT], s[KB];
    #pragma unroll
    for (int u = 0; u < KB; ++u) {
      const int j = j0 + u;
      #pragma unroll
      for (int e = 0; e < VPT; ++e) {
        if (j < pos) {
          kr[u][e] = static_cast<float>(kb[(size_t)j * D + lane * VPT + e]);
          vr[u][e] = static_cast<float>(vb[(size_t)j * D + lane * VPT + e]);
        } else if (j == pos) {  // the token being decoded: not in the cache yet
          kr[u][e] = sk[lane * VPT + e];
          vr[u][e] = sv[lane * VPT + e];
        } else {  // past the position: nothing read, weighed 0 below
          kr[u][e] = 0.f;
          vr[u][e] = 0.f;
        }
      }
    }
    #pragma unroll
    for (int u = 0; u < KB; ++u) {
      float d = 0.f;
      #pragma unroll
      for (int e = 0; e < VPT; ++e) d += qr[e] * kr[u][e];
      s[u] = d;
    }
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1)
      #pragma unroll
      for (int u = 0; u < KB; ++u) s[u] += __shfl_xor_sync(0xffffffff, s[u], o);
    float mn = m;  // j0 <= pos: the first key counts, so mn is finite
    #pragma unroll
    for (int u = 0; u < KB; ++u)
      if (j0 + u <= pos) mn = fmaxf(mn, s[u]);
    const float corr = __expf(m - mn);
    l *= corr;
    #pragma unroll
    for (int e = 0; e < VPT; ++e) acc[e] *= corr;
    #pragma unroll
    for (int u = 0; u < KB; ++u) {
      if (j0 + u <= pos) {
        const float p = __expf(s[u] - mn);
        l += p;
        #pragma unroll
        for (int e = 0; e < VPT; ++e) acc[e] += p * vr[u][e];
      }
    }
    m = mn;
  }
"""

_ROPE_ATTEND = _ROPE_ATTEND_BODY.replace("/*KEYS*/", _KEYS_ONE)
_ROPE_ATTEND_MANY = _ROPE_ATTEND_BODY.replace("/*KEYS*/", _KEYS_MANY)

@cache
def _add_rms_norm_kernel() -> Any:
    return mx.fast.cuda_kernel(
        name="fuselm_add_rms_norm", input_names=["x", "r", "w", "eps"],
        output_names=["h", "y"], source=_ADD_RMS_NORM, header=_HEADER)


@cache
def _rope_attend_kernel(many: bool = False) -> Any:
    return mx.fast.cuda_kernel(
        name="fuselm_rope_attend_keys" if many else "fuselm_rope_attend",
        input_names=["q", "k", "v", "qn", "kn", "inv_freq", "prm", "offset", "kc", "vc"],
        output_names=["out"], source=_ROPE_ATTEND_MANY if many else _ROPE_ATTEND,
        header=_HEADER)


def add_rms_norm(x: mx.array, r: mx.array, w: mx.array, eps: mx.array
                 ) -> tuple[mx.array, mx.array]:
    """x, r: [..., H] of one dtype (row-contiguous); w: [H]; eps: float32 [1]."""
    hidden = x.shape[-1]
    rows = x.size // hidden
    block = 1024 if hidden >= 4096 else 256
    h, y = _add_rms_norm_kernel()(
        inputs=[x, r, w, eps], template=[("T", x.dtype), ("H", hidden), ("BLOCK", block)],
        grid=(rows * block, 1, 1), threadgroup=(block, 1, 1),
        output_shapes=[x.shape, x.shape], output_dtypes=[x.dtype, x.dtype])
    return h, y


def rope_attend(q: mx.array, k: mx.array, v: mx.array, qn: mx.array | None,
                kn: mx.array | None, inv_freq: mx.array, prm: mx.array, offset: mx.array,
                kc: mx.array, vc: mx.array, *, hq: int, hk: int, rotary_dim: int,
                interleaved: bool, keys_per_step: int | None = None
                ) -> tuple[mx.array, mx.array, mx.array]:
    """One token per batch row: q [b, 1, hq*D], k/v [b, 1, hk*D], the caches
    [b, hk, capacity, D], row i holding positions 0..offset[i]-1 (offset: int32 [b]).
    prm = float32 [eps, softmax scale, RoPE attention scale]. Returns the attention output
    [b, 1, hq*D] and the caches kc, vc themselves: the kernel wrote each row's new key/value
    (RoPE'd, normed) at position offset[i] IN PLACE, so no scatter launch follows.

    In place means outside MLX's value semantics: the caller must own kc/vc (the compiled
    program's cache buffers: row-contiguous, so MLX passes them uncopied) and give up the
    old value, as a donated buffer would be; later readers of the cache depend on this step
    through the decoded token, so they run after the write. Rows past offset[i] are never
    read by this call, so the write races with no reader.

    keys_per_step: keys each warp loads at once (None: kernels.attend_keys(), the
    environment's; 1 is the kernel measured and tested on the H200)."""
    d, rows = kc.shape[-1], kc.shape[0]
    warps = 32 if d <= 128 else 16  # 1024 threads need <= 64 registers each; wide heads use more
    kb = kernels.attend_keys() if keys_per_step is None else keys_per_step
    extra: list[tuple[str, Any]] = []
    if kb > 1:
        # KB rows of K and V in registers: half the warps (each thread may then use twice
        # the registers); NW/2 * KB keys in flight per block: as many as before at KB = 2,
        # twice as many at 4
        warps //= 2
        extra = [("KB", kb)]
    dummy = inv_freq
    (out,) = _rope_attend_kernel(kb > 1)(
        inputs=[q, k, v, qn if qn is not None else dummy, kn if kn is not None else dummy,
                inv_freq, prm, offset, kc, vc],
        template=[("T", kc.dtype), ("D", d), ("HQ", hq), ("HK", hk), ("RD", rotary_dim),
                  ("INTERLEAVED", interleaved), ("HAS_QN", qn is not None),
                  ("HAS_KN", kn is not None), ("NW", warps), *extra],
        grid=(hq * warps * 32, rows, 1), threadgroup=(warps * 32, 1, 1),
        output_shapes=[(rows, 1, hq * d)], output_dtypes=[kc.dtype])
    return out, kc, vc
