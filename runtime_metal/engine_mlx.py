"""The MLX engine: the planned graph run by the executor, KV cache preallocated and in place."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

from runtime_metal.artifact import Manifest, model_path
from runtime_metal.executor import Executor
from runtime_metal.kv_cache import KVCache
from runtime_metal.loader import load_graph
from runtime_metal.plan import build_plan
from runtime_metal.profile import Profiler


class MLXEngine:
    name = "mlx"

    def __init__(self, out_dir: str | Path, manifest: Manifest,
                 profiler: Profiler | None = None) -> None:
        self.manifest = manifest
        self.plan = build_plan(load_graph(model_path(out_dir)))
        self.executor = Executor(self.plan)
        self.executor.profiler = profiler
        self.caches = [KVCache() for _ in range(self.plan.num_layers)]

    @property
    def offset(self) -> int:
        return self.caches[0].offset if self.caches else 0

    def reset(self) -> None:
        for c in self.caches:
            c.reset()

    def forward(self, ids: np.ndarray, all_logits: bool = False) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64).reshape(1, -1)
        s, start = ids.shape[1], self.offset
        feeds = {
            "input_ids": ids,
            "attention_mask": np.ones((1, start + s), np.int64),
            "position_ids": np.arange(start, start + s, dtype=np.int64)[None, :],
        }
        prof = self.executor.profiler
        if prof is not None:
            prof.begin_pass()
        out = self.executor.run(feeds, self.caches)
        logits = out["logits"]
        logits = logits[0] if all_logits else logits[0, -1]  # type: ignore[index]
        logits = mx.array(logits).astype(mx.float32)
        # Evaluate logits and the cache writes together (they share the graph).
        mx.eval(logits, *[c.keys for c in self.caches if c.keys is not None],
                *[c.values for c in self.caches if c.values is not None])
        return np.array(logits)

    def describe(self) -> dict[str, object]:
        return {
            "engine": self.name,
            "device": str(mx.default_device()),
            "steps": len(self.plan.steps),
            "graph_nodes": self.plan.stats.get("nodes"),
            "kv_cache": "in-place (bound)" if self.plan.cache_bound else "in-place (fed/written)",
        }
