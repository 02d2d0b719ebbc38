"""Between onnx.ModelProto and onnx-graphsurgeon graphs, without touching weight values.

Shape inference and the checker serialize the model, which fails past 2 GB and costs a copy of
every weight; both run here on a *light* copy in which large initializers are replaced by typed
graph inputs (their shapes are all inference needs).

A model loaded without its external data goes through as references: `to_graph(model,
base_dir=...)` makes its external initializers lazy (passes/weights.py), and `to_model(graph,
deferred={})` leaves every weight that is not in memory (or is large) out of the ModelProto, for
passes/writer.py to stream into the data file.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import helper, numpy_helper
from onnx_graphsurgeon.ir.tensor import LazyValues
from onnx_graphsurgeon.logger import G_LOGGER

from fuselm.passes import ops
from fuselm.passes.weights import (
    ComputedValues,
    ExternalValues,
    PackedValues,
    Weight,
    array,
    is_external,
)

# Initializers up to this many elements stay in the light copy: shape constants must, so that
# inference can propagate their values (data_prop); weights need not.
_SMALL = 1024


def _numel(t: onnx.TensorProto) -> int:
    n = 1
    for d in t.dims:
        n *= d
    return n


def light_copy(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model without large initializer values (they become typed graph inputs)."""
    g = model.graph
    inputs = list(g.input)
    declared = {i.name for i in inputs}
    inits = []
    for t in g.initializer:
        if _numel(t) <= _SMALL and t.data_location != onnx.TensorProto.EXTERNAL:
            inits.append(t)
        elif t.name not in declared:  # (an initializer that is also an input stays an input)
            inputs.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    graph = helper.make_graph(list(g.node), g.name, inputs, list(g.output), inits)
    light = helper.make_model(
        graph, opset_imports=list(model.opset_import), ir_version=model.ir_version
    )
    light.functions.extend(model.functions)
    return light


def infer_shapes(model: onnx.ModelProto) -> None:
    """Fill `model.graph.value_info` from shape inference (with value propagation) in place."""
    light = light_copy(model)
    try:
        inferred = onnx.shape_inference.infer_shapes(light, strict_mode=False, data_prop=True)
    except Exception:  # noqa: BLE001 - inference is a help for matching, never a requirement
        return
    keep = {v.name for v in model.graph.input} | {v.name for v in model.graph.output}
    keep |= {t.name for t in model.graph.initializer}
    del model.graph.value_info[:]
    model.graph.value_info.extend(v for v in inferred.graph.value_info if v.name not in keep)


def check(model: onnx.ModelProto) -> None:
    """onnx.checker + strict shape inference on the light copy; raise on failure."""
    light = light_copy(model)
    onnx.checker.check_model(light, full_check=False)
    onnx.shape_inference.infer_shapes(light, strict_mode=True)


def upgrade(light: onnx.ModelProto) -> tuple[onnx.ModelProto, int | None]:
    """Bring a lower-opset (light) model to opset 23: the fused ops are opset-23 ops."""
    version = next((o.version for o in light.opset_import if o.domain in ("", "ai.onnx")), None)
    if version is None or version >= ops.ONNX_OPSET:
        return light, None
    from onnx import version_converter

    return version_converter.convert_version(light, ops.ONNX_OPSET), version


@contextlib.contextmanager
def quiet_graphsurgeon() -> Iterator[None]:
    """onnx-graphsurgeon's warnings off stdout: for a bfloat16 graph it says, for every small
    tensor a pass reads, that NumPy has no bfloat16 and the values it gives are float32. The
    passes read values from a copy (passes/weights.py `source`), so the graph keeps its
    types, and the exported model is bfloat16 as written."""
    severity = G_LOGGER.severity
    G_LOGGER.severity = G_LOGGER.ERROR
    try:
        yield
    finally:
        G_LOGGER.severity = severity


def to_graph(
    model: onnx.ModelProto, upgrade_opset: bool = True, base_dir: str | Path | None = None,
    sources: dict[str, Callable[[], np.ndarray]] | None = None,
) -> gs.Graph:
    """Import for the passes: upgraded to opset 23, shape-inferred (tensors carry dtypes and
    static dims), large weights referenced in place (never copied, never decoded).

    Shape inference and the version converter run on the light copy; the large initializers
    come back as lazy constants over the caller's own TensorProtos. `graph.upgraded_from` is
    the original opset when it was upgraded. The caller's model is not modified. Initializers
    stored externally become ExternalValues read from `base_dir` (the model file's folder) only
    if a pass asks for their values. `sources` gives, by name, a function computing a
    data-less initializer's values (the exporter's: read from the checkpoint when asked).
    """
    light = light_copy(model)
    upgraded = None
    if upgrade_opset:
        light, upgraded = upgrade(light)
    infer_shapes(light)
    graph = gs.import_onnx(light)
    kept = {t.name for t in light.graph.initializer}
    declared = {i.name for i in model.graph.input}
    big = {t.name: t for t in model.graph.initializer
           if t.name not in kept and t.name not in declared}
    for t in list(graph.inputs):
        real = big.get(t.name)
        if real is None:
            continue
        lazy = (ComputedValues(real, sources[t.name]) if sources and t.name in sources
                else ExternalValues(real, base_dir) if base_dir is not None and is_external(real)
                else LazyValues(real))
        c = Weight(t.name, lazy)
        for node in list(t.outputs):
            for k, u in enumerate(node.inputs):
                if u is t:
                    node.inputs[k] = c
    graph.inputs = [t for t in graph.inputs if t.name not in big]
    graph.upgraded_from = upgraded
    return graph


def to_model(
    graph: gs.Graph,
    template: onnx.ModelProto | None = None,
    deferred: dict[str, LazyValues] | None = None,
) -> onnx.ModelProto:
    """Export a graph as an opset-23 model with the fuselm function bodies it needs.

    External weights stay references to their file. Without `deferred`, packed weights are
    computed into the model (an in-memory model comes out whole). With it, every large weight
    whose bytes are in memory or still to be computed is exported as a data-less stand-in and
    recorded in `deferred` by name, for passes/writer.py: nothing large is copied.
    """
    # gs exports each Weight as its data-less stand-in; the real tensors are copied in once
    # below (gs's export would copy every initializer twice: make_graph, then make_model).
    stash: dict[str, onnx.TensorProto] = {}
    for t in graph.tensors().values():
        if not isinstance(t, Weight):
            continue
        lazy = t.source
        packed = isinstance(lazy, PackedValues)
        if _numel(lazy.tensor) <= _SMALL:  # small: stored inline (a recipe computed now)
            stash[t.name] = numpy_helper.from_array(lazy.load(), t.name) if packed else lazy.tensor
        elif deferred is not None and not is_external(lazy.tensor) and (
            packed or lazy.tensor.HasField("raw_data")
        ):
            deferred[t.name] = lazy  # left a stand-in: the writer streams its values
        elif packed:
            stash[t.name] = numpy_helper.from_array(lazy.load(), t.name)
        else:
            stash[t.name] = lazy.tensor
    model = gs.export_onnx(graph, do_type_check=False)
    for init in model.graph.initializer:
        real = stash.get(init.name)
        if real is not None:
            real.name = init.name
            init.CopyFrom(real)
    del model.graph.value_info[:]  # stale after rewrites; re-inferred by whoever needs them
    opsets = {o.domain: o.version for o in model.opset_import if o.domain != ops.DOMAIN}
    opsets[""] = max(opsets.get("", ops.ONNX_OPSET), ops.ONNX_OPSET)
    del model.opset_import[:]
    model.opset_import.extend(helper.make_opsetid(d, v) for d, v in sorted(opsets.items()))
    if template is not None:
        model.ir_version = max(template.ir_version, model.ir_version)
        for field in ("producer_name", "producer_version", "domain", "model_version", "doc_string"):
            setattr(model, field, getattr(template, field))
        del model.metadata_props[:]
        model.metadata_props.extend(template.metadata_props)
    model.ir_version = max(model.ir_version, 10)
    ops.attach_functions(model)
    _drop_unused_opsets(model)
    _type_outputs(model)
    return model


def runnable(graph: gs.Graph) -> tuple[onnx.ModelProto, Callable[[onnx.TensorProto], np.ndarray]]:
    """The graph as a model to run as it stands (quantization's calibration forward), without
    its weights: every Weight is its data-less stand-in, and `load(t)` gives any initializer's
    values, read only when asked."""
    model = gs.export_onnx(graph, do_type_check=False)
    if not any(o.domain in ("", "ai.onnx") for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("", ops.ONNX_OPSET))
    held = {t.name: t for t in graph.tensors().values() if isinstance(t, Weight)}

    def load(t: onnx.TensorProto) -> np.ndarray:
        found = held.get(t.name)
        return array(found.source) if found is not None else numpy_helper.to_array(t)

    return model, load


def _drop_unused_opsets(model: onnx.ModelProto) -> None:
    """Keep the default domain and the domains a node (or a function's node) uses."""
    used = {""} | {n.domain for n in model.graph.node}
    used |= {n.domain for f in model.functions for n in f.node}
    used |= {f.domain for f in model.functions}
    keep = [o for o in model.opset_import if o.domain in used or o.domain == "ai.onnx"]
    del model.opset_import[:]
    model.opset_import.extend(keep)


def _type_outputs(model: onnx.ModelProto) -> None:
    """Give untyped graph outputs their inferred type (the checker requires one)."""
    untyped = [o for o in model.graph.output if not o.type.tensor_type.elem_type]
    if not untyped:
        return
    try:
        inferred = onnx.shape_inference.infer_shapes(light_copy(model), data_prop=True)
    except Exception:  # noqa: BLE001 - leave them untyped; the checker will say so
        return
    known = {v.name: v for v in [*inferred.graph.value_info, *inferred.graph.output]}
    for o in untyped:
        v = known.get(o.name)
        if v is not None and v.type.tensor_type.elem_type:
            o.type.CopyFrom(v.type)
