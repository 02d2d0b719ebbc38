"""Run a Plan: one loop over its steps, values in a dict, KV cache read and written in place.

Host (NumPy) values flow through host-capable ops without touching the device; everything else
is an MLX array, built lazily and evaluated by the caller (one graph per forward pass).
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import mlx.core as mx
import numpy as np

from fuselm.runtime_metal.dtypes import onnx_dtype, to_device, to_host
from fuselm.runtime_metal.errors import RuntimeUserError
from fuselm.runtime_metal.graph_io import PAST, PRESENT
from fuselm.runtime_metal.kv_cache import KVCache
from fuselm.runtime_metal.plan import Plan, Step
from fuselm.runtime_metal.profile import Profiler
from fuselm.runtime_metal.qweight import QWeight


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
    """Run one step on its argument values; always returns a tuple (one entry per output)."""
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


class Executor:
    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.profiler: Profiler | None = None

    def run(self, feeds: Mapping[str, object], caches: list[KVCache] | None = None,
            last_logits_only: bool = False) -> dict[str, object]:
        """Execute the plan. With `caches` (one per layer), past/present KV live in the caches:
        bound Attention nodes update them in place; otherwise past is fed from the cache and
        present written back to it after the pass (the same meaning, a slower path).

        last_logits_only: a MatMul that produces `logits` (the LM head; rows are independent)
        gets only the last position, so a prefill skips the head for the rest of the prompt."""
        plan = self.plan
        env: dict[str, object] = dict(plan.constants)
        env.update(feeds)
        if caches is not None and not plan.cache_bound:
            for name in plan.inputs:
                if m := PAST.match(name):
                    cache = caches[int(m.group(1))]
                    if cache.keys is None:
                        env[name] = self._empty_past(name, feeds)
                    else:
                        env[name] = cache.state()[0 if m.group(2) == "key" else 1]
        prof = self.profiler if self.profiler is not None and self.profiler.active else None
        for step in plan.steps:
            bound = step.layer is not None and caches is not None
            try:
                # A bound Attention reads past K/V from its cache, not from inputs 4 and 5.
                args = [None if not n or (bound and i in (4, 5)) else env[n]
                        for i, n in enumerate(step.inputs)]
            except KeyError as e:
                raise RuntimeUserError(
                    f"node {step.name!r} needs {e.args[0]!r}, which was not fed or computed") from e
            extra = {"_cache": caches[step.layer]} if bound else None  # type: ignore[index]
            if (last_logits_only and step.op_type == "MatMul" and "logits" in step.outputs
                    and getattr(args[0], "ndim", 0) == 3 and args[0].shape[1] > 1):  # type: ignore[union-attr]
                args[0] = args[0][:, -1:, :]  # type: ignore[index]
            t0 = time.perf_counter() if prof else 0.0
            values = call_step(step, args, extra)
            if prof:
                mx.eval([v for v in values if isinstance(v, mx.array)])
                prof.record(step, time.perf_counter() - t0)
            for name, v in zip(step.outputs, values, strict=False):
                if name:
                    env[name] = v
        if caches is not None and not plan.cache_bound:
            self._write_back(env, caches)
        missing = [o for o in plan.outputs if o not in env]
        if missing:
            raise RuntimeUserError(f"graph outputs {missing} were not produced")
        return {o: env[o] for o in plan.outputs}

    def _empty_past(self, name: str, feeds: Mapping[str, object]) -> mx.array:
        t = self.plan.inputs[name].tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else 0 for d in t.shape.dim]
        ids = feeds.get("input_ids")
        if len(dims) != 4 or not dims[1] or not dims[3]:
            raise RuntimeUserError(f"graph input {name!r} needs static kv_heads and head_dim")
        batch = ids.shape[0] if ids is not None else 1  # type: ignore[attr-defined]
        return mx.zeros((batch, dims[1], 0, dims[3]), onnx_dtype(mx, t.elem_type))

    def _write_back(self, env: dict[str, object], caches: list[KVCache]) -> None:
        presents: dict[int, dict[str, object]] = {}
        for name in self.plan.outputs:
            if m := PRESENT.match(name):
                presents.setdefault(int(m.group(1)), {})[m.group(2)] = env[name]
        for layer, kv in presents.items():
            cache = caches[layer]
            k, v = to_device(kv["key"]), to_device(kv["value"])
            start = cache.offset
            cache.update_and_fetch(k[:, :, start:, :], v[:, :, start:, :])
