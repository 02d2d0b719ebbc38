"""ONNX Attention (opset 23) as an op of the executor: the graph's inputs (past/present pair,
host or device mask) mapped onto runtime_metal/mlx_engine/attention.py, where attention is defined.

When the executor binds the node to a preallocated cache (`kv_cache`), new K/V are written in
place and present = the cache's view, which is exactly concat(past, new) — the graph's meaning,
without the copy.
"""

from __future__ import annotations

from types import ModuleType

import mlx.core as mx
import numpy as np

from fuselm.runtime_metal.kv_cache import positions
from fuselm.runtime_metal.mlx_engine.attention import Attention, Mask, from_heads
from fuselm.runtime_metal.mlx_engine.ops.registry import op

_MASK_MEMO: dict[int, tuple[object, object]] = {}


def _classify_host_mask(mask: np.ndarray, q_len: int, total: int) -> Mask:
    """A host bool mask that is all-true or exactly causal becomes None / "causal", so MLX runs
    its fused causal path; anything else (padding, sliding windows) stays an explicit mask.
    Layers share one mask value, so the answer is memoized per object."""
    hit = _MASK_MEMO.get(id(mask))
    if hit is not None and hit[0] is mask:
        return hit[1]  # type: ignore[return-value]
    result: Mask = mx.array(mask)
    if mask.shape[-1] == total and mask.shape[-2:] == (q_len, total):
        flat = mask.reshape(-1, q_len, total)
        if flat.all():
            result = None
        elif (flat == np.tri(q_len, total, total - q_len, dtype=bool)).all():
            result = "causal"
    if len(_MASK_MEMO) > 8:
        _MASK_MEMO.clear()
    _MASK_MEMO[id(mask)] = (mask, result)
    return result


def _graph_mask(mask: object, q_len: int, total: int) -> Mask:
    """The mask input as MLX takes it: ONNX pads a short mask with "masked"."""
    if mask is None:
        return None
    if mask.shape[-1] < total:  # type: ignore[attr-defined]
        pad = [(0, 0)] * (mask.ndim - 1) + [(0, total - mask.shape[-1])]  # type: ignore[attr-defined]
        if isinstance(mask, np.ndarray):
            mask = np.pad(mask, pad, constant_values=False if mask.dtype == bool else -np.inf)
        else:
            mask = mx.pad(mask, pad,  # type: ignore[arg-type]
                          constant_values=False if mask.dtype == mx.bool_ else -mx.inf)  # type: ignore[attr-defined]
    if isinstance(mask, np.ndarray):
        return _classify_host_mask(mask, q_len, total) if mask.dtype == bool else mx.array(mask)
    return mask  # type: ignore[return-value]


@op("", "Attention", since=23)
def attention(  # noqa: ANN201, PLR0913
    xp: ModuleType, q, k, v, attn_mask=None, past_key=None, past_value=None,  # noqa: ANN001
    nonpad_kv_seqlen=None, *, q_num_heads: int | None = None,  # noqa: ANN001
    kv_num_heads: int | None = None, scale: float | None = None, is_causal: int = 0,
    softcap: float = 0.0, qk_matmul_output_mode: int = 0, softmax_precision: int = 0,
    kv_cache=None, n_outputs: int = 1,  # noqa: ANN001
):
    if n_outputs > 3:
        raise NotImplementedError("Attention: the qk_matmul_output output is not supported")
    if nonpad_kv_seqlen is not None:
        raise NotImplementedError("Attention: nonpad_kv_seqlen (opset 24) is not supported")
    attn = Attention.from_attrs({"q_num_heads": q_num_heads, "kv_num_heads": kv_num_heads,
                                 "scale": scale, "softcap": softcap, "is_causal": is_causal})
    qh, kh, vh = attn.heads(q, k, v)
    if kv_cache is not None:  # a quantized cache returns its triples: attend reads them
        kh, vh = kv_cache.update_and_fetch(kh, vh)
        past_len = positions(vh) - qh.shape[2]
    else:
        past_len = 0 if past_key is None else past_key.shape[2]
        if past_key is not None:
            kh = mx.concatenate([past_key, kh], axis=2)
        if past_value is not None:
            vh = mx.concatenate([past_value, vh], axis=2)
    q_len, total = qh.shape[2], positions(vh)  # a per-channel key buffer: its capacity
    mask = attn.with_causal(_graph_mask(attn_mask, q_len, total), q_len, total, past_len)
    y = attn.attend(qh, kh, vh, mask, recent=None if kv_cache is None else kv_cache.recent)
    return (from_heads(y) if q.ndim == 3 else y), kh, vh
