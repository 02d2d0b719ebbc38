"""A planned graph as data — `Step`, `Plan` — and `call_step`, which runs one step. A leaf:
the planner (plan.py), the node-by-node executor (executor.py), the compiled program
(decode.py) and their helpers all build on it, and it imports none of them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
import onnx

from fuselm.runtime_metal.dtypes import onnx_dtype, to_device, to_host
from fuselm.runtime_metal.errors import RuntimeUserError
from fuselm.runtime_metal.graph_io import LOGITS, LOGITS_PART, PAST
from fuselm.runtime_metal.mlx_engine.ops import OpImpl
from fuselm.runtime_metal.mlx_engine.qweight import QWeight

# Per layer: (kv_heads, key head_dim, value head_dim, dtype) of the KV cache
KVLayout = list[tuple[int, int, int, mx.Dtype]]


@dataclass
class Step:
    impl: OpImpl
    name: str
    inputs: list[str]  # "" = optional input not given
    outputs: list[str]
    attrs: dict[str, object]
    layer: int | None = None  # KV-cache layer this Attention node reads and writes in place

    @property
    def op_type(self) -> str:
        return self.impl.op_type

    @property
    def is_lm_head(self) -> bool:
        """The MatMul that produces the logits: its rows are independent, so a chunk of prompt
        needs it on the last position only. In a pipeline rank without the head, the step
        that receives the logits (mlx_engine/shard.py) stands in for it."""
        if self.op_type == "PipeLogits":
            return not self.attrs.get("own")
        return self.op_type == "MatMul" and (LOGITS in self.outputs or LOGITS_PART in self.outputs)


@dataclass
class Plan:
    steps: list[Step]
    constants: dict[str, object]
    inputs: dict[str, onnx.TypeProto]
    outputs: list[str]
    num_layers: int = 0
    # True when every layer's past/present pair is consumed/produced by one Attention node,
    # so the executor can keep K/V in a preallocated cache written in place.
    cache_bound: bool = False
    dropped: int = 0  # nodes removed as dead or folded
    stats: dict[str, int] = field(default_factory=dict)

    def past_dims(self, name: str) -> tuple[int, int, mx.Dtype]:
        """(kv_heads, head_dim, dtype) of a past_key_values input: the graph's static dims."""
        t = self.inputs[name].tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else 0 for d in t.shape.dim]
        if len(dims) != 4 or not dims[1] or not dims[3]:
            raise RuntimeUserError(f"graph input {name!r} needs static kv_heads and head_dim")
        return dims[1], dims[3], onnx_dtype(mx, t.elem_type)

    def kv_layout(self) -> KVLayout:
        """The KV cache's shape and dtype per layer, from the past_key_values inputs."""
        layout: dict[int, tuple[int, int, int, mx.Dtype]] = {}
        for name in self.inputs:
            if (m := PAST.match(name)) and m.group(2) == "key":
                hk, dk, dtype = self.past_dims(name)
                _, dv, _ = self.past_dims(name[: -len("key")] + "value")
                layout[int(m.group(1))] = (hk, dk, dv, dtype)
        return [layout[i] for i in sorted(layout)]


def lm_head_rows(step: Step, args: list[object], at: mx.array | None = None) -> list[object]:
    """The LM head of a chunk gets its last row only (the others' logits are never read), or
    row `at` (a device index: a padded chunk's last own token)."""
    x = args[0] if args else None
    if step.is_lm_head and isinstance(x, mx.array) and x.ndim == 3 and x.shape[1] > 1:
        args = [x[:, -1:, :] if at is None else mx.take(x, at.reshape(1), axis=1), *args[1:]]
    return args


def _prepare(step: Step, args: list[object]) -> tuple[object, list[object]]:
    impl = step.impl
    if impl.host and all(a is None or isinstance(a, np.ndarray) for a in args):
        return np, args
    out: list[object] = []
    for i, a in enumerate(args):
        if i in impl.static:
            out.append(None if a is None else to_host(a))
        elif isinstance(a, QWeight) and not impl.qweight:
            out.append(a.dense())  # an op that cannot take Q4 as-is gets the dense weight
        else:
            out.append(to_device(a))
    return mx, out


def call_step(step: Step, args: list[object], extra: Mapping[str, object] | None = None
              ) -> tuple[object, ...]:
    """Run one step on its argument values; always returns a tuple (one entry per output).
    `extra`: runtime keywords the op takes beside its attributes (e.g. a bound KV cache)."""
    xp, values = _prepare(step, args)
    accepted = step.impl.attrs
    attrs = {k: v for k, v in step.attrs.items() if accepted is None or k in accepted}
    if extra:
        attrs.update(extra)
    try:
        result = step.impl.fn(xp, *values, **attrs)
    except NotImplementedError as e:
        raise RuntimeUserError(
            f"node {step.name!r} ({step.impl.domain or 'ai.onnx'}::{step.op_type}): {e}") from e
    results = result if isinstance(result, tuple) else (result,)
    return tuple(np.asarray(r) if isinstance(r, np.generic) else r for r in results)
