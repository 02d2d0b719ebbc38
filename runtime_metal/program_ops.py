"""What the compiled program (runtime_metal/decode.py) runs for attention and for the two
step pairs it fuses, each with the plain-MLX path it falls back to.

Pairs (found at load by `fuse_pairs`, executed at trace time):
* a residual `Add` and the `RMSNormalization` that reads it -> kernels_cuda.add_rms_norm;
* a `FusedRoPE` and the `Attention` that reads both its outputs -> kernels_cuda.rope_attend
  for one decoded token, then the cache write of the new key/value rows.
Where the kernels are off (not MLX-CUDA, FUSELM_KERNELS=off) or the shapes do not fit, the
pair runs as its two steps, exactly what the graph says.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from fuselm.runtime_metal import kernels, kernels_cuda
from fuselm.runtime_metal.executor import call_step
from fuselm.runtime_metal.plan import Step

if TYPE_CHECKING:
    from fuselm.runtime_metal.decode import _Op


def fuse_pairs(ops: list[_Op]) -> list[_Op]:
    """Give each residual Add its RMSNorm and each FusedRoPE its Attention as `partner`
    (kinds "add_norm" / "rope_attention"); partners leave the list. A pair forms only when
    moving the partner up to its first step reorders nothing it depends on."""
    readers: dict[str, list[_Op]] = {}
    for o in ops:
        for kind, name in o.args:
            if kind == "env":
                readers.setdefault(str(name), []).append(o)
    produced_before: set[str] = {"input_ids"}
    absorbed: set[int] = set()
    out: list[_Op] = []
    for o in ops:
        if id(o) in absorbed:
            continue
        partner = _partner(o, readers, produced_before)
        if partner is not None:
            o.kind = "add_norm" if o.kind == "step" else "rope_attention"
            o.partner = partner
            absorbed.add(id(partner))
        out.append(o)
        for p in (o, o.partner):
            if p is not None:
                produced_before.update(n for n in p.step.outputs if n)
    return out


def _partner(o: _Op, readers: dict[str, list[_Op]], before: set[str]) -> _Op | None:
    outs = o.step.outputs
    if o.kind == "step" and o.step.op_type == "Add" and outs and outs[0]:
        for r in readers.get(outs[0], []):
            if (r.kind == "step" and r.step.op_type == "RMSNormalization"
                    and r.args[0] == ("env", outs[0]) and len(r.args) >= 2
                    and r.args[1][0] == "const" and all(k != "env" for k, _ in r.args[1:])):
                return r
    if o.kind == "rope" and len(outs) >= 2 and outs[0] and outs[1]:
        users = readers.get(outs[0], []) + readers.get(outs[1], [])
        if len(users) == 2 and users[0] is users[1] and users[0].kind == "attention":
            a = users[0]
            v = a.args[2]
            if (a.args[0] == ("env", outs[0]) and a.args[1] == ("env", outs[1])
                    and (v[0] != "env" or v[1] in before)):
                return a
    return None


def add_norm(add: Step, norm: Step, a: object, b: object, scale: object, use_kernel: bool
             ) -> tuple[object, object]:
    """(a + b, RMSNorm(a + b) * scale)."""
    axis = int(norm.attrs.get("axis", -1))
    if use_kernel and kernels.add_rms_norm_fits(a, b, scale, axis):
        eps = mx.array([float(norm.attrs.get("epsilon", 1e-5))], mx.float32)
        return kernels_cuda.add_rms_norm(a, b, scale, eps)  # type: ignore[arg-type]
    h = call_step(add, [a, b])[0]
    return h, call_step(norm, [h, scale])[0]


def rope_attention(rope: Step, attn: Step, rargs: list[object], v: mx.array, keys: mx.array,
                   values: mx.array, offset: mx.array, mask: mx.array | str, use_kernel: bool
                   ) -> tuple[mx.array, mx.array, mx.array]:
    """RoPE (with its q/k-norm) then Attention over the cache; returns (y, keys', values')."""
    q, k = rargs[0], rargs[1]
    qn = rargs[3] if len(rargs) > 3 else None
    kn = rargs[4] if len(rargs) > 4 else None
    ra, aa = rope.attrs, attn.attrs
    head_dim = int(ra["head_dim"])
    rotary = int(ra.get("rotary_dim") or head_dim)
    hq, hk = int(aa.get("q_num_heads") or 1), int(aa.get("kv_num_heads") or 1)
    if use_kernel and kernels.rope_attend_fits(q, k, v, (qn, kn), keys, values, hq, hk,
                                               head_dim, rotary):
        scale = aa.get("scale")
        prm = mx.array([float(ra.get("norm_eps", 1e-6)),
                        float(scale) if scale is not None else 1.0 / math.sqrt(head_dim),
                        float(ra.get("attention_scale", 1.0))], mx.float32)
        inv_freq = mx.array(np.asarray(ra.get("inv_freq") or [], np.float32))
        y, k_new, v_new = kernels_cuda.rope_attend(
            q, k, v, qn, kn, inv_freq, prm, offset.reshape(1), keys, values,  # type: ignore[arg-type]
            hq=hq, hk=hk, rotary_dim=rotary, interleaved=bool(int(ra.get("interleaved", 0))))
        return y, write_rows(keys, k_new, offset), write_rows(values, v_new, offset)
    qr, kr = call_step(rope, rargs, {"_offset": offset})
    return attend(attn, qr, kr, v, keys, values, offset, mask)  # type: ignore[arg-type]


def write_rows(cache: mx.array, rows: mx.array, offset: mx.array) -> mx.array:
    """cache[:, :, offset:offset + s] = rows [b, h, s, d], in place when the buffer is donated.
    One row (a decoded token) is a scatter: MLX-CUDA launches its dynamic slice update over the
    whole destination (measured: the cost grows with the cache's capacity) plus an offset
    kernel; the scatter is one launch over the row."""
    rows = rows.astype(cache.dtype)
    if rows.shape[2] == 1:
        index = mx.broadcast_to(offset.reshape(1, 1, 1, 1), rows.shape)
        return mx.put_along_axis(cache, index, rows, axis=2)
    return mx.slice_update(cache, rows, offset.reshape(1), axes=(2,))


def attend(s: Step, q: mx.array, k: mx.array, v: mx.array, keys: mx.array, values: mx.array,
           offset: mx.array, mask: mx.array | str) -> tuple[mx.array, mx.array, mx.array]:
    """ONNX Attention for a chunk of queries over a fixed-capacity cache written at `offset`.
    mask "causal" (a fresh prompt, offset 0): only the chunk's own rows are attended."""
    from fuselm.runtime_metal.ops.attention import _to_heads

    a = s.attrs
    hq, hk = int(a.get("q_num_heads") or 1), int(a.get("kv_num_heads") or 1)
    qh, kh, vh = _to_heads(q, hq), _to_heads(k, hk), _to_heads(v, hk)
    keys, values = write_rows(keys, kh, offset), write_rows(values, vh, offset)
    scale = a.get("scale")
    sc = float(scale) if scale is not None else 1.0 / math.sqrt(qh.shape[-1])
    if isinstance(mask, str):
        n = qh.shape[2]
        y = mx.fast.scaled_dot_product_attention(qh, keys[:, :, :n], values[:, :, :n], scale=sc,
                                                 mask=mask)
    else:
        y = mx.fast.scaled_dot_product_attention(qh, keys, values, scale=sc, mask=mask)
    if q.ndim == 3:
        b, h, n, d = y.shape
        y = y.transpose(0, 2, 1, 3).reshape(b, n, h * d)
    return y, keys, values
