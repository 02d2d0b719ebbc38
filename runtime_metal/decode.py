"""The fast decode step: one token through the planned graph as ONE compiled MLX function.

Everything resolvable is resolved once, at load (`DecodeProgram.build`): the plan's constants
(weights packed, host shapes folded), which nodes are the mask subgraph (dropped: a single
sequence attends to every cached position), which FusedRoPE reads the positions, which Attention
writes which cache layer. What is left is a pure function

    step(token, offset, k_0, v_0, ..., k_L, v_L) -> (logits, offset + 1, k_0', v_0', ...)

over a KV cache of fixed capacity (the preallocated buffers of kv_cache.KVCache): new K/V are
written at `offset` with `mx.slice_update` (in place: the buffers are donated), attention runs
over the whole buffer with the mask `arange(capacity) <= offset`, and RoPE takes `offset` as a
device scalar. Shapes therefore stay fixed as the cache grows, so `mx.compile` traces once per
capacity (every `KVCache.step` positions), fuses the elementwise chains, and each later token
costs one call into the compiled graph: no Python walk over the nodes, no host sync.

The program refuses (and the engine keeps the node-by-node executor) when a graph needs host
values per step that it cannot move to load time: dynamic-NTK RoPE, Attention softcap,
unbound KV, or a node other than the mask subgraph that reads attention_mask/position_ids.
Before use, the mask subgraph is run on the host for a few cache lengths to check that it
allows every position for one decoded token, which is what dropping it assumes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from runtime_metal import qweight
from runtime_metal.dtypes import to_device
from runtime_metal.errors import RuntimeUserError
from runtime_metal.executor import call_step
from runtime_metal.kv_cache import KVCache
from runtime_metal.plan import Plan, Step

_DYNAMIC_INPUTS = ("attention_mask", "position_ids")
_MASK_CHECK_LENGTHS = (1, 2, 7, 300)


class DecodeUnsupported(Exception):
    """The graph needs per-step host work; the reason says which node and why."""


@dataclass
class _Op:
    kind: str  # "step" | "rope" | "attention"
    step: Step
    args: list[tuple[str, object]]  # ("const", value) | ("env", name) | ("none", None)


@dataclass
class DecodeProgram:
    ops: list[_Op]
    logits: str
    num_layers: int
    dropped: int  # mask-subgraph steps removed

    # ---- load time -------------------------------------------------------------------------

    @classmethod
    def build(cls, plan: Plan) -> DecodeProgram:
        if not plan.cache_bound:
            raise DecodeUnsupported("the KV cache is not bound to Attention nodes")
        if "logits" not in plan.outputs:
            raise DecodeUnsupported("the graph has no 'logits' output")
        if "input_ids" not in plan.inputs:
            raise DecodeUnsupported("the graph has no 'input_ids' input")
        mask_only = _mask_subgraph(plan)
        tainted = _tainted(plan)
        ops: list[_Op] = []
        for s in plan.steps:
            if s.name in mask_only:
                continue
            kind = _kind(s, tainted)
            args: list[tuple[str, object]] = []
            for i, n in enumerate(s.inputs):
                if not n or (kind == "attention" and i >= 3) or (kind == "rope" and i == 2):
                    args.append(("none", None))
                elif n in plan.constants:
                    args.append(("const", plan.constants[n]))
                else:
                    args.append(("env", n))
            ops.append(_Op(kind, s, args))
        _check_mask(plan)
        live = _live(ops, "logits")
        return cls(live, "logits", plan.num_layers, len(plan.steps) - len(live))

    # ---- trace time (runs once per compiled shape, or every step when not compiled) ----------

    def __call__(self, token: mx.array, offset: mx.array, *kv: mx.array) -> tuple[mx.array, ...]:
        capacity = kv[0].shape[2]
        valid = (mx.arange(capacity) <= offset).reshape(1, 1, 1, capacity)
        env: dict[str, object] = {"input_ids": token.reshape(1, 1).astype(mx.int32)}
        out_kv: list[mx.array] = list(kv)
        with qweight.tracing():
            for o in self.ops:
                args = [v if k == "const" else env[v] if k == "env" else None  # type: ignore[index]
                        for k, v in o.args]
                if o.kind == "attention":
                    layer = o.step.layer
                    assert layer is not None
                    y, out_kv[2 * layer], out_kv[2 * layer + 1] = _attend(
                        o.step, args[0], args[1], args[2], out_kv[2 * layer],
                        out_kv[2 * layer + 1], offset, valid)
                    values: tuple[object, ...] = (y,)
                elif o.kind == "rope":
                    values = call_step(o.step, args, {"_offset": offset})
                else:
                    values = call_step(o.step, args)
                for name, v in zip(o.step.outputs, values, strict=False):
                    if name:
                        env[name] = v
        logits = to_device(env[self.logits])
        assert isinstance(logits, mx.array)
        return (logits.reshape(-1, logits.shape[-1])[-1].astype(mx.float32), offset + 1,
                *out_kv)


def _kind(s: Step, tainted: set[str]) -> str:
    dyn = {i for i, n in enumerate(s.inputs) if n and n in tainted}
    if s.op_type == "Attention" and s.layer is not None:
        if float(s.attrs.get("softcap", 0.0) or 0.0) > 0:
            raise DecodeUnsupported(f"{s.name}: Attention softcap has no fused decode kernel")
        if int(s.attrs.get("_n_outputs", 1)) > 3 or (len(s.inputs) > 6 and s.inputs[6]):
            raise DecodeUnsupported(f"{s.name}: Attention with qk output / nonpad_kv_seqlen")
        if any(i < 3 for i in dyn):
            raise DecodeUnsupported(f"{s.name}: q/k/v depend on attention_mask/position_ids")
        return "attention"
    if s.op_type == "FusedRoPE":
        if float(s.attrs.get("dynamic_factor", 0.0) or 0.0) > 0:
            raise DecodeUnsupported(f"{s.name}: dynamic-NTK RoPE needs host positions per step")
        if dyn - {2} or (2 in dyn and s.inputs[2] != "position_ids"):
            raise DecodeUnsupported(f"{s.name}: positions computed in the graph")
        return "rope"
    if dyn:
        raise DecodeUnsupported(
            f"{s.name} ({s.op_type}) reads attention_mask/position_ids outside the mask")
    return "step"


def _tainted(plan: Plan) -> set[str]:
    """Values computed from attention_mask / position_ids (host values that change per step)."""
    tainted = {n for n in _DYNAMIC_INPUTS if n in plan.inputs}
    for s in plan.steps:
        reads = {i for i, n in enumerate(s.inputs) if n and n in tainted}
        # What the program handles itself stops the taint: RoPE's positions (a device offset)
        # and a bound Attention's mask (the capacity mask).
        if s.op_type == "FusedRoPE" and reads == {2} and s.inputs[2] == "position_ids":
            continue
        if s.op_type == "Attention" and s.layer is not None and reads == {3}:
            continue
        if reads:
            tainted.update(o for o in s.outputs if o)
    return tainted




def _mask_subgraph(plan: Plan) -> set[str]:
    """Names of steps whose results only ever reach an Attention's mask input (input 3)."""
    tainted = _tainted(plan)
    consumers: dict[str, list[tuple[Step, int]]] = {}
    for s in plan.steps:
        for i, n in enumerate(s.inputs):
            if n:
                consumers.setdefault(n, []).append((s, i))
    outputs = set(plan.outputs)
    mask_only: set[str] = set()
    for s in reversed(plan.steps):
        if not any(o in tainted for o in s.outputs if o) or s.op_type == "Attention":
            continue
        ok = all(
            o not in outputs and all(
                (c.op_type == "Attention" and i == 3) or c.name in mask_only
                for c, i in consumers.get(o, []))
            for o in s.outputs if o)
        if ok:
            mask_only.add(s.name)
    return mask_only


def _live(ops: list[_Op], output: str) -> list[_Op]:
    """Drop what only fed the dropped mask subgraph (e.g. Shape(input_ids))."""
    needed, live = {output}, []
    for o in reversed(ops):
        if any(n and n in needed for n in o.step.outputs):
            live.append(o)
            needed.update(v for k, v in o.args if k == "env")  # type: ignore[misc]
    return live[::-1]


def _check_mask(plan: Plan) -> None:
    """Run the mask subgraph on the host for one new token after T-1 cached ones: the mask that
    reaches every Attention must allow all T positions (what the program's mask means)."""
    attn = [s for s in plan.steps if s.op_type == "Attention" and s.layer is not None]
    names = {s.inputs[3] for s in attn if len(s.inputs) > 3 and s.inputs[3]}
    if not names:
        return
    needed = set(names)
    steps: list[Step] = []
    for s in reversed(plan.steps):
        if any(o and o in needed for o in s.outputs):
            steps.append(s)
            needed.update(n for n in s.inputs if n)
    steps.reverse()
    if any(s.op_type == "Attention" for s in steps):
        raise DecodeUnsupported("an attention mask depends on another Attention's output")
    for total in _MASK_CHECK_LENGTHS:
        env: dict[str, object] = dict(plan.constants)
        env.update({"input_ids": np.zeros((1, 1), np.int64),
                    "attention_mask": np.ones((1, total), np.int64),
                    "position_ids": np.array([[total - 1]], np.int64)})
        for s in steps:
            try:
                values = call_step(s, [env[n] if n else None for n in s.inputs])
            except (KeyError, RuntimeUserError, NotImplementedError) as e:
                raise DecodeUnsupported(f"mask subgraph node {s.name}: {e}") from e
            env.update({o: v for o, v in zip(s.outputs, values, strict=False) if o})
        for n in names:
            m = np.asarray(env[n]) if not isinstance(env[n], mx.array) else np.array(env[n])
            ok = m.all() if m.dtype == bool else not (m < 0).any() and np.isfinite(m).all()
            if not ok or m.shape[-1] not in (1, total):
                raise DecodeUnsupported(f"the attention mask {n!r} is not all-visible for one "
                                        f"decoded token at length {total}")


def _attend(s: Step, q: mx.array, k: mx.array, v: mx.array, keys: mx.array, values: mx.array,
            offset: mx.array, valid: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """ONNX Attention for one query over a fixed-capacity cache written at `offset`."""
    from runtime_metal.ops.attention import _to_heads

    a = s.attrs
    hq, hk = int(a.get("q_num_heads") or 1), int(a.get("kv_num_heads") or 1)
    qh, kh, vh = _to_heads(q, hq), _to_heads(k, hk), _to_heads(v, hk)
    start = offset.reshape(1)
    keys = mx.slice_update(keys, kh.astype(keys.dtype), start, axes=(2,))
    values = mx.slice_update(values, vh.astype(values.dtype), start, axes=(2,))
    scale = a.get("scale")
    sc = float(scale) if scale is not None else 1.0 / math.sqrt(qh.shape[-1])
    y = mx.fast.scaled_dot_product_attention(qh, keys, values, scale=sc, mask=valid)
    if q.ndim == 3:
        b, h, n, d = y.shape
        y = y.transpose(0, 2, 1, 3).reshape(b, n, h * d)
    return y, keys, values


class FastDecoder:
    """Drives a DecodeProgram over the engine's KVCache objects (the same buffers the prefill
    executor writes), compiled with mx.compile unless `compiled=False`."""

    def __init__(self, program: DecodeProgram, caches: list[KVCache], compiled: bool = True
                 ) -> None:
        self.program = program
        self.caches = caches
        self.compiled = compiled
        self._fn: Callable[..., tuple[mx.array, ...]] = (
            mx.compile(program) if compiled else program)
        self._offset: mx.array | None = None
        self._offset_at = -1  # the host offset `_offset` holds

    def step(self, token: mx.array) -> mx.array:
        """Feed one token (a device scalar, possibly still lazy); return its logits [vocab] as a
        lazy float32 array. The caches advance by one position."""
        caches = self.caches
        pos = caches[0].offset
        if caches[0].keys is None:
            raise RuntimeUserError("decode needs a prefilled cache (feed the prompt first)")
        for c in caches:
            if pos + 1 > c.keys.shape[2]:  # type: ignore[union-attr]
                _grow(c)
        if self._offset is None or self._offset_at != pos:
            self._offset = mx.array(pos, mx.int32)
        kv = [a for c in caches for a in (c.keys, c.values)]
        logits, self._offset, *new_kv = self._fn(token, self._offset, *kv)
        for i, c in enumerate(caches):
            c.keys, c.values = new_kv[2 * i], new_kv[2 * i + 1]
            c.offset = pos + 1
        self._offset_at = pos + 1
        return logits


def _grow(c: KVCache) -> None:
    """One more KVCache.step of capacity (a new compiled shape: traced once, then cached)."""
    assert c.keys is not None and c.values is not None
    b, h, n, d = c.keys.shape
    c.keys = mx.concatenate([c.keys, mx.zeros((b, h, c.step, d), c.keys.dtype)], axis=2)
    c.values = mx.concatenate(
        [c.values, mx.zeros((b, h, c.step, c.values.shape[3]), c.values.dtype)], axis=2)
