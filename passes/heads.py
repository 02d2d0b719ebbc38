"""Shared matchers for the attention block: head views, rotations' frequencies, widths.

A *head view* is how every exporter turns a projection [b, s, H*D] into heads [b, H, s, D]:
Transpose(0, 2, 1, 3)(Reshape(x, [b, s, -1 | H, D])), with Qwen3's per-head RMSNorm between
the two. RoPE and attention fusion both peel it to get back to the 3-D tensor the contract uses.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs
from onnx import helper

from fuselm.passes.graph import (
    NoMatch,
    axes_of,
    const,
    last_const,
    maybe_producer,
    producer,
    scalar,
    tensor_type,
)


@dataclass
class HeadView:
    x3: gs.Tensor  # [b, s, H*D]
    head_dim: int
    norm: gs.Node | None  # per-head RMSNormalization (before or after the transpose)


def _head_norm(t: gs.Tensor) -> gs.Node | None:
    norm = maybe_producer(t, "RMSNormalization")
    if norm is not None and int(norm.attrs.get("axis", -1)) not in (-1, 3):
        raise NoMatch
    return norm


def head_view(x4: gs.Tensor) -> HeadView:
    # The per-head norm may also come after the transpose (torch.onnx at opset 23 writes
    # Gemma 3's that way): over the last axis alone, it is the same norm either side of it.
    outer = _head_norm(x4)
    tr = producer(outer.inputs[0] if outer is not None else x4, "Transpose")
    if list(tr.attrs.get("perm", [])) != [0, 2, 1, 3]:
        raise NoMatch
    y = tr.inputs[0]
    inner = _head_norm(y)
    if inner is not None:
        if outer is not None:
            raise NoMatch  # two norms in one view
        y = inner.inputs[0]
    norm = inner or outer
    r = producer(y, "Reshape")
    d = last_const(r.inputs[1])
    if d is None or d <= 0:
        raise NoMatch
    x3 = r.inputs[0]
    if x3.shape is not None and len(x3.shape) != 3:
        raise NoMatch
    return HeadView(x3, d, norm)


def width(t: gs.Tensor, depth: int = 4) -> int | None:
    """Static size of the last axis of `t`, from inference or from the producing weights."""
    if t.shape is not None and len(t.shape) and isinstance(t.shape[-1], int) and t.shape[-1] >= 0:
        return int(t.shape[-1])
    if depth == 0 or not t.inputs:
        return None
    node = t.inputs[0]
    if node.op == "MatMul" and isinstance(node.inputs[1], gs.Constant):
        return int(node.inputs[1].shape[-1])
    if node.op == "MatMul":
        dq = maybe_producer(node.inputs[1], "DequantizeLinear")
        if dq is not None and isinstance(dq.inputs[0], gs.Constant):
            return int(dq.inputs[0].shape[-1])
    if node.op in ("Add", "Mul", "Cast", "Identity", "RMSNormalization"):
        for i in node.inputs:
            if not isinstance(i, gs.Constant):
                w = width(i, depth - 1)
                if w is not None:
                    return w
    if node.domain == "fuselm" and node.op == "FusedRoPE":
        k = next(j for j, o in enumerate(node.outputs) if o is t)
        return width(node.inputs[k], depth - 1)
    if node.domain == "fuselm" and node.op == "FusedQKV":
        k = next(j for j, o in enumerate(node.outputs) if o is t)
        return int(node.attrs[("q_size", "k_size", "v_size")[k]])
    return None


@dataclass
class Freqs:
    position_ids: gs.Tensor  # int [b, s]
    inv_freq: np.ndarray  # [rotary_dim / 2]
    # LongRoPE: long_inv_freq replaces inv_freq once max(position_ids) + 1 > long_after
    long_inv_freq: np.ndarray | None = None
    long_after: int = 0

    def key(self) -> tuple:
        long = b"" if self.long_inv_freq is None else self.long_inv_freq.tobytes()
        return (self.inv_freq.tobytes(), long, self.long_after)


def _long_rope(inv: gs.Tensor) -> tuple[gs.Tensor, np.ndarray, np.ndarray, int] | None:
    """(position_ids, short, long, after) for HF's LongRoPE switch as exporters write it:
    Where(Greater(ReduceMax(position_ids) + 1, after), long_inv_freq, short_inv_freq)."""
    where = maybe_producer(inv, "Where")
    if where is None:
        return None
    long, short = const(where.inputs[1]), const(where.inputs[2])
    gt = maybe_producer(where.inputs[0], "Greater")
    add = maybe_producer(gt.inputs[0], "Add") if gt is not None else None
    after = scalar(gt.inputs[1]) if gt is not None else None
    if long is None or short is None or add is None or after is None or \
            long.size != short.size:
        return None
    for a, b in ((add.inputs[0], add.inputs[1]), (add.inputs[1], add.inputs[0])):
        rmax = maybe_producer(a, "ReduceMax")
        if rmax is not None and scalar(b) == 1.0 and axes_of(rmax) in (None, []) and \
                not int(rmax.attrs.get("noop_with_empty_axes", 0)):
            return (rmax.inputs[0], short.reshape(-1).astype(np.float32),
                    long.reshape(-1).astype(np.float32), int(after))
    return None


def freqs_of(f: gs.Tensor) -> Freqs:
    """position_ids and inv_freq from `freqs = position_ids[..., None].float() * inv_freq`
    (inv_freq a constant, or LongRoPE's switch between two)."""
    mul = producer(f, "Mul")
    for p, inv in ((mul.inputs[0], mul.inputs[1]), (mul.inputs[1], mul.inputs[0])):
        v = const(inv)
        long = _long_rope(inv) if v is None else None
        if long is not None:
            v = long[1]
        if v is None or v.size < 1:
            continue
        pos = p
        for _ in range(3):  # Cast and Unsqueeze(-1), in either order
            node = maybe_producer(pos, ("Cast", "Unsqueeze"))
            if node is None:
                break
            if node.op == "Unsqueeze":
                axes = axes_of(node)
                if axes not in ([2], [-1]):
                    raise NoMatch
            pos = node.inputs[0]
        pos_type = tensor_type(pos)
        if pos_type is not None and helper.tensor_dtype_to_np_dtype(pos_type).kind not in "iu":
            raise NoMatch
        if long is None:
            return Freqs(pos, v.reshape(-1).astype(np.float32))
        if long[0] is not pos:
            raise NoMatch  # the switch reads other positions than the rotation
        return Freqs(pos, long[1], long[2], long[3])
    raise NoMatch
