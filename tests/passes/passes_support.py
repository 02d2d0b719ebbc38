"""Shared test support for the passes: onnxruntime runs, feeds, a tiny graph builder.

onnxruntime always runs with its graph optimizations disabled, so its own fusions cannot hide
a bad rewrite.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from fuselm.passes.graph import PassResult
from fuselm.passes.model_io import check, to_graph, to_model
from fuselm.runtime_metal.validate import rel  # the one error metric (docs/DESIGN.md)


def session(model: onnx.ModelProto) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    s = session(model)
    names = {i.name for i in s.get_inputs()}
    return s.run(None, {k: v for k, v in feeds.items() if k in names})


def max_rel(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    assert len(a) == len(b)
    return max(rel(x, y) for x, y in zip(a, b, strict=True))


def _dim(d: onnx.TensorShapeProto.Dimension) -> int | None:
    return d.dim_value if d.HasField("dim_value") else None


def decoder_feeds(model: onnx.ModelProto, *, batch: int = 2, seq: int = 5, past: int = 3,
                  vocab: int = 384, seed: int = 0) -> dict[str, np.ndarray]:
    """Random inputs in the optimum I/O convention; past length 0 if the model has no cache."""
    rng = np.random.default_rng(seed)
    names = [i.name for i in model.graph.input]
    if not any(n.startswith("past_key_values") for n in names):
        past = 0
    feeds: dict[str, np.ndarray] = {}
    for i in model.graph.input:
        if i.name == "input_ids":
            feeds[i.name] = rng.integers(0, vocab, (batch, seq)).astype(np.int64)
        elif i.name == "attention_mask":
            feeds[i.name] = np.ones((batch, past + seq), np.int64)
        elif i.name == "position_ids":
            feeds[i.name] = np.tile(np.arange(past, past + seq), (batch, 1)).astype(np.int64)
        elif i.name.startswith("past_key_values"):
            dims = [_dim(d) for d in i.type.tensor_type.shape.dim]
            feeds[i.name] = rng.standard_normal((batch, dims[1], past, dims[3])).astype(np.float32)
    return feeds


def apply(model: onnx.ModelProto, p) -> tuple[onnx.ModelProto, PassResult]:  # noqa: ANN001
    """One pass over a copy of `model`; the result passes onnx.checker + strict inference."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    graph = to_graph(m)
    result = p.run(graph)
    out = to_model(graph, template=m)
    check(out)
    return out, result


def op_counts(model: onnx.ModelProto) -> Counter[str]:
    return Counter(n.op_type for n in model.graph.node)


def functions_attached(model: onnx.ModelProto) -> bool:
    used = {n.op_type for n in model.graph.node if n.domain == "fuselm"}
    have = {f.name for f in model.functions if f.domain == "fuselm"}
    return used == have


class G:
    """A tiny ONNX graph builder for hand-written pattern tests."""

    def __init__(self, seed: int = 0) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self.n = 0
        self.rng = np.random.default_rng(seed)

    def _name(self, hint: str) -> str:
        self.n += 1
        return f"{hint}{self.n}"

    def input(self, name: str, shape: list, dtype: int = TensorProto.FLOAT) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, dtype, shape))
        return name

    def const(self, value: np.ndarray | float | list, hint: str = "c") -> str:
        arr = np.asarray(value)
        if arr.dtype == np.float64:
            arr = arr.astype(np.float32)
        name = self._name(hint)
        self.inits.append(numpy_helper.from_array(arr, name))
        return name

    def weight(self, *shape: int, scale: float = 0.2) -> str:
        return self.const(self.rng.standard_normal(shape).astype(np.float32) * scale, "w")

    def op(self, op_type: str, *inputs: str, n_out: int = 1, domain: str = "", **attrs):  # noqa: ANN201
        outs = [self._name(op_type.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, domain=domain, **attrs))
        return outs[0] if n_out == 1 else outs

    def output(self, name: str, new_name: str | None = None) -> str:
        if new_name is not None:
            self.nodes.append(helper.make_node("Identity", [name], [new_name]))
            name = new_name
        self.outputs.append(helper.make_tensor_value_info(name, TensorProto.UNDEFINED, None))
        return name

    def model(self) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, "g", self.inputs, self.outputs, self.inits)
        m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
        m.ir_version = 10
        m = onnx.shape_inference.infer_shapes(m)
        # outputs typed by inference, so the checker accepts them
        vi = {v.name: v for v in m.graph.value_info}
        for o in m.graph.output:
            if o.name in vi:
                o.CopyFrom(vi[o.name])
        return m


def causal_mask(batch: int, seq: int, past: int) -> np.ndarray:
    i = np.arange(seq)[:, None] + past
    j = np.arange(past + seq)[None, :]
    return np.broadcast_to(j <= i, (batch, 1, seq, past + seq)).copy()


def attention_block(
    g: G,
    x: str,
    pos: str,
    mask: str | None,
    *,
    hidden: int,
    heads: int = 4,
    kv: int = 2,
    d: int = 6,
    qk_norm: bool = False,
    rope: str | None = "decomposed",  # "decomposed" | "op" | None
    past: tuple[str, str] | None = None,
    core: str = "softmax",  # "softmax" | "op"
    bias: bool = False,
    rotate_v: bool = False,  # a third rotation (refusal case)
) -> tuple[str, tuple[str, str] | None]:
    """HF-style attention written the way exporters decompose it; returns (out3, presents)."""

    def proj(n: int) -> str:
        y = g.op("MatMul", x, g.weight(hidden, n))
        return g.op("Add", y, g.const(g.rng.standard_normal(n) * 0.1)) if bias else y

    q, k, v = proj(heads * d), proj(kv * d), proj(kv * d)
    shape4 = g.const(np.array([0, 0, -1, d], np.int64))

    def view(t: str, norm: bool) -> str:
        r = g.op("Reshape", t, shape4)
        if norm:
            r = g.op("RMSNormalization", r, g.const(1 + 0.1 * g.rng.standard_normal(d)),
                     axis=-1, epsilon=1e-6)
        return g.op("Transpose", r, perm=[0, 2, 1, 3])

    q4, k4, v4 = view(q, qk_norm), view(k, qk_norm), view(v, False)
    if rope is not None:
        inv = g.const(1.0 / (10000 ** (np.arange(0, d, 2) / d)))
        f = g.op("Mul", g.op("Cast", g.op("Unsqueeze", pos, g.const(np.array([2]))), to=1), inv)
        if rope == "op":
            cos, sin = g.op("Cos", f), g.op("Sin", f)

            def rot(t: str) -> str:
                return g.op("RotaryEmbedding", t, cos, sin)
        else:
            emb = g.op("Concat", f, f, axis=-1)
            cos = g.op("Unsqueeze", g.op("Cos", emb), g.const(np.array([1])))
            sin = g.op("Unsqueeze", g.op("Sin", emb), g.const(np.array([1])))
            h = d // 2

            def rot(t: str) -> str:
                hi = g.op("Slice", t, g.const(np.array([h])), g.const(np.array([2**62])),
                          g.const(np.array([3])))
                lo = g.op("Slice", t, g.const(np.array([0])), g.const(np.array([h])),
                          g.const(np.array([3])))
                rh = g.op("Concat", g.op("Neg", hi), lo, axis=-1)
                return g.op("Add", g.op("Mul", t, cos), g.op("Mul", rh, sin))
        q4, k4 = rot(q4), rot(k4)
        if rotate_v:
            v4 = rot(v4)
    presents = None
    if past is not None:
        k4 = g.op("Concat", past[0], k4, axis=2)
        v4 = g.op("Concat", past[1], v4, axis=2)
        presents = (k4, v4)
    if core == "op":
        y4 = g.op("Attention", q4, k4, v4, *([mask] if mask else []), scale=d**-0.5)
    else:
        if heads != kv:
            def repeat(t: str) -> str:
                shp = g.op("Concat", g.op("Shape", t, start=0, end=2),
                           g.const(np.array([heads // kv])), g.op("Shape", t, start=2), axis=0)
                e = g.op("Expand", g.op("Unsqueeze", t, g.const(np.array([2]))), shp)
                return g.op("Reshape", e, g.const(np.array([0, heads, -1, d], np.int64)))
            k4, v4 = repeat(k4), repeat(v4)
        s = g.op("Mul", g.op("MatMul", q4, g.op("Transpose", k4, perm=[0, 1, 3, 2])),
                 g.const(np.float32(d**-0.5)))
        if mask:
            s = g.op("Add", s, g.op("Where", mask, g.const(np.float32(0)),
                                   g.const(np.float32(-3.4e38))))
        y4 = g.op("MatMul", g.op("Softmax", s, axis=-1), v4)
    y = g.op("Reshape", g.op("Transpose", y4, perm=[0, 2, 1, 3]),
             g.const(np.array([0, 0, -1], np.int64)))
    return y, presents


def layer_model(*, batch: int = 2, seq: int = 3, past: int = 2, hidden: int = 16,
                cache: bool = True, mlp: bool = True, **kw) -> tuple[onnx.ModelProto, dict]:  # noqa: ANN003
    """A one-layer decoder block graph in the exporters' decomposed form, with its feeds."""
    heads, kv, d = kw.get("heads", 4), kw.get("kv", 2), kw.get("d", 6)
    g = G()
    x = g.input("x", ["b", "s", hidden])
    pos = g.input("position_ids", ["b", "s"], TensorProto.INT64)
    mask = g.input("mask", ["b", 1, "s", "t"], TensorProto.BOOL)
    pk = (g.input("past_key", ["b", kv, "p", d]), g.input("past_value", ["b", kv, "p", d])) \
        if cache else None
    h = g.op("RMSNormalization", x, g.const(np.ones(hidden, np.float32)), axis=-1, epsilon=1e-6)
    y, presents = attention_block(g, h, pos, mask, hidden=hidden, past=pk, **kw)
    o = g.op("Add", x, g.op("MatMul", y, g.weight(heads * d, hidden)))
    if mlp:
        h2 = g.op("RMSNormalization", o, g.const(np.ones(hidden, np.float32)), axis=-1)
        gate = g.op("MatMul", h2, g.weight(hidden, 24))
        up = g.op("MatMul", h2, g.weight(hidden, 24))
        act = g.op("Mul", gate, g.op("Sigmoid", gate))
        o = g.op("Add", o, g.op("MatMul", g.op("Mul", act, up), g.weight(24, hidden)))
    g.output(o, "out")
    if presents:
        g.output(presents[0], "present_key")
        g.output(presents[1], "present_value")
    rng = np.random.default_rng(1)
    p = past if cache else 0
    feeds = {
        "x": rng.standard_normal((batch, seq, hidden)).astype(np.float32),
        "position_ids": np.tile(np.arange(p, p + seq), (batch, 1)).astype(np.int64),
        "mask": causal_mask(batch, seq, p),
    }
    if cache:
        feeds["past_key"] = rng.standard_normal((batch, kv, p, d)).astype(np.float32)
        feeds["past_value"] = rng.standard_normal((batch, kv, p, d)).astype(np.float32)
    return g.model(), feeds


def hf_logits_and_greedy(model_dir, prompt: np.ndarray, steps: int) -> tuple[np.ndarray, list[int]]:  # noqa: ANN001
    """HF transformers float32: prompt logits and `steps` greedy tokens (full recompute)."""
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    hf.eval()
    ids = torch.from_numpy(prompt)
    with torch.no_grad():
        logits = hf(input_ids=ids).logits.numpy()
        tokens: list[int] = []
        for _ in range(steps):
            nxt = int(hf(input_ids=ids).logits[0, -1].argmax())
            tokens.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return logits, tokens


def ort_logits_and_greedy(model: onnx.ModelProto, prompt: np.ndarray, steps: int
                          ) -> tuple[np.ndarray, list[int]]:
    """The same through onnxruntime: with the KV cache when the model has one."""
    s = session(model)
    inputs = {i.name: i for i in model.graph.input}
    pasts = [n for n in inputs if n.startswith("past_key_values")]
    cache: dict[str, np.ndarray] = {}
    for n in pasts:
        dims = [_dim(d) for d in inputs[n].type.tensor_type.shape.dim]
        cache[n] = np.zeros((1, dims[1], 0, dims[3]), np.float32)
    out_names = [o.name for o in s.get_outputs()]
    step_ids, total, tokens = prompt, 0, []
    first = None
    while len(tokens) < steps:
        seq = step_ids.shape[1]
        feeds = {"input_ids": step_ids,
                 "attention_mask": np.ones((1, total + seq), np.int64),
                 "position_ids": np.arange(total, total + seq, dtype=np.int64)[None], **cache}
        res = dict(zip(out_names, s.run(None, feeds), strict=True))
        first = res["logits"] if first is None else first
        tokens.append(int(res["logits"][0, -1].argmax()))
        if pasts:
            cache = {n: res[n.replace("past_key_values", "present")] for n in pasts}
            total += seq
            step_ids = np.array([[tokens[-1]]], np.int64)
        else:
            step_ids = np.concatenate([step_ids, np.array([[tokens[-1]]], np.int64)], axis=1)
    return first, tokens
