"""The compiled program's ops (mlx_engine/decode.py): `ProgramOp`, what one entry of the
program is, and what it runs for attention and for the two step pairs it fuses, each with the
plain-MLX path it falls back to.

Pairs (found at load by `fuse_pairs`, executed at trace time):
* a residual `Add` and the `RMSNormalization` that reads it -> kernels_cuda.add_rms_norm, or,
  when a Q4 MatMul makes the added row (fold_into_producers), nothing of its own: that GEMV's
  epilogue (kernels_q4.q4_gemv_add_norm);
* a `FusedRoPE` and the `Attention` that reads both its outputs -> kernels_cuda.rope_attend
  for one decoded token per sequence, which also writes the new key/value rows into the cache
  (a float cache; with FUSELM_KV_ATTN on, an 8-bit one, quantized by the kernel, and a 4-bit
  cache in the steps whose write completes no key group, `seal=False`: its sealing steps run
  the two steps).
Where the kernels are off (not MLX-CUDA, FUSELM_KERNELS=off) or the shapes do not fit, the
pair runs as its two steps, exactly what the graph says, through attention.Attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from fuselm.runtime_metal.cuda_kernels import selection as kernels
from fuselm.runtime_metal.cuda_kernels import sources as kernels_cuda
from fuselm.runtime_metal.kv_cache import BlockIndex, Buffer, is_key_groups
from fuselm.runtime_metal.mlx_engine.attention import Attention, Mask
from fuselm.runtime_metal.mlx_engine.qweight import QWeight
from fuselm.runtime_metal.mlx_engine.step import Step, call_step


@dataclass
class ProgramOp:
    kind: str  # "step" | "rope" | "attention" | "add_norm" | "rope_attention" (with partner)
    step: Step
    args: list[tuple[str, object]]  # ("const", value) | ("env", name) | ("none", None)
    partner: ProgramOp | None = None  # the step fused with this one (fuse_pairs)
    # add_norm: the Q4 matmul producing one of the Add's inputs (fold_into_producers), and
    # which input (0 or 1); the other is the residual
    norm_producer: ProgramOp | None = None
    producer_arg: int = 0


def _const_qweight(c: ProgramOp) -> QWeight | None:
    """The step's second argument when it is a constant Q4 weight (a MatMul's, FusedQKV's or
    FusedGateUp's weight), else None."""
    w = c.args[1][1] if len(c.args) > 1 and c.args[1][0] == "const" else None
    return w if isinstance(w, QWeight) else None


def _q4_matmul(c: ProgramOp) -> QWeight | None:
    """The constant Q4 weight of a plain MatMul step (no bias, not the LM head), else None."""
    ok = (c.kind == "step" and c.step.op_type == "MatMul" and not c.step.is_lm_head
          and len(c.args) == 2 and c.args[0][0] == "env")
    return _const_qweight(c) if ok else None


def _readers(ops: list[ProgramOp]) -> dict[str, list[tuple[int, ProgramOp]]]:
    """Each env name -> the (index in ops, op or partner) of every step reading it."""
    readers: dict[str, list[tuple[int, ProgramOp]]] = {}
    for i, o in enumerate(ops):
        for p in (o, o.partner):
            if p is not None:
                for kind, name in p.args:
                    if kind == "env":
                        readers.setdefault(str(name), []).append((i, p))
    return readers


def fold_into_producers(ops: list[ProgramOp]) -> None:
    """Give each add_norm pair `norm_producer`: the Q4 MatMul (o_proj, down) producing one of
    the Add's inputs when the Add is its only reader and the other input (the residual) and
    the norm's scale exist before it runs; that GEMV then adds and normalizes in its epilogue
    (kernels_q4.q4_gemv_add_norm) and the pair launches nothing of its own."""
    readers = _readers(ops)
    made_at: dict[str, int] = {"input_ids": -1}
    for i, o in enumerate(ops):
        for p in (o, o.partner):
            if p is not None:
                made_at.update((n, i) for n in p.step.outputs if n)
    for at, o in enumerate(ops):
        if o.kind != "add_norm" or o.partner is None:
            continue
        for which in (0, 1):
            mine, other = o.args[which], o.args[1 - which]
            if mine[0] != "env" or other[0] != "env" or len(o.args) != 2:
                continue
            pi = made_at.get(str(mine[1]))
            if pi is None or pi < 0 or _q4_matmul(ops[pi]) is None:
                continue
            read_by = [i for i, _ in readers.get(str(mine[1]), [])]
            if read_by == [at] and made_at.get(str(other[1]), at) < pi:
                o.norm_producer, o.producer_arg = ops[pi], which
                break


def matmul_add_norm(producer: ProgramOp, pair: ProgramOp, x: object, residual: object,
                    scale: object) -> tuple[mx.array, mx.array] | None:
    """The epilogue form of fold_into_producers: (h, y) from one GEMV launch (lazy views of
    its one output, which the next GEMVs read in their place: QWeight.matmul_add_norm), or
    None where the kernel does not take these shapes or the norm's epsilon as its template
    constant (QWeight.matmul_add_norm refuses a negative one): the MatMul and the pair then
    run as usual."""
    w = _q4_matmul(producer)
    assert w is not None and pair.partner is not None
    axis = int(pair.partner.step.attrs.get("axis", -1))  # type: ignore[call-overload]
    if not (isinstance(x, mx.array) and axis in (-1, x.ndim - 1)):
        return None
    eps = float(pair.partner.step.attrs.get("epsilon", 1e-5))  # type: ignore[arg-type]
    return w.matmul_add_norm(x, residual, scale, eps)


def fuse_pairs(ops: list[ProgramOp]) -> list[ProgramOp]:
    """Give each residual Add its RMSNorm and each FusedRoPE its Attention as `partner`
    (kinds "add_norm" / "rope_attention"); partners leave the list. A pair forms only when
    moving the partner up to its first step reorders nothing it depends on."""
    # no partners yet: each name's readers are the ops themselves
    readers = {name: [o for _, o in read] for name, read in _readers(ops).items()}
    produced_before: set[str] = {"input_ids"}
    absorbed: set[int] = set()
    out: list[ProgramOp] = []
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


def _partner(o: ProgramOp, readers: dict[str, list[ProgramOp]], before: set[str]
             ) -> ProgramOp | None:
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
    axis = int(norm.attrs.get("axis", -1))  # type: ignore[call-overload]
    eps = float(norm.attrs.get("epsilon", 1e-5))  # type: ignore[arg-type]
    # the kernel takes eps as a template constant (kernels.float_bits): not a negative one
    if (use_kernel and kernels.add_rms_norm_fits(a, b, scale, axis)
            and kernels.takes_float_bits(eps)):
        return kernels_cuda.add_rms_norm(a, b, scale, eps)  # type: ignore[arg-type]
    h = call_step(add, [a, b])[0]
    return h, call_step(norm, [h, scale])[0]


def rope_attention(rope: Step, attn_step: Step, rargs: list[object], v: mx.array,
                   keys: Buffer, values: Buffer, offset: mx.array, mask: Mask,
                   use_kernel: bool, offset_rows: mx.array, rows: int | None = None,
                   qkv: mx.array | None = None, splits: int | None = None,
                   blocks: BlockIndex | None = None, seal: bool = True
                   ) -> tuple[mx.array, Buffer, Buffer]:
    """RoPE (with its q/k-norm) then Attention over the cache; returns (y, keys', values').
    `offset`: a scalar, or [b] one position per batch row (one token each). For the kernel:
    `offset_rows`, offset as [b] (the caller makes it once a step, not once a layer), `qkv`,
    the fused projection q, k and v were sliced from (read in place of the slices), and
    `splits` (kernels_cuda.rope_attend's: None = as many key splits as fill the GPU, 0 =
    a block per query head). `blocks`: keys/values are block pools and row r's positions lie
    in the blocks of its table row (kv_cache.BlockCache; the kernel reads blocks.table, the
    plain path the step's index math over it, kv_cache.BlockIndex). `seal`: over_cache's. An
    8-bit cache (kv_cache.Buffer triples) takes the kernel's 8-bit form (it quantizes the new
    rows itself); a 4-bit one (keys per channel) its 4-bit form where `seal` is False (no
    row's write completes a key group, which the kernel never quantizes), else RoPE, then
    Attention."""
    q, k = rargs[0], rargs[1]
    qn = rargs[3] if len(rargs) > 3 else None
    kn = rargs[4] if len(rargs) > 4 else None
    ra = rope.attrs
    attn = Attention.from_attrs(attn_step.attrs)
    head_dim = int(ra["head_dim"])  # type: ignore[call-overload]
    rotary = int(ra.get("rotary_dim") or head_dim)  # type: ignore[call-overload]
    # The kernel's constants (eps, softmax scale, attention scale) are template arguments
    # (kernels.float_bits), which take no negative value: the plain path runs then.
    norm_eps = float(ra.get("norm_eps", 1e-6))  # type: ignore[arg-type]
    ascale = float(ra.get("attention_scale", 1.0))  # type: ignore[arg-type]
    prm = (norm_eps, attn.scale_for(head_dim), ascale)
    # The kernel has plain softmax: other semantics (softcap, ...) take Attention's own path.
    table = None if blocks is None else blocks.table
    tails = None if blocks is None else blocks.tails
    if (use_kernel and attn.softcap == 0 and kernels.takes_float_bits(*prm)
            and not (seal and is_key_groups(keys))
            and kernels.rope_attend_fits(q, k, v, (qn, kn), keys, values, attn.q_heads,
                                         attn.kv_heads, head_dim, rotary, table, tails)):
        inv_freq = mx.array(np.asarray(ra.get("inv_freq") or [], np.float32))
        return kernels_cuda.rope_attend(
            q, k, v, qn, kn, inv_freq, prm, offset_rows, keys, values,  # type: ignore[arg-type]
            hq=attn.q_heads, hk=attn.kv_heads, rotary_dim=rotary,
            interleaved=bool(int(ra.get("interleaved", 0))), qkv=qkv,  # type: ignore[call-overload]
            splits=splits, table=table, tails=tails)
    qr, kr = call_step(rope, rargs, {"device_offset": offset})
    return attn.over_cache(qr, kr, v, keys, values, offset, mask, rows, blocks,  # type: ignore[arg-type]
                           seal)


def attend(attn_step: Step, q: mx.array, k: mx.array, v: mx.array, keys: Buffer,
           values: Buffer, offset: mx.array, mask: Mask, rows: int | None = None,
           blocks: BlockIndex | None = None, seal: bool = True
           ) -> tuple[mx.array, Buffer, Buffer]:
    """An Attention with no RoPE partner: Attention.over_cache."""
    return Attention.from_attrs(attn_step.attrs).over_cache(q, k, v, keys, values, offset, mask,
                                                            rows, blocks, seal)
