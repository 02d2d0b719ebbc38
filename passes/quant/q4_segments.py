"""Run a float graph in segments, so that only one slice of its weights is in memory at a time.

Calibration statistics (passes/quant/q4_calibration.py) need the activations that feed each weight.
Running the whole float graph in one onnxruntime session holds a second copy of every weight
(the session's, beside the model's), which is 2-3x a checkpoint's size. Here the nodes that
lead to the wanted activations are cut, in graph order, into segments of a few MB of weights
(`segment_size`); each segment becomes its own small model (its weights read through `load`
only now, handed to onnxruntime in memory), runs every chunk of tokens, hands the wanted
activations to a callback, and is dropped before the next one is built. Only the tensors that
cross a segment boundary are kept between segments (a few [tokens, hidden] arrays per chunk).

Nodes not needed for a wanted activation never run (the LM head, when only its input is
wanted). A Gather of a large initializer (an embedding table) is done in NumPy on the rows the
ids pick, so the table never enters a session. Same operators, same onnxruntime kernels as one
session over the whole graph: the segments compute the same values.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from fuselm.passes import ops

# Weights per segment (float bytes as stored): a model's weights / SEGMENTS, within
# [SEGMENT_BYTES, MAX_SEGMENT_BYTES]. Each session costs ~30 ms to make besides its weights
# (Qwen3-0.6B: 113 sessions of 8 MB), and a segment's weights are held about twice at once
# (the values read, the session's float copy): the floor keeps SmolLM2's GGUF default convert
# under its 385 MiB bound (BENCHMARKS.md 'Convert time and memory'), the cap an 8B model's
# extra memory small.
SEGMENT_BYTES = 8 << 20
MAX_SEGMENT_BYTES = 64 << 20
SEGMENTS = 32
_INLINE_VALUES = 1024  # initializers up to this many elements may already hold their values
_IN_MEMORY = "fuselm-in-memory"  # an external stand-in's location: never read (values given)
_STORED = "::stored_nk"  # suffix of a weight handed over in its checkpoint's [N, K] layout


def _numel(t: TensorProto) -> int:
    n = 1
    for d in t.dims:
        n *= int(d)
    return n


def _nbytes(t: TensorProto) -> int:
    size = helper.tensor_dtype_to_np_dtype(t.data_type).itemsize if t.data_type else 4
    return _numel(t) * size


def _has_values(t: TensorProto) -> bool:
    return t.data_location != TensorProto.EXTERNAL and bool(
        t.raw_data or t.float_data or t.int32_data or t.int64_data or t.double_data
        or t.string_data or t.uint64_data)


@dataclass
class _Segment:
    nodes: list[onnx.NodeProto] = field(default_factory=list)
    weights: list[str] = field(default_factory=list)  # initializer names, in first-use order
    numpy_gather: onnx.NodeProto | None = None  # a lone Gather of a large table, done in NumPy
    inputs: list[str] = field(default_factory=list)  # values it needs from earlier segments
    outputs: list[str] = field(default_factory=list)  # values it hands on (or that are wanted)


def _needed(model: onnx.ModelProto, wanted: Sequence[str]) -> list[onnx.NodeProto]:
    """The nodes on which the wanted values depend, in graph order."""
    producer = {o: n for n in model.graph.node for o in n.output if o}
    keep: set[int] = set()
    stack = [producer[w] for w in wanted if w in producer]
    while stack:
        node = stack.pop()
        if id(node) in keep:
            continue
        keep.add(id(node))
        stack.extend(producer[i] for i in node.input if i in producer)
    return [n for n in model.graph.node if id(n) in keep]


def segment_size(model: onnx.ModelProto) -> int:
    """The default weight bytes per segment for `model` (SEGMENTS of its weights, bounded)."""
    total = sum(_nbytes(t) for t in model.graph.initializer if _numel(t) > _INLINE_VALUES)
    return max(SEGMENT_BYTES, min(MAX_SEGMENT_BYTES, total // SEGMENTS))


def plan(
    model: onnx.ModelProto, wanted: Sequence[str], segment_bytes: int | None = None
) -> list[_Segment]:
    """Cut the nodes the wanted values need into segments of about `segment_bytes` weights
    (None: `segment_size(model)`)."""
    inits = {t.name: t for t in model.graph.initializer}
    if segment_bytes is None:
        segment_bytes = segment_size(model)
    nodes = _needed(model, wanted)
    segments: list[_Segment] = []
    cur = _Segment()
    size = 0
    for node in nodes:
        big = [i for i in node.input if i in inits and _numel(inits[i]) > _INLINE_VALUES]
        if (node.op_type == "Gather" and node.domain in ("", "ai.onnx") and big
                and node.input[0] in big):
            axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
            if axis == 0:
                if cur.nodes:
                    segments.append(cur)
                segments.append(_Segment(numpy_gather=node))
                cur, size = _Segment(), 0
                continue
        add = sum(_nbytes(inits[i]) for i in big if i not in cur.weights)
        if cur.nodes and size + add > segment_bytes:
            segments.append(cur)
            cur, size = _Segment(), 0
        cur.nodes.append(node)
        for i in node.input:
            if i in inits and i not in cur.weights:
                cur.weights.append(i)
        size += add
    if cur.nodes:
        segments.append(cur)
    # What each segment reads from before it, and what it must hand on.
    wanted_set = set(wanted)
    later_use: set[str] = set(wanted_set)
    for seg in reversed(segments):
        seg_nodes = [seg.numpy_gather] if seg.numpy_gather is not None else seg.nodes
        made = {o for n in seg_nodes for o in n.output if o}
        seg.outputs = sorted(made & later_use)
        used = {i for n in seg_nodes for i in n.input if i and i not in inits}
        for n in seg_nodes:  # inputs of nested graphs (If/Loop bodies) count as used too
            for a in n.attribute:
                for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                    used |= {i for sn in sub.node for i in sn.input if i and i not in inits}
        seg.inputs = sorted(used - made)
        later_use = (later_use - made) | set(seg.inputs)
    return segments


def float32_view(model: onnx.ModelProto, load: Callable[[TensorProto], np.ndarray]
                 ) -> tuple[onnx.ModelProto, Callable[[TensorProto], np.ndarray]]:
    """A bfloat16 graph as a float32 one, and the `load` that reads its weights upcast (exact):
    onnxruntime's CPU provider has no bfloat16 kernels for MatMul, Attention, ... (the fuselm
    runtimes compute bfloat16 in float32 on a CPU too). Other graphs come back as they are."""
    bf16, f32 = TensorProto.BFLOAT16, TensorProto.FLOAT
    typed = [*model.graph.input, *model.graph.output, *model.graph.value_info]
    if not (any(t.data_type == bf16 for t in model.graph.initializer)
            or any(v.type.tensor_type.elem_type == bf16 for v in typed)):
        return model, load
    wide = onnx.ModelProto()
    wide.CopyFrom(model)  # the structure only: the large weights are data-less stand-ins
    g = wide.graph
    stand_ins: dict[str, TensorProto] = {}
    for t in g.initializer:
        if t.data_type != bf16:
            continue
        if _has_values(t):
            t.CopyFrom(numpy_helper.from_array(
                numpy_helper.to_array(t).astype(np.float32), t.name))
        else:
            stand_ins[t.name] = TensorProto()
            stand_ins[t.name].CopyFrom(t)
            t.data_type = f32
    for v in [*g.input, *g.output]:
        if v.type.tensor_type.elem_type == bf16:
            v.type.tensor_type.elem_type = f32
    del g.value_info[:]
    for n in g.node:
        for a in n.attribute:
            if n.op_type == "Cast" and a.name == "to" and a.i == bf16:
                a.i = f32
            elif a.type == onnx.AttributeProto.TENSOR and a.t.data_type == bf16:
                a.t.CopyFrom(numpy_helper.from_array(
                    numpy_helper.to_array(a.t).astype(np.float32), a.t.name))

    def load_wide(t: TensorProto) -> np.ndarray:
        if t.name not in stand_ins:
            return load(t)
        return load(stand_ins[t.name]).astype(np.float32)

    return wide, load_wide


def run(
    model: onnx.ModelProto,
    load: Callable[[TensorProto], np.ndarray],
    chunks: Sequence[dict[str, np.ndarray]],
    wanted: Sequence[str],
    on_value: Callable[[str, int, np.ndarray], None],
    segment_bytes: int | None = None,
) -> None:
    """Run `model` on each chunk's feeds (graph inputs), segment by segment; call
    `on_value(name, chunk_index, array)` for every wanted value, chunks in order within each
    value. `load(t)` gives any initializer's values (the model may hold data-less stand-ins)."""
    import onnxruntime as ort

    inits = {t.name: t for t in model.graph.initializer}
    segments = plan(model, wanted, segment_bytes)
    live = [dict(c) for c in chunks]
    wanted_set = set(wanted)
    for si, seg in enumerate(segments):
        if seg.numpy_gather is not None:
            node = seg.numpy_gather
            table = load(inits[node.input[0]])
            results = [{node.output[0]: np.take(table, v[node.input[1]], axis=0)} for v in live]
            del table
        else:
            seg_model, weights = _segment_model(model, seg, inits, load, live[0])
            so = ort.SessionOptions()
            so.log_severity_level = 3
            if weights:  # handed over in memory: never copied into the model's bytes
                so.add_external_initializers(
                    list(weights), [ort.OrtValue.ortvalue_from_numpy(a) for a in weights.values()])
            sess = ort.InferenceSession(seg_model.SerializeToString(), so,
                                        providers=["CPUExecutionProvider"])
            del weights
            results = []
            for v in live:
                outs = sess.run(seg.outputs, {i: v[i] for i in seg.inputs})
                results.append(dict(zip(seg.outputs, outs, strict=True)))
            del sess, so
        for name in seg.outputs:
            if name in wanted_set:
                for ci, r in enumerate(results):
                    on_value(name, ci, r[name])
        keep_after = {i for later in segments[si + 1:] for i in later.inputs}
        for v, r in zip(live, results, strict=True):
            v.update(r)
            for k in [k for k in v if k not in keep_after]:
                del v[k]


def _segment_model(
    model: onnx.ModelProto,
    seg: _Segment,
    inits: dict[str, TensorProto],
    load: Callable[[TensorProto], np.ndarray],
    sample: dict[str, np.ndarray],
) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """One segment as a model: its nodes, typed inputs, its outputs, and its weights (read
    now): the small ones inside it, the others as external stand-ins whose values (C order)
    come back beside it, for onnxruntime's `add_external_initializers`."""
    inputs = [
        helper.make_tensor_value_info(
            name, helper.np_dtype_to_tensor_dtype(sample[name].dtype), None)
        for name in seg.inputs
    ]
    outputs = [helper.make_empty_tensor_value_info(name) for name in seg.outputs]
    tensors = []
    weights: dict[str, np.ndarray] = {}
    transposes: list[onnx.NodeProto] = []
    for name in seg.weights:
        t = inits[name]
        if _has_values(t):
            tensors.append(t)
            continue
        value = load(t)
        if value.size <= _INLINE_VALUES:
            tensors.append(numpy_helper.from_array(value, name))
            continue
        stored = name
        if value.ndim == 2 and not value.flags.c_contiguous and value.T.flags.c_contiguous:
            # a [K, N] weight read as the transpose of its checkpoint's [N, K] rows: handed
            # over as stored and transposed by onnxruntime's constant folding (its blocked
            # kernel; NumPy's strided copy of a transposed float16 view costs ~5 ns a value)
            stored, value = f"{name}{_STORED}", value.T
            transposes.append(helper.make_node("Transpose", [stored], [name], perm=[1, 0]))
        weights[stored] = np.ascontiguousarray(value)
        stub = TensorProto(name=stored, data_type=helper.np_dtype_to_tensor_dtype(value.dtype),
                           dims=value.shape, data_location=TensorProto.EXTERNAL)
        entry = stub.external_data.add()
        entry.key, entry.value = "location", _IN_MEMORY
        tensors.append(stub)
    graph = helper.make_graph([*transposes, *seg.nodes], "segment", inputs, outputs, tensors)
    m = helper.make_model(graph, opset_imports=list(model.opset_import),
                          ir_version=model.ir_version)
    m.functions.extend(f for f in model.functions if f.domain != ops.DOMAIN)
    if any(n.domain == ops.DOMAIN for n in seg.nodes):
        ops.attach_functions(m)
    return m, weights
