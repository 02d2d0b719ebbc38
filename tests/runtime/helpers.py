"""Small shared helpers for runtime tests: single-node ONNX models run through both runtimes."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from fuselm.passes import ops as contract
from fuselm.runtime_metal.dtypes import to_host
from fuselm.runtime_metal.loader import LoadedGraph
from fuselm.runtime_metal.mlx_engine.executor import Executor
from fuselm.runtime_metal.mlx_engine.plan import build_plan


def _info(name: str, arr: np.ndarray) -> onnx.ValueInfoProto:
    elem = helper.np_dtype_to_tensor_dtype(arr.dtype)
    return helper.make_tensor_value_info(name, elem, None)


def node_model(
    node: onnx.NodeProto,
    feeds: dict[str, np.ndarray],
    outputs: list[str],
    initializers: dict[str, np.ndarray] | None = None,
) -> onnx.ModelProto:
    inits = [onnx.numpy_helper.from_array(v, k) for k, v in (initializers or {}).items()]
    graph = helper.make_graph(
        [node],
        "t",
        [_info(k, v) for k, v in feeds.items()],
        [helper.make_tensor_value_info(o, onnx.TensorProto.FLOAT, None) for o in outputs],
        inits,
    )
    opsets = [helper.make_opsetid("", contract.ONNX_OPSET)]
    if node.domain == contract.DOMAIN:
        opsets.append(helper.make_opsetid(contract.DOMAIN, contract.DOMAIN_VERSION))
    model = helper.make_model(graph, opset_imports=opsets, ir_version=10)  # ORT 1.30 reads <= 13
    if node.domain == contract.DOMAIN:
        contract.attach_functions(model)
    return model


def run_mlx(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    weights = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    plan = build_plan(LoadedGraph(model, weights, path=None))  # type: ignore[arg-type]
    out = Executor(plan).run(dict(feeds))
    return [to_host(out[o.name]) for o in model.graph.output]


def run_ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)
