"""ONNX Attention (opset 23) -> mx.fast.scaled_dot_product_attention (seed steps 5 and 11).

GQA runs without repeating K/V (MLX's SDPA takes fewer KV heads); prefill uses the fused
kernel with no materialized QK/softmax. Past/present KV: when the executor binds the node to a
preallocated cache (`_cache`), new K/V are written in place and present = the cache's view,
which is exactly concat(past, new) — the graph's meaning, without the copy.
"""

from __future__ import annotations

import math
from types import ModuleType

import mlx.core as mx
import numpy as np

from fuselm.runtime_metal.ops.registry import op

_MASK_MEMO: dict[int, tuple[object, object]] = {}


def _classify_host_mask(mask: np.ndarray, q_len: int, total: int) -> object:
    """A host bool mask that is all-true or exactly causal becomes None / "causal", so MLX runs
    its fused causal path; anything else (padding, sliding windows) stays an explicit mask.
    Layers share one mask value, so the answer is memoized per object."""
    hit = _MASK_MEMO.get(id(mask))
    if hit is not None and hit[0] is mask:
        return hit[1]
    result: object = mx.array(mask)
    if mask.shape[-1] == total and mask.shape[-2:] == (q_len, total):
        flat = mask.reshape(-1, q_len, total)
        causal = np.tri(q_len, total, total - q_len, dtype=bool)
        if flat.all():
            result = None
        elif (flat == causal).all():
            result = "causal"
    if len(_MASK_MEMO) > 8:
        _MASK_MEMO.clear()
    _MASK_MEMO[id(mask)] = (mask, result)
    return result


def _to_heads(x: mx.array, heads: int) -> mx.array:
    """[b, s, H*D] -> [b, H, s, D]; 4-D inputs are already [b, H, s, D]."""
    if x.ndim == 4:
        return x
    b, s, hidden = x.shape
    return x.reshape(b, s, heads, hidden // heads).transpose(0, 2, 1, 3)


def _additive(mask, dtype) -> mx.array:  # noqa: ANN001
    if mask.dtype == mx.bool_:
        return mx.where(mask, mx.array(0, dtype), mx.array(-mx.inf, dtype))
    return mask.astype(dtype)


def _reference_attention(q, k, v, mask, scale: float, softcap: float) -> mx.array:  # noqa: ANN001
    """Explicit softmax(QK^T) path, for softcap (MLX's fused kernel has none)."""
    hq, hk = q.shape[1], k.shape[1]
    if hq != hk:
        k = mx.repeat(k, hq // hk, axis=1)
        v = mx.repeat(v, hq // hk, axis=1)
    scores = (q.astype(mx.float32) * scale) @ k.astype(mx.float32).swapaxes(-1, -2)
    if softcap > 0:
        scores = mx.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores + _additive(mask, mx.float32)
    return (mx.softmax(scores, axis=-1) @ v.astype(mx.float32)).astype(q.dtype)


@op("", "Attention", since=23)
def attention(  # noqa: ANN201, PLR0913
    xp: ModuleType, q, k, v, attn_mask=None, past_key=None, past_value=None,  # noqa: ANN001
    nonpad_kv_seqlen=None, *, q_num_heads: int | None = None,  # noqa: ANN001
    kv_num_heads: int | None = None, scale: float | None = None, is_causal: int = 0,
    softcap: float = 0.0, qk_matmul_output_mode: int = 0, softmax_precision: int = 0,
    _cache=None, _n_outputs: int = 1,  # noqa: ANN001
):
    if _n_outputs > 3:
        raise NotImplementedError("Attention: the qk_matmul_output output is not supported")
    if nonpad_kv_seqlen is not None:
        raise NotImplementedError("Attention: nonpad_kv_seqlen (opset 24) is not supported")
    three_d = q.ndim == 3
    qh = _to_heads(q, q_num_heads or 1)
    kh = _to_heads(k, kv_num_heads or 1)
    vh = _to_heads(v, kv_num_heads or 1)
    if _cache is not None:
        kh, vh = _cache.update_and_fetch(kh, vh)
        past_len = kh.shape[2] - qh.shape[2]
    else:
        past_len = 0 if past_key is None else past_key.shape[2]
        if past_key is not None:
            kh = mx.concatenate([past_key, kh], axis=2)
        if past_value is not None:
            vh = mx.concatenate([past_value, vh], axis=2)
    q_len, total = qh.shape[2], kh.shape[2]
    sc = scale if scale is not None else 1.0 / math.sqrt(qh.shape[-1])

    mask = attn_mask
    if mask is not None and mask.shape[-1] < total:  # ONNX pads a short mask with "masked"
        pad = [(0, 0)] * (mask.ndim - 1) + [(0, total - mask.shape[-1])]
        if isinstance(mask, np.ndarray):
            mask = np.pad(mask, pad, constant_values=False if mask.dtype == bool else -np.inf)
        else:
            mask = mx.pad(mask, pad, constant_values=False if mask.dtype == mx.bool_ else -mx.inf)
    if isinstance(mask, np.ndarray):
        mask = _classify_host_mask(mask, q_len, total) if mask.dtype == bool else mx.array(mask)
    if is_causal:
        # ONNX: query i sees keys j <= i + past (aligned by the past length). MLX's "causal"
        # aligns at the bottom right, the same thing when past = total - q_len.
        if past_len == total - q_len and (mask is None or isinstance(mask, str)):
            mask = "causal"
        else:
            causal = mx.array(np.tri(q_len, total, past_len, dtype=bool))
            if mask is None or isinstance(mask, str):
                mask = causal
            elif mask.dtype == mx.bool_:
                mask = mx.logical_and(mask, causal)
            else:
                mask = mask + _additive(causal, mask.dtype)
    if isinstance(mask, mx.array) and mask.dtype not in (mx.bool_, qh.dtype):
        mask = mask.astype(qh.dtype)

    if softcap > 0:
        if isinstance(mask, str):
            mask = mx.array(np.tri(q_len, total, total - q_len, dtype=bool))
        y = _reference_attention(qh, kh, vh, mask, sc, softcap)
    else:
        y = mx.fast.scaled_dot_product_attention(qh, kh, vh, scale=sc, mask=mask)
        if isinstance(mask, mx.array) and mask.dtype == mx.bool_:
            # A query that may attend nothing yields zeros (ONNX), not softmax's NaNs.
            y = mx.where(mask.any(axis=-1, keepdims=True), y, mx.zeros((), y.dtype))
    if three_d:
        b, h, s, d = y.shape
        y = y.transpose(0, 2, 1, 3).reshape(b, s, h * d)
    return y, kh, vh
