"""Attention, defined once: what ONNX `Attention` (opset 23) means, for the node-by-node
executor (ops/attention.py, over a past/present pair or a bound KVCache) and for the compiled
program (program_ops.py, over fixed-capacity cache buffers written at a device offset), with
one or many sequences (batch.py: one offset per row, the cache read and written through each
row's block table).

GQA runs without repeating K/V (MLX's SDPA takes fewer KV heads); prefill uses the fused kernel
with no materialized QK/softmax (seed steps 5 and 11). Semantics that MLX's fused kernel lacks
(softcap) take the explicit softmax path here; new per-layer attributes belong on `Attention`.
A quantized KV cache (kv_cache.KVQuant) is read as it is stored: q·Kᵀ and p·V are MLX's
quantized matmuls over the packed keys and values (mlx-lm's quantized attention), softmax in
between; no float copy of the cache is made. Its rows are stored rotated (kv_cache.rotate):
the queries are rotated alike, which leaves q·kᵀ as it was, and the output, a mix of rotated
values, is rotated back. A 4-bit cache's keys are stored per channel, unrotated, a group
quantized once it is full (kv_cache.write_key_groups): q·Kᵀ is then the quantized matmul over
the transposed keys, with the queries as they are, each query's own open group read from the
float keys of the write, the values' side unchanged. On MLX-CUDA, whose quantized matmul
lacks most of these shapes, a layer's keys and values are dequantized (values still rotated)
for its attention instead; there (with FUSELM_KV_ATTN on) a decode step over an 8-bit cache
takes the fused kernel (program_ops.rope_attention: cuda_kernels/sources.py), which reads the
codes directly, and so does one over a 4-bit cache whose write completes no key group
(`seal=False`: what `_channels` reads, the open group from the tail, the rest from the codes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from fuselm.runtime_metal.cuda_kernels.selection import cuda_device
from fuselm.runtime_metal.kv_cache import (
    KEY_GROUP,
    BlockIndex,
    Buffer,
    RecentKeys,
    block_recent,
    first,
    is_key_groups,
    key_group_values,
    positions,
    read_blocks,
    recent_keys,
    rotate,
    spec_of,
    stored_values,
    unrotate,
    write_blocks,
    write_rows,
)

Mask = mx.array | str | None  # bool (True = attend) or additive; "causal"; None = all visible


def to_heads(x: mx.array, heads: int) -> mx.array:
    """[b, s, H*D] -> [b, H, s, D]; 4-D inputs are already [b, H, s, D]."""
    if x.ndim == 4:
        return x
    b, s, hidden = x.shape
    return x.reshape(b, s, heads, hidden // heads).transpose(0, 2, 1, 3)


def from_heads(y: mx.array) -> mx.array:
    """[b, H, s, D] -> [b, s, H*D]."""
    b, h, s, d = y.shape
    return y.transpose(0, 2, 1, 3).reshape(b, s, h * d)


def additive(mask: mx.array, dtype: mx.Dtype) -> mx.array:
    if mask.dtype == mx.bool_:
        return mx.where(mask, mx.array(0, dtype), mx.array(-mx.inf, dtype))
    return mask.astype(dtype)


def causal(q_len: int, total: int, past: int) -> np.ndarray:
    """Query i (position past + i) sees key j iff j <= past + i."""
    return np.tri(q_len, total, past, dtype=bool)


@dataclass(frozen=True)
class Attention:
    q_heads: int
    kv_heads: int
    scale: float | None = None  # None: 1/sqrt(head_dim)
    softcap: float = 0.0  # tanh soft-capping of the scores (0: off)
    is_causal: bool = False

    @classmethod
    def from_attrs(cls, attrs: dict[str, object]) -> Attention:
        scale = attrs.get("scale")
        return cls(int(attrs.get("q_num_heads") or 1),  # type: ignore[call-overload]
                   int(attrs.get("kv_num_heads") or 1),  # type: ignore[call-overload]
                   None if scale is None else float(scale),  # type: ignore[arg-type]
                   float(attrs.get("softcap", 0.0) or 0.0),  # type: ignore[arg-type]
                   bool(int(attrs.get("is_causal", 0) or 0)))  # type: ignore[call-overload]

    def scale_for(self, head_dim: int) -> float:
        return self.scale if self.scale is not None else 1.0 / math.sqrt(head_dim)

    def heads(self, q: mx.array, k: mx.array, v: mx.array
              ) -> tuple[mx.array, mx.array, mx.array]:
        return to_heads(q, self.q_heads), to_heads(k, self.kv_heads), to_heads(v, self.kv_heads)

    def attend(self, qh: mx.array, kh: Buffer, vh: Buffer, mask: Mask,
               may_empty: bool = True, recent: RecentKeys | None = None) -> mx.array:
        """softmax(q·kᵀ·scale [+ mask]) · v over [b, H, s, D] heads; returns [b, Hq, s, D].
        A query that may attend nothing yields zeros (ONNX), not softmax's NaNs; a caller whose
        mask always shows a query its own key says `may_empty=False` and skips that check.
        kh/vh quantized (kv_cache.Buffer triples, rows rotated): the quantized path, over
        rotated queries, its output rotated back. kh a per-channel key buffer: `_channels`,
        with `recent` (kv_cache.recent_keys of the write just made) for the queries' own
        groups."""
        sc = self.scale_for(qh.shape[-1])
        if isinstance(mask, mx.array) and mask.dtype not in (mx.bool_, qh.dtype):
            mask = mask.astype(qh.dtype)
        if is_key_groups(kh):
            if isinstance(mask, str):
                n, t = qh.shape[2], positions(vh)
                mask = mx.array(causal(n, t, t - n))
            y = unrotate(self._channels(qh, kh, vh, mask, sc, recent))  # type: ignore[arg-type]
            if may_empty and isinstance(mask, mx.array) and mask.dtype == mx.bool_:
                y = mx.where(mask.any(axis=-1, keepdims=True), y, mx.zeros((), y.dtype))
            return y
        rotated = isinstance(kh, tuple)
        if rotated:
            qh = rotate(qh)
        if rotated and cuda_device():
            # MLX-CUDA's quantized matmul has no kernel for most of attention's shapes (a
            # prefill chunk's queries, a batch's grouped heads: "No implementation for problem
            # shape"): there the cache is read dequantized, one layer's keys and values at a
            # time, in the basis it is stored in; it stays stored quantized
            group = spec_of(kh, qh.shape[-1]).group_size  # type: ignore[arg-type]
            vdim = vh[1].shape[-1] * group  # type: ignore[index]
            kh, vh = stored_values(kh, qh.shape[-1]), stored_values(vh, vdim)
        if isinstance(kh, tuple) or isinstance(vh, tuple):
            if isinstance(mask, str):
                n, t = qh.shape[2], positions(kh)
                mask = mx.array(causal(n, t, t - n))
            y = self._quantized(qh, kh, vh, mask, sc)
        elif self.softcap > 0:
            if isinstance(mask, str):
                n, t = qh.shape[2], kh.shape[2]
                mask = mx.array(causal(n, t, t - n))
            y = self._explicit(qh, kh, vh, mask, sc)
        else:
            y = mx.fast.scaled_dot_product_attention(qh, kh, vh, scale=sc, mask=mask)
        if rotated:
            y = unrotate(y)
        if may_empty and isinstance(mask, mx.array) and mask.dtype == mx.bool_:
            y = mx.where(mask.any(axis=-1, keepdims=True), y, mx.zeros((), y.dtype))
        return y

    def _explicit(self, q: mx.array, k: mx.array, v: mx.array, mask: mx.array | None,
                  scale: float) -> mx.array:
        """The materialized softmax(QKᵀ) path, for softcap (MLX's fused kernel has none)."""
        hq, hk = q.shape[1], k.shape[1]
        if hq != hk:
            k = mx.repeat(k, hq // hk, axis=1)
            v = mx.repeat(v, hq // hk, axis=1)
        scores = (q.astype(mx.float32) * scale) @ k.astype(mx.float32).swapaxes(-1, -2)
        if self.softcap > 0:
            scores = mx.tanh(scores / self.softcap) * self.softcap
        if mask is not None:
            scores = scores + additive(mask, mx.float32)
        return (mx.softmax(scores, axis=-1) @ v.astype(mx.float32)).astype(q.dtype)

    def _quantized(self, q: mx.array, k: Buffer, v: Buffer, mask: mx.array | None,
                   scale: float) -> mx.array:
        """softmax(q·kᵀ·scale [+ mask]) · v with K and V read as stored (quantized triples):
        MLX's quantized matmul for both products (in the cache's dtype, softmax in float32,
        as mlx-lm's), GQA by a head-group axis (no repeat), softcap applied when set."""
        assert isinstance(k, tuple) and isinstance(v, tuple)
        b, hq, s, d = q.shape
        hk = k[0].shape[1]
        dt = k[1].dtype
        qg = (q * scale).astype(dt).reshape(b, hk, hq // hk, s, d)
        kq = spec_of(k, d)
        vq = spec_of(v, v[1].shape[-1] * kq.group_size)
        scores = mx.quantized_matmul(qg, *[a[:, :, None] for a in k], transpose=True,
                                     group_size=kq.group_size, bits=kq.bits)
        return self._weigh_values(scores, v, vq.group_size * v[1].shape[-1], mask, q)

    def _weigh_values(self, scores: mx.array, v: tuple[mx.array, ...], vdim: int,
                      mask: mx.array | None, q: mx.array) -> mx.array:
        """The quantized paths' shared tail, from scores [b, Hk, Hq/Hk, s, t]: softcap, the
        mask onto the head-group axes, softmax in float32, p·V over the values as stored
        (quantized triples of `vdim` values a row; on MLX-CUDA, which lacks that kernel, over
        their dequantized values); [b, Hq, s, D] in q's dtype."""
        b, hq, s, _ = q.shape
        hk = scores.shape[1]
        if self.softcap > 0:
            scores = mx.tanh(scores / self.softcap) * self.softcap
        if mask is not None:
            m = mask  # [.., s, t], or 4-D [b, 1 or Hq, s, t]: onto the head-group axes
            if m.ndim == 4:
                m = (mx.expand_dims(m, 2) if m.shape[1] == 1
                     else m.reshape(m.shape[0], hk, hq // hk, *m.shape[2:]))
            scores = scores + additive(m, scores.dtype)
        p = mx.softmax(scores, axis=-1, precise=True)
        if cuda_device():
            y = p @ stored_values(v, vdim)[:, :, None]
        else:
            vq = spec_of(v, vdim)
            y = mx.quantized_matmul(p, *[a[:, :, None] for a in v], transpose=False,
                                    group_size=vq.group_size, bits=vq.bits)
        return y.reshape(b, hq, s, y.shape[-1]).astype(q.dtype)

    def _channels(self, q: mx.array, k: tuple[mx.array, ...], v: tuple[mx.array, ...],
                  mask: mx.array | None, scale: float, recent: RecentKeys | None
                  ) -> mx.array:
        """Attention over a 4-bit cache: keys per channel (kv_cache.write_key_groups,
        unrotated: the queries as they are), values per token (rotated: the output is in
        their basis). A query reads its own key group in float (`recent`) until that group is
        full, the other groups as stored, so each query's scores depend on the keys at or
        before it alone, as in a single step: a speculative check of several positions, a
        prefill chunk and one token a step read the same keys. q·Kᵀ is MLX's quantized
        matmul over the transposed keys, p·V over the values (on MLX-CUDA, which lacks those
        kernels, over their dequantized values, a layer at a time); softmax in float32."""
        b, hq, s, d = q.shape
        hk, dt, t = k[0].shape[1], k[1].dtype, positions(v)
        qg = (q * scale).astype(dt).reshape(b, hk, hq // hk, s, d)
        if cuda_device():
            scores = qg @ key_group_values(k, t)[:, :, None].swapaxes(-1, -2)
        else:
            scores = mx.quantized_matmul(qg, *[a[:, :, None] for a in k[:3]], transpose=False,
                                         group_size=KEY_GROUP, bits=4)[..., :t]
        if recent is not None:
            own = qg @ recent.keys.astype(dt)[:, :, None].swapaxes(-1, -2)  # [b,hk,g,s,L]
            span = recent.keys.shape[2]
            j = mx.arange(t, dtype=mx.int32)
            at = j[None] - recent.pos[:, :1]  # [1 or b, t]: the key's index in the span
            own = mx.take_along_axis(own, mx.broadcast_to(
                mx.clip(at, 0, span - 1)[:, None, None, None, :], scores.shape), axis=-1)
            qp = recent.query  # [1 or b, s]
            float_read = ((j // KEY_GROUP == (qp // KEY_GROUP)[..., None])
                          & ((qp % KEY_GROUP) != KEY_GROUP - 1)[..., None]
                          & ((at >= 0) & (at < span))[:, None])  # [1 or b, s, t]
            scores = mx.where(float_read[:, None, None], own, scores)
        return self._weigh_values(scores, v, v[0].shape[-1] * 8, mask, q)  # 4 bits: 8 a word

    def with_causal(self, mask: Mask, q_len: int, total: int, past: int) -> Mask:
        """The graph's mask combined with is_causal (ONNX: query i sees keys j <= past + i).
        MLX's "causal" aligns at the bottom right: the same when past = total - q_len."""
        if not self.is_causal:
            return mask
        if past == total - q_len and (mask is None or isinstance(mask, str)):
            return "causal"
        tri = mx.array(causal(q_len, total, past))
        if mask is None or isinstance(mask, str):
            return tri
        if mask.dtype == mx.bool_:
            return mx.logical_and(mask, tri)
        return mask + additive(tri, mask.dtype)

    def over_cache(self, q: mx.array, k: mx.array, v: mx.array, keys: Buffer,
                   values: Buffer, offset: mx.array, mask: Mask, rows: int | None = None,
                   blocks: BlockIndex | None = None, seal: bool = True
                   ) -> tuple[mx.array, Buffer, Buffer]:
        """The compiled program's form: the chunk's new K/V written into fixed-capacity buffers
        at `offset` (a scalar, or [b] per batch row), then attention over the whole buffer
        with `mask` ([.., s, capacity], built by the caller), or, for mask "causal", over the
        first `rows` cache rows (default s: a fresh prompt at offset 0; offset + s for a later
        chunk whose offset the caller knows), bottom-right aligned: MLX's fused causal path, no
        mask read, no work on rows past the chunk. With `blocks` (a step's kv_cache.BlockIndex
        over its table [n, W]), keys/values are block pools (kv_cache.BlockCache): each row's
        new positions go into its blocks, and attention reads the W blocks of each row,
        gathered, under `mask` [n, 1, s, W * BLOCK]. Quantized buffers (kv_cache.Buffer
        triples) are written and read the same way, the new rows quantized; `seal=False`:
        the caller knows that no row's write completes a per-channel key group (a 4-bit
        cache's; kv_cache.write_key_groups), so none is quantized. Returns (y, keys',
        values')."""
        if blocks is not None:  # new rows as the projection lays them out: no transpose
            k, v = (x if x.ndim == 3 else x.transpose(0, 2, 1, 3) for x in (k, v))
            recent = (block_recent(keys, k, blocks)  # type: ignore[arg-type]
                      if is_key_groups(keys) else None)
            keys = write_blocks(keys, k, blocks, seal, recent)
            values = write_blocks(values, v, blocks)
            y = self.attend(to_heads(q, self.q_heads), read_blocks(keys, blocks),
                            read_blocks(values, blocks), mask, may_empty=False, recent=recent)
            return (from_heads(y) if q.ndim == 3 else y), keys, values
        qh, kh, vh = self.heads(q, k, v)
        recent = recent_keys(keys, kh, offset) if is_key_groups(keys) else None  # type: ignore[arg-type]
        if isinstance(mask, str):
            n = rows if rows is not None else qh.shape[2]
            # the offset is n - s here, known when traced: a per-channel key write quantizes
            # the groups it completes alone (kv_cache.write_key_groups)
            at = n - qh.shape[2] if is_key_groups(keys) else offset
            keys, values = write_rows(keys, kh, at, seal), write_rows(values, vh, offset)
            y = self.attend(qh, first(keys, n), first(values, n), mask, may_empty=False,
                            recent=recent)
        else:
            keys, values = write_rows(keys, kh, offset, seal), write_rows(values, vh, offset)
            y = self.attend(qh, keys, values, mask, may_empty=False, recent=recent)
        return (from_heads(y) if q.ndim == 3 else y), keys, values
