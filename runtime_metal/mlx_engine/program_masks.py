"""What the compiled program (decode.py) may assume about a graph's attention-mask subgraph.

The program drops the subgraph that computes the attention masks from attention_mask /
position_ids (host values that change every call) and applies its own mask on the device. That
is only right if the graph's mask means what the program's does; these checks run the subgraph
on the host at load, for a few shapes, and say so:
- decode (one token after T-1 cached): every position visible, or the last W (a sliding window
  W, per mask);
- prefill (s tokens after T-s cached): causal, aligned at the bottom right (query i sees keys
  j <= T-s+i; with a window also j > T-s+i-W), after the Attention node's own is_causal.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from fuselm.runtime_metal.errors import RuntimeUserError
from fuselm.runtime_metal.mlx_engine.step import Plan, Step, call_step

DYNAMIC_INPUTS = ("attention_mask", "position_ids")
_DECODE_LENGTHS = (1, 2, 7, 300)
_PREFILL_SHAPES = ((1, 1), (5, 5), (4, 9), (16, 300))  # (s, total)


class MaskUnsupported(Exception):
    """The graph's mask is not what the program assumes; the reason says why."""


def tainted(plan: Plan) -> set[str]:
    """Values computed from attention_mask / position_ids (host values that change per step)."""
    out = {n for n in DYNAMIC_INPUTS if n in plan.inputs}
    for s in plan.steps:
        reads = {i for i, n in enumerate(s.inputs) if n and n in out}
        # What the program handles itself stops the taint: RoPE's positions (a device offset)
        # and a bound Attention's mask (the program's own mask).
        if s.op_type == "FusedRoPE" and reads == {2} and s.inputs[2] == "position_ids":
            continue
        if s.op_type == "Attention" and s.layer is not None and reads == {3}:
            continue
        if reads:
            out.update(o for o in s.outputs if o)
    return out


def mask_subgraph(plan: Plan) -> set[str]:
    """Names of steps whose results only ever reach an Attention's mask input (input 3)."""
    dyn = tainted(plan)
    consumers: dict[str, list[tuple[Step, int]]] = {}
    for s in plan.steps:
        for i, n in enumerate(s.inputs):
            if n:
                consumers.setdefault(n, []).append((s, i))
    outputs = set(plan.outputs)
    mask_only: set[str] = set()
    for s in reversed(plan.steps):
        if not any(o in dyn for o in s.outputs if o) or s.op_type == "Attention":
            continue
        ok = all(
            o not in outputs and all(
                (c.op_type == "Attention" and i == 3) or c.name in mask_only
                for c, i in consumers.get(o, []))
            for o in s.outputs if o)
        if ok:
            mask_only.add(s.name)
    return mask_only


def _bound_attention(plan: Plan) -> list[Step]:
    return [s for s in plan.steps if s.op_type == "Attention" and s.layer is not None]


def _mask_steps(plan: Plan, names: set[str]) -> list[Step]:
    needed, steps = set(names), []
    for s in reversed(plan.steps):
        if any(o and o in needed for o in s.outputs):
            steps.append(s)
            needed.update(n for n in s.inputs if n)
    steps.reverse()
    if any(s.op_type == "Attention" for s in steps):
        raise MaskUnsupported("an attention mask depends on another Attention's output")
    return steps


def _visible(plan: Plan, steps: list[Step], names: set[str], s: int, total: int
             ) -> dict[str, np.ndarray]:
    """Each mask, as bool 'may attend' [..., s or 1, total or 1], for s tokens after total-s."""
    env: dict[str, object] = dict(plan.constants)
    env.update({"input_ids": np.zeros((1, s), np.int64),
                "attention_mask": np.ones((1, total), np.int64),
                "position_ids": np.arange(total - s, total, dtype=np.int64)[None, :]})
    for st in steps:
        try:
            values = call_step(st, [env[n] if n else None for n in st.inputs])
        except (KeyError, RuntimeUserError, NotImplementedError) as e:
            raise MaskUnsupported(f"mask subgraph node {st.name}: {e}") from e
        env.update({o: v for o, v in zip(st.outputs, values, strict=False) if o})
    out = {}
    for n in names:
        m = np.array(env[n]) if isinstance(env[n], mx.array) else np.asarray(env[n])
        if m.dtype == bool:
            out[n] = m
        elif ((m != 0) & ~(m < -1e4)).any():  # additive: 0 = visible, -inf/-big = masked
            raise MaskUnsupported(f"the attention mask {n!r} is an additive bias, not a mask")
        else:
            out[n] = m == 0
    return out


def _rows(m: np.ndarray, s: int, total: int) -> np.ndarray:
    return np.broadcast_to(m, (*m.shape[:-2], s, total)).reshape(-1, s, total)


def check_decode(plan: Plan) -> dict[str, int | None]:
    """One new token after T-1 cached ones: every mask must show all T positions, or exactly
    the last W of them (a sliding window W, read off at the longest length). Returns each mask
    name's window (None: full attention)."""
    names = {s.inputs[3] for s in _bound_attention(plan) if len(s.inputs) > 3 and s.inputs[3]}
    if not names:
        return {}
    steps = _mask_steps(plan, names)
    longest = max(_DECODE_LENGTHS)
    windows: dict[str, int | None] = {}
    for n, m in _visible(plan, steps, names, 1, longest).items():
        seen = int(_rows(m, 1, longest)[0].sum()) if m.shape[-1] in (1, longest) else 0
        windows[n] = None if seen == longest else seen
    for total in _DECODE_LENGTHS:
        for n, m in _visible(plan, steps, names, 1, total).items():
            w = windows[n]
            want = np.arange(total) > total - 1 - (w if w is not None else total)
            if w == 0 or m.shape[-1] not in (1, total) or not (
                    _rows(m, 1, total) == want).all():
                raise MaskUnsupported(f"the attention mask {n!r} is neither all-visible nor a "
                                      f"sliding window for one decoded token at length {total}")
    return windows


def check_prefill(plan: Plan, windows: dict[str, int | None] | None = None) -> None:
    """s new tokens after T-s cached ones: what every Attention applies (its mask and its
    is_causal) must be exactly bottom-right-aligned causal, limited to the mask's sliding
    window where check_decode found one."""
    attn = _bound_attention(plan)
    names = {s.inputs[3] for s in attn if len(s.inputs) > 3 and s.inputs[3]}
    steps = _mask_steps(plan, names) if names else []
    for s, total in _PREFILL_SHAPES:
        masks = _visible(plan, steps, names, s, total) if names else {}
        causal = np.tri(s, total, total - s, dtype=bool)
        for a in attn:
            name = a.inputs[3] if len(a.inputs) > 3 else ""
            seen = np.broadcast_to(masks[name], (*masks[name].shape[:-2], s, total)) if name \
                else np.ones((s, total), bool)
            if int(a.attrs.get("is_causal", 0) or 0):
                seen = seen & causal
            want = causal
            w = (windows or {}).get(name)
            if w is not None:
                want = causal & ~np.tri(s, total, total - s - w, dtype=bool)
            if not (seen.reshape(-1, s, total) == want).all():
                raise MaskUnsupported(f"{a.name}: its mask is not causal for {s} tokens at "
                                      f"length {total}")
