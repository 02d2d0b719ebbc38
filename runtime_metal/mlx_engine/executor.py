"""Run a Plan node by node: one loop over its steps, values in a dict, KV cache read and
written in place.

Host (NumPy) values flow through host-capable ops without touching the device; everything else
is an MLX array, built lazily and evaluated by the caller (one graph per forward pass). The
compiled program (decode.py) runs the same steps through the same `call_step`, attention
(attention.py) and cache writes (kv_cache.py).
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import mlx.core as mx

from fuselm.runtime_metal.dtypes import to_device
from fuselm.runtime_metal.errors import RuntimeUserError
from fuselm.runtime_metal.graph_io import PAST, PRESENT
from fuselm.runtime_metal.kv_cache import KVCache
from fuselm.runtime_metal.mlx_engine.profile import Profiler
from fuselm.runtime_metal.mlx_engine.step import Plan, call_step, lm_head_rows


class Executor:
    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.profiler: Profiler | None = None

    def run(self, feeds: Mapping[str, object], caches: list[KVCache] | None = None,
            last_logits_only: bool = False) -> dict[str, object]:
        """Execute the plan. With `caches` (one per layer), past/present KV live in the caches:
        bound Attention nodes update them in place; otherwise past is fed from the cache and
        present written back to it after the pass (the same meaning, a slower path).

        last_logits_only: the LM head gets only the last position (step.lm_head_rows), so a
        prefill skips the head for the rest of the prompt."""
        plan = self.plan
        env: dict[str, object] = dict(plan.constants)
        env.update(feeds)
        if caches is not None and not plan.cache_bound:
            for name in plan.inputs:
                if m := PAST.match(name):
                    cache = caches[int(m.group(1))]
                    if cache.keys is None:
                        env[name] = self._empty_past(name, feeds)
                    else:  # float (a quantized cache's values dequantized): the graph's past
                        _, dk, _ = plan.past_dims(name[: -len(m.group(2))] + "key")
                        _, dv, _ = plan.past_dims(name[: -len(m.group(2))] + "value")
                        env[name] = cache.dense(dk, dv)[0 if m.group(2) == "key" else 1]
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
            extra = {"kv_cache": caches[step.layer]} if bound else None  # type: ignore[index]
            if last_logits_only:
                args = lm_head_rows(step, args)
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
        heads, dim, dtype = self.plan.past_dims(name)
        ids = feeds.get("input_ids")
        batch = ids.shape[0] if ids is not None else 1  # type: ignore[attr-defined]
        return mx.zeros((batch, heads, 0, dim), dtype)

    def _write_back(self, env: dict[str, object], caches: list[KVCache]) -> None:
        presents: dict[int, dict[str, object]] = {}
        for name in self.plan.outputs:
            if m := PRESENT.match(name):
                presents.setdefault(int(m.group(1)), {})[m.group(2)] = env[name]
        for layer, kv in presents.items():
            cache = caches[layer]
            k, v = to_device(kv["key"]), to_device(kv["value"])
            start = cache.offset
            cache.update_and_fetch(k[:, :, start:, :], v[:, :, start:, :])  # type: ignore[index]
