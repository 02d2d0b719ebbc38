"""Where a step's work goes: per-node timing (the seed's step 1), and the size of the MLX graph a
compiled step hands to evaluation (`graph_nodes`).

Per-node timing evaluates each node on its own, warm-up passes skipped; that removes MLX's
overlap between ops, so totals exceed a normal run; the ranking is what it is for.
"""

from __future__ import annotations

import re
import tempfile
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import mlx.core as mx

if TYPE_CHECKING:
    from fuselm.runtime_metal.mlx_engine.step import Step


@dataclass
class Profiler:
    warmup: int = 2  # forward passes skipped (first prefill and first decode compile/allocate)
    passes: int = 0
    active: bool = False
    by_node: dict[str, list] = field(default_factory=lambda: defaultdict(lambda: ["", 0, 0.0]))

    def begin_pass(self) -> None:
        self.active = self.passes >= self.warmup
        self.passes += 1

    def record(self, step: Step, seconds: float) -> None:
        row = self.by_node[step.name]
        row[0] = f"{step.impl.domain + '::' if step.impl.domain else ''}{step.op_type}"
        row[1] += 1
        row[2] += seconds

    def rows(self) -> list[dict[str, object]]:
        total = sum(r[2] for r in self.by_node.values()) or 1.0
        out = [
            {"node": name, "op": r[0], "calls": r[1], "total_ms": r[2] * 1e3,
             "mean_us": r[2] / max(r[1], 1) * 1e6, "percent": 100.0 * r[2] / total}
            for name, r in self.by_node.items()
        ]
        return sorted(out, key=lambda r: -r["total_ms"])

    def by_op(self) -> list[dict[str, object]]:
        agg: dict[str, list] = defaultdict(lambda: [0, 0.0])
        for r in self.by_node.values():
            agg[r[0]][0] += r[1]
            agg[r[0]][1] += r[2]
        total = sum(v[1] for v in agg.values()) or 1.0
        return sorted(({"op": k, "calls": v[0], "total_ms": v[1] * 1e3,
                        "percent": 100.0 * v[1] / total} for k, v in agg.items()),
                      key=lambda r: -r["total_ms"])

    def table(self, top: int = 25) -> str:
        measured = max(self.passes - self.warmup, 0)
        lines = [f"per-op time (after {self.warmup} warm-up passes, {measured} measured):",
                 f"{'op':<28}{'calls':>8}{'total ms':>12}{'%':>8}"]
        lines += [f"{r['op']:<28}{r['calls']:>8}{r['total_ms']:>12.2f}{r['percent']:>8.1f}"
                  for r in self.by_op()]
        lines += ["", f"top {top} nodes:", f"{'node':<40}{'op':<24}{'calls':>7}{'mean us':>10}"
                  f"{'total ms':>10}{'%':>7}"]
        lines += [f"{r['node'][:39]:<40}{r['op'][:23]:<24}{r['calls']:>7}{r['mean_us']:>10.1f}"
                  f"{r['total_ms']:>10.2f}{r['percent']:>7.1f}" for r in self.rows()[:top]]
        return "\n".join(lines)


_PRIMITIVE = re.compile(r'\{ (\d+) \[label ="([^"]*)", shape=rectangle\]')


def graph_nodes(*outputs: mx.array) -> Counter[str]:
    """The primitives of the lazy graph behind `outputs`, by name: the nodes MLX evaluates for
    them (a multi-output primitive once; inputs and evaluated arrays are no node). Read from
    mx.export_to_dot, MLX's own walk of the graph; deterministic, nothing is evaluated. For a
    compiled function's outputs these are its replayed tape (fused chains one "Compiled")."""
    with tempfile.TemporaryDirectory() as tmp:
        dot = Path(tmp) / "graph.dot"
        mx.export_to_dot(str(dot), *outputs)
        found = dict(_PRIMITIVE.findall(dot.read_text()))
    # a fused chain's label lists its ops ("CompiledExpMultiply..."): counted as one kind
    return Counter("Compiled" if name.startswith("Compiled") else name.split()[0]
                   for name in found.values())
