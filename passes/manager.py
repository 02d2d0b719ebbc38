"""The pass manager: an ordered, written-out pipeline and a report of what each pass did.

    model_out, report = run_pipeline(model)                # the full PIPELINE
    model_out, report = run_pipeline(model, ["rmsnorm"])    # a subset (cleanup always runs)
    model_out, report = run_pipeline(model, quantize=QuantizeQ4(QuantOptions()))  # and --quant q4

Weights are never read except where a pass must (quantization); large initializers pass
through untouched (lazy Weight constants) and pairing packs them as recipes
(passes/weights.py). For a model loaded without its external data, pass `base_dir` (the
model file's folder) and a `deferred` dict, and write the result with passes/writer.py:

    deferred = {}
    out, report = run_pipeline(model, base_dir=raw.parent, deferred=deferred)
    write_model(out, path, base_dir=raw.parent, deferred=deferred)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx_graphsurgeon.ir.tensor import LazyValues

from fuselm.passes.attention import AttentionFusion
from fuselm.passes.cleanup import Cleanup
from fuselm.passes.dead_shape import RemoveDeadShapeOp
from fuselm.passes.errors import PassesError
from fuselm.passes.graph import PassResult, histogram
from fuselm.passes.model_io import quiet_graphsurgeon, to_graph, to_model
from fuselm.passes.pair_gate_up import GateUpPairing
from fuselm.passes.pair_qkv import QKVPairing
from fuselm.passes.quant.quantize import QuantizeQ4
from fuselm.passes.reorder import ReorderQKVProjections
from fuselm.passes.rmsnorm import RMSNormFusion
from fuselm.passes.rope import RoPEFusion
from fuselm.passes.unpack import UnpackProjections


class Pass(Protocol):
    name: str

    def run(self, graph: gs.Graph) -> PassResult: ...


def pipeline(quantize: QuantizeQ4 | None = None) -> list[Pass]:
    """Every pass in order; `quantize` is the conversion's quantization (with its options), or
    None for none. The order is the contract; each line says what it must come after."""
    return [
        RemoveDeadShapeOp(),  # first: later patterns see static shapes as constants
        UnpackProjections(),  # before RoPE: q and k must be projections of one activation
        RMSNormFusion(),  # before RoPE: q/k-norm must be RMSNormalization to fold into FusedRoPE
        RoPEFusion(),  # before attention: attention peels the head views FusedRoPE leaves
        AttentionFusion(),  # makes q/k/v 3-D and drops repeat_kv, so projections become pairable
        RemoveDeadShapeOp(),  # the shape chains the old attention needed are dead now
        ReorderQKVProjections(),  # before QKV pairing: the paired op takes the place of the first
        QKVPairing(),  # needs FusedRoPE/Attention downstream to tell q, k and v apart
        GateUpPairing(),
        *([quantize] if quantize is not None else []),  # after pairing: packed weights, one
        # tensor per fused op; its calibration forward runs the fused float graph
        Cleanup(),  # last: toposort, unused initializers/functions/opsets dropped
    ]


PIPELINE: list[Pass] = pipeline()  # the graph passes alone (what --passes chooses from)
PASS_NAMES = tuple(dict.fromkeys(p.name for p in PIPELINE))


class PipelineError(PassesError, ValueError):
    """Bad pipeline request (an unknown pass name): a user error, reported in one line."""


@dataclass
class PassEntry:
    name: str
    matches: int
    nodes_before: int
    nodes_after: int
    op_delta: dict[str, int]
    seconds: float
    refused: list[tuple[str, str]] = field(default_factory=list)
    extra: dict[str, object] = field(default_factory=dict)


@dataclass
class Report:
    entries: list[PassEntry] = field(default_factory=list)
    opset_upgraded_from: int | None = None
    # One decoder layer of the input graph, node by node (fuselm report draws it before fusion)
    layer_before: list[dict[str, object]] = field(default_factory=list)

    def to_dict(self) -> dict[str, object]:
        return {
            "opset_upgraded_from": self.opset_upgraded_from,
            "layer_before": self.layer_before,
            "passes": [
                {**asdict(e), "refused": [list(r) for r in e.refused]} for e in self.entries
            ],
        }

    def render(self):  # noqa: ANN201 - a rich Table (rich is imported lazily)
        from rich.table import Table

        table = Table(title="fuselm passes")
        for col in ("pass", "matches", "nodes", "ops +/-", "refused", "s"):
            table.add_column(col, justify="right" if col in ("matches", "s") else "left")
        for e in self.entries:
            delta = " ".join(f"{k}{v:+d}" for k, v in e.op_delta.items())
            refused = "\n".join(f"{n}: {r}" for n, r in e.refused[:5])
            if len(e.refused) > 5:
                refused += f"\n(+{len(e.refused) - 5} more)"
            if "peak_live_before" in e.extra:
                before, after = e.extra["peak_live_before"], e.extra["peak_live_after"]
                delta += f"\npeak live {before} -> {after}"
            table.add_row(e.name, str(e.matches), f"{e.nodes_before} -> {e.nodes_after}", delta,
                          refused, f"{e.seconds:.2f}")
        return table


def select(passes: Sequence[str] | None, quantize: QuantizeQ4 | None = None) -> list[Pass]:
    """The passes to run, in pipeline order: the named ones (all when None), `quantize` when
    given, and cleanup always."""
    if passes is None:
        return pipeline(quantize)
    unknown = [n for n in passes if n not in PASS_NAMES]
    if unknown:
        raise PipelineError(f"unknown pass {unknown[0]!r}; passes: {', '.join(PASS_NAMES)}")
    wanted = {*passes, "cleanup"}
    chosen, seen = [], set()
    for p in pipeline(quantize):
        if p is quantize or (p.name in wanted and p.name not in seen):
            chosen.append(p)
            seen.add(p.name)
    return chosen


def layer_nodes(nodes: list[onnx.NodeProto]) -> list[dict[str, object]]:
    """Decoder layer 1's nodes (op, name, inputs, outputs): small, and enough to draw it."""
    from fuselm.passes.layers import layer_window

    return [{"op": n.op_type, "domain": n.domain, "name": n.name, "inputs": list(n.input),
             "outputs": list(n.output)} for n in layer_window(nodes)]


def run_pipeline(
    model: onnx.ModelProto,
    passes: Sequence[str] | None = None,
    quantize: QuantizeQ4 | None = None,
    *,
    base_dir: str | Path | None = None,
    deferred: dict[str, LazyValues] | None = None,
    sources: dict[str, Callable[[], np.ndarray]] | None = None,
) -> tuple[onnx.ModelProto, Report]:
    """Run the chosen passes (and `quantize`); `base_dir`, `sources` and `deferred` as in
    model_io.to_graph / to_model."""
    chosen = select(passes, quantize)
    with quiet_graphsurgeon():
        graph = to_graph(model, base_dir=base_dir, sources=sources)  # upgrades to opset 23
        report = Report(opset_upgraded_from=graph.upgraded_from,
                        layer_before=layer_nodes(list(model.graph.node)))
        for p in chosen:
            before = histogram(graph)
            n_before = len(graph.nodes)
            t0 = time.perf_counter()
            result = p.run(graph)
            seconds = time.perf_counter() - t0
            after = histogram(graph)
            delta = {k: after[k] - before[k] for k in sorted(set(before) | set(after))
                     if after[k] != before[k]}
            report.entries.append(PassEntry(p.name, result.count, n_before, len(graph.nodes),
                                            delta, round(seconds, 4), list(result.refused),
                                            dict(result.extra)))
        return to_model(graph, template=model, deferred=deferred), report
