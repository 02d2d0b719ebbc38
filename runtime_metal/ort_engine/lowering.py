"""onnxruntime's CPU lowering of a fuselm artifact, built in memory when the engine loads it.

The artifact stays standard ONNX (fuselm ops with ONNX bodies). onnxruntime's CPU provider has
faster kernels for what those ops mean, in its `com.microsoft` contrib domain, and no float16
kernels for most of them (it would wrap each in Casts). So, at load time only:

- activations in float32: each float16 initializer is read through a Cast that onnxruntime
  folds at session creation (the Q4 codes and zero points are untouched; scales become float32,
  which is exact), graph inputs/outputs and casts to float16 become float32;
- `Add` + `RMSNormalization` → `SkipSimplifiedLayerNormalization` (the residual sum is its 4th
  output), a lone `RMSNormalization` → `SimplifiedLayerNormalization`;
- `FusedRoPE` + `Attention` → per-head `SimplifiedLayerNormalization` for q/k-norm, then
  `GroupQueryAttention` with the rotation inside (`do_rotary`, cos/sin tables from the node's
  inv_freq through passes.ops.rope_cos_sin) and a KV buffer shared by past and present
  (`past_present_share_buffer`: the engine binds one buffer to both, so no concat per step);
  a sliding window (Gemma's local layers, Mistral, Phi-3) is GroupQueryAttention's
  `local_window_size`, read per layer off the mask that layer's Attention takes (`_windows`);
- Q4 `DequantizeLinear` + `MatMul` (and FusedQKV / FusedGateUp's bodies) are left for
  onnxruntime to fuse into `MatMulNBits` at the engine's accuracy level; fused ops fed by a
  dequantize node and `DequantizeAffine` weights are written so that it can
  (ort_engine/dequant_matmul.py);
- a `logits_from` input: the LM head runs only from that position on (the engine asks for the
  last position unless it wants every position's logits);
- a Q4 embedding lookup → `GatherBlockQuantized` on the packed table (ort_gather_q4.py), not
  onnxruntime's unpacked uint8 copy of it;
- Q4 tensors whose zero points are all 8 (symmetric) become int4 codes without zero points
  (ort_int4.py: exact), so onnxruntime's MatMulNBits runs them on its faster kernel;
- 6-bit codes (fuselm.UnpackUInt6 of an initializer) are unpacked to 8-bit ones
  (ort_engine/unpack6.py: exact), which MatMulNBits takes and 6-bit ones it does not.

The KV inputs then hold `capacity` positions (the engine's buffer); `attention_mask`'s length
says how many are valid, as onnxruntime-genai drives it. Anything this lowering does not cover
(dynamic-NTK / LongRoPE, partial rotary, a mask other than the causal one with or without a
sliding window) makes `lower` return None with the reason, and the engine runs the plain graph.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from fuselm.passes.ops import ROPE_ATTRS, rope_cos_sin
from fuselm.runtime_metal.artifact import Manifest
from fuselm.runtime_metal.graph_io import PAST
from fuselm.runtime_metal.manifest_schema import onnx_inputs
from fuselm.runtime_metal.ort_engine import dequant_matmul
from fuselm.runtime_metal.ort_engine.gather_q4 import packed_gathers
from fuselm.runtime_metal.ort_engine.int4 import symmetric_to_int4
from fuselm.runtime_metal.ort_engine.unpack6 import expand_six_bit

MS = "com.microsoft"
F16, BF16, F32 = TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.FLOAT
HALF = (F16, BF16)  # 16-bit floats, computed in float32 on the CPU


@dataclass
class Lowered:
    model: onnx.ModelProto  # its external tensors still point into the artifact's folder
    rope_positions: int  # positions the cos/sin tables cover (0: no rotary in the graph)
    artifact_inputs: dict[str, list[int | str | None]]  # the artifact's own graph inputs
    artifact_past_dtype: str | None  # and its KV dtype (the lowered graph's is float32)
    # codes given in memory: symmetric Q4 as int4 (ort_engine/int4.py), 6-bit unpacked
    # (ort_engine/unpack6.py)
    memory_values: dict[str, object] | None = None

    @property
    def int4_count(self) -> int:
        """Symmetric Q4 tensors rewritten as int4."""
        return sum(name.endswith("__int4") for name in self.memory_values or ())


class NotLowered(Exception):
    """The artifact uses something this lowering does not cover (the message says what)."""


def _attrs(node: onnx.NodeProto) -> dict[str, object]:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def lower_for_cpu(model_file: Path, manifest: Manifest, exact_rows: bool = False
                  ) -> Lowered | str:
    """The lowered model, or a string saying why the plain graph is used instead.
    `exact_rows`: every GroupQueryAttention gets a dummy query row after the step's own
    (`_attention`), so a step of several tokens computes each position exactly as a one-token
    step does."""
    try:
        model = onnx.load(str(model_file), load_external_data=False)
    except Exception as e:  # onnxruntime reports an unreadable file when the plain path loads it
        return f"unreadable model ({type(e).__name__})"
    inputs = onnx_inputs(model)
    past_dtype = _past_dtype(model)
    base_dir = Path(model_file).parent
    try:
        _coverable(model, manifest)  # before 6-bit weights are read and unpacked for nothing
        unpacked = expand_six_bit(model.graph, base_dir)  # _lower prunes the packed bytes
        model, positions = _lower(model, manifest, exact_rows, base_dir)
    except NotLowered as e:
        return str(e)
    values = symmetric_to_int4(model, base_dir)
    if values:
        _prune(model)  # the uint4 codes and zero points nothing reads any more
    return Lowered(model, positions, inputs, past_dtype, {**unpacked, **values})


def float32_plain(model_file: Path) -> tuple[onnx.ModelProto, str | None]:
    """The artifact's own graph with float32 activations and nothing else changed, and its KV
    dtype: how a bfloat16 artifact runs where the lowering does not cover it (onnxruntime's
    CPU provider has no bfloat16 MatMul, Attention, ... and, unlike for float16, inserts no
    Casts around them)."""
    model = onnx.load(str(model_file), load_external_data=False)
    past_dtype = _past_dtype(model)
    _to_float32(model)
    return model, past_dtype


def _past_dtype(model: onnx.ModelProto) -> str | None:
    kv_types = {i.type.tensor_type.elem_type for i in model.graph.input if PAST.match(i.name)}
    return {F16: "float16", BF16: "bfloat16", F32: "float32"}.get(next(iter(kv_types), 0))


def _coverable(model: onnx.ModelProto, manifest: Manifest) -> None:
    """The refusals that need no rewriting: NotLowered saying why."""
    if manifest.model.head_dim % 16:
        raise NotLowered(f"head_dim {manifest.model.head_dim} (GroupQueryAttention on CPU needs "
                         "a multiple of 16)")
    if any(n.domain not in ("", "fuselm") for n in model.graph.node):
        raise NotLowered("a node outside the ONNX and fuselm domains")


def _lower(model: onnx.ModelProto, manifest: Manifest, exact_rows: bool, base_dir: Path
           ) -> tuple[onnx.ModelProto, int]:
    g = model.graph
    dequant_matmul.rewrite(g)  # before the float32 casts, which then cover its nodes too
    _to_float32(model)
    producer = {o: n for n in g.node for o in n.output}
    uses = Counter(i for n in g.node for i in n.input)
    uses.update(o.name for o in g.output)
    new_nodes: list[onnx.NodeProto] = []
    inits: list[TensorProto] = []
    drop: set[int] = set()
    masks = {n.input[3] for n in g.node if n.op_type == "Attention"}
    windows = _windows(model, masks, manifest.model.sliding_window)
    tables: dict[tuple, tuple[str, str]] = {}
    positions = 0
    seq = _seqlens(new_nodes, exact_rows) if masks else ("", "")

    for n in g.node:
        if n.op_type == "RMSNormalization":
            a = _attrs(n)
            if a.get("axis", -1) != -1 or a.get("stash_type", 1) != 1:
                raise NotLowered("an RMSNormalization over other than the last axis")
            add = producer.get(n.input[0])
            eps = float(a.get("epsilon", 1e-5))
            if add is not None and add.op_type == "Add" and id(add) not in drop:
                drop.add(id(add))
                n.CopyFrom(helper.make_node(
                    "SkipSimplifiedLayerNormalization", [add.input[0], add.input[1], n.input[1]],
                    [n.output[0], "", "", add.output[0]], name=n.name, domain=MS, epsilon=eps))
            else:
                n.CopyFrom(helper.make_node(
                    "SimplifiedLayerNormalization", [n.input[0], n.input[1]], [n.output[0]],
                    name=n.name, axis=-1, epsilon=eps, stash_type=1))
        elif n.op_type == "Attention":
            rope = producer.get(n.input[0])
            if rope is not None and rope.op_type != "FusedRoPE":
                rope = None
            positions = max(positions, _attention(n, rope, seq, manifest, new_nodes, inits,
                                                  tables, uses, windows[n.input[3]],
                                                  exact_rows))
            if rope is not None:
                drop.add(id(rope))
    if any(n.op_type == "FusedRoPE" and id(n) not in drop for n in g.node):
        raise NotLowered("a FusedRoPE whose outputs do not go straight to one Attention")
    kept = [n for n in g.node if id(n) not in drop]
    # Each Add folded into a Skip norm must have been consumed only by the norm and later nodes
    # reading its sum, which the Skip norm's 4th output now provides under the same name.
    del g.node[:]
    g.node.extend(new_nodes + kept)
    g.initializer.extend(inits)
    packed_gathers(g, base_dir)
    _topological(g)
    _logits_from(g)
    _prune(model)
    used_ops = {(n.domain, n.op_type) for n in g.node}
    keep_f = [f for f in model.functions if (f.domain, f.name) in used_ops]
    del model.functions[:]
    model.functions.extend(keep_f)
    if not any(o.domain == MS for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS, 1))
    return model, positions


def _logits_from(g: onnx.GraphProto) -> None:
    """A `logits_from` input [1]: the LM head runs on positions logits_from.. only, so a prompt
    whose last logits are all the engine needs does not pay the head for every position. The
    final norm is per position, so the hidden states are sliced right after it."""
    norms = [n for n in g.node if n.op_type in (
        "SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization")]
    if not norms:
        raise NotLowered("no final norm")
    h = norms[-1].output[0]
    g.node.extend([
        helper.make_node("Constant", [], ["lower/end"], value=numpy_helper.from_array(
            np.array([np.iinfo(np.int64).max], np.int64))),
        helper.make_node("Constant", [], ["lower/axis1"], value=numpy_helper.from_array(
            np.array([1], np.int64))),
    ])
    for n in g.node:
        for i, name in enumerate(n.input):
            if name == h:
                n.input[i] = "lower/head_in"
    g.node.append(helper.make_node("Slice", [h, "logits_from", "lower/end", "lower/axis1"],
                                   ["lower/head_in"]))
    g.input.append(helper.make_tensor_value_info("logits_from", TensorProto.INT64, [1]))
    _topological(g)


def _to_float32(model: onnx.ModelProto) -> None:
    """float32 activations: float16 and bfloat16 initializers read through a Cast (folded by
    onnxruntime at session creation: bfloat16 weights are held as float32, twice their size),
    16-bit casts, constants and graph I/O made float32."""
    g = model.graph
    renamed: dict[str, str] = {}
    casts = []
    for t in g.initializer:
        if t.data_type in HALF:
            renamed[t.name] = f"{t.name}__f32"
            casts.append(helper.make_node("Cast", [t.name], [renamed[t.name]], to=F32))
    for n in g.node:
        for i, name in enumerate(n.input):
            if name in renamed:
                n.input[i] = renamed[name]
        if n.op_type == "Cast":
            for a in n.attribute:
                if a.name == "to" and a.i in HALF:
                    a.i = F32
        if n.op_type == "Constant":
            for a in n.attribute:
                if a.name == "value" and a.t.data_type in HALF:
                    a.t.CopyFrom(numpy_helper.from_array(
                        numpy_helper.to_array(a.t).astype(np.float32), a.t.name))
        elif any(a.type == onnx.AttributeProto.TENSOR and a.t.data_type in HALF
                 for a in n.attribute):
            raise NotLowered(f"a 16-bit float {n.op_type} attribute")
    for out in [*g.output, *g.input]:
        if out.type.tensor_type.elem_type in HALF:
            out.type.tensor_type.elem_type = F32
    del g.value_info[:]
    old = list(g.node)
    del g.node[:]
    g.node.extend(casts + old)


def _seqlens(nodes: list[onnx.NodeProto], exact_rows: bool = False) -> tuple[str, str]:
    """seqlens_k [batch] = valid positions - 1 and total_sequence_length (a scalar), int32,
    from attention_mask [batch, total] — its length is the total, its ones the valid ones.
    exact_rows: both one more, for the dummy query row each attention appends (_attention)."""
    c = [
        helper.make_node("Constant", [], ["lower/one"], value=numpy_helper.from_array(
            np.array([1], np.int64))),
        helper.make_node("ReduceSum", ["attention_mask", "lower/one"], ["lower/valid"],
                         keepdims=0),
        helper.make_node("Sub", ["lower/valid", "lower/one"], ["lower/seqlens64"]),
        helper.make_node("Cast", ["lower/seqlens64"], ["lower/seqlens_k"], to=TensorProto.INT32),
        helper.make_node("Shape", ["attention_mask"], ["lower/total64"], start=1, end=2),
        helper.make_node("Constant", [], ["lower/scalar"], value=numpy_helper.from_array(
            np.array([], np.int64))),
        helper.make_node("Reshape", ["lower/total64", "lower/scalar"], ["lower/total64s"]),
        helper.make_node("Cast", ["lower/total64s"], ["lower/total"], to=TensorProto.INT32),
    ]
    if exact_rows:
        c += [
            helper.make_node("Cast", ["lower/valid"], ["lower/seqlens_k_rows"],
                             to=TensorProto.INT32),
            helper.make_node("Constant", [], ["lower/one_s"], value=numpy_helper.from_array(
                np.array(1, np.int64))),
            helper.make_node("Add", ["lower/total64s", "lower/one_s"], ["lower/total64_rows"]),
            helper.make_node("Cast", ["lower/total64_rows"], ["lower/total_rows"],
                             to=TensorProto.INT32),
            # [b, s, d] -> [b, s + 1, d] (a zero row after the step's tokens), and back
            helper.make_node("Constant", [], ["lower/row_pads"], value=numpy_helper.from_array(
                np.array([0, 0, 0, 0, 1, 0], np.int64))),
            helper.make_node("Constant", [], ["lower/zero"], value=numpy_helper.from_array(
                np.array([0], np.int64))),
            helper.make_node("Constant", [], ["lower/minus_one"], value=numpy_helper.from_array(
                np.array([-1], np.int64))),
        ]
        nodes.extend(c)
        return "lower/seqlens_k_rows", "lower/total_rows"
    nodes.extend(c)
    return "lower/seqlens_k", "lower/total"


def _windows(model: onnx.ModelProto, masks: set[str], window: int | None) -> dict[str, int]:
    """Each attention mask's GroupQueryAttention `local_window_size` (-1: no window), found by
    evaluating the mask's own nodes (onnx's reference evaluator, a few hundred small ops) for a
    prefill and a decode step past the window and comparing them with the causal mask, with and
    without the manifest's window. A query at position q sees keys q - window < k <= q
    (export/decoder.py `attention_mask_4d`, as transformers: `window` keys, itself included),
    which is what onnxruntime's CPU kernel makes of `local_window_size` = window (measured:
    window - 1 leaves the query's own key plus window - 2 before it; test_ort_lowering.py
    checks the logits against transformers past the window). A mask that is neither is not
    lowered."""
    from onnx.reference import ReferenceEvaluator

    if not masks:
        return {}
    g = model.graph
    needed, nodes = set(masks), []
    for n in reversed(g.node):
        if any(o in needed for o in n.output):
            nodes.append(n)
            needed.update(i for i in n.input if i)
    inits = [t for t in g.initializer if t.name in needed]
    if any(t.data_location == TensorProto.EXTERNAL for t in inits):
        raise NotLowered("an attention mask computed from stored weights")
    names = sorted(masks)
    sub = helper.make_model(
        helper.make_graph(nodes[::-1], "masks", [i for i in g.input if i.name in needed],
                          [helper.make_tensor_value_info(m, TensorProto.BOOL, None)
                           for m in names], inits),
        opset_imports=list(model.opset_import))
    total = (window or 1) + 3
    candidates = {-1: None, **({window: window} if window else {})}
    found = dict.fromkeys(names, set(candidates))
    for seq in (total, 1):
        feeds = {"input_ids": np.zeros((1, seq), np.int64),
                 "attention_mask": np.ones((1, total), np.int64),
                 "position_ids": np.arange(total - seq, total, dtype=np.int64)[None]}
        try:
            got = ReferenceEvaluator(sub).run(
                None, {i.name: feeds[i.name] for i in sub.graph.input})
        except Exception as e:  # an op or input the evaluator cannot compute here
            raise NotLowered(f"an attention mask that cannot be evaluated ({e})") from e
        k = np.arange(total)[None, :]
        q = np.arange(total - seq, total)[:, None]
        for name, mask in zip(names, got, strict=True):
            mask = np.asarray(mask).reshape(-1, total)
            found[name] = {c for c in found[name] if mask.shape[0] == seq and np.array_equal(
                mask, (k <= q) & (k > q - (candidates[c] or total + 1)))}
    if any(len(f) != 1 for f in found.values()):
        raise NotLowered("an attention mask other than the causal one, with or without the "
                         "model's sliding window")
    return {name: next(iter(f)) for name, f in found.items()}


def _attention(att: onnx.NodeProto, rope: onnx.NodeProto | None, seq: tuple[str, str],
               manifest: Manifest, nodes: list[onnx.NodeProto], inits: list[TensorProto],
               tables: dict[tuple, tuple[str, str]], uses: Counter, window: int = -1,
               exact_rows: bool = False) -> int:
    """Replace one Attention (and its FusedRoPE) by GroupQueryAttention; the positions its
    rotary table covers.

    exact_rows: q, k and v get a zero row after the step's s tokens, and the output loses
    it, so GroupQueryAttention always multiplies probabilities by V for at least two query
    rows. For one row (a decode step) MLAS's SGEMM takes its single-row kernel, which rounds
    unlike the kernel for several rows (a several-token step: prefill, a speculative check)
    by ~1e-7; accuracy level 4 quantizes the next MatMulNBits' activations to int8, where
    such a difference can move a value across a rounding step, and the logits end up apart by
    up to ~3.6 on SmolLM2-135M (BENCHMARKS.md 'Speculative decoding'). With the dummy row
    every step runs the several-row kernel, whose result for a row does not depend on the
    rows beside it. The dummy's K/V land one position past the step's (the next step
    overwrites them): the engine keeps that position in its buffer and the rotary tables
    cover one more."""
    a = _attrs(att)
    if len(att.input) != 6 or len(att.output) != 3 or "" in att.output[1:]:
        raise NotLowered("an Attention without past/present key and value")
    if a.get("is_causal", 0) or a.get("qk_matmul_output_mode", 0):
        raise NotLowered("an Attention with is_causal or qk output")
    q, k, v = att.input[0], att.input[1], att.input[2]
    gqa_in = [q, k, v, att.input[4], att.input[5], seq[0], seq[1]]
    extra: dict[str, object] = {}
    positions = 0
    if rope is not None:
        r = {**ROPE_ATTRS, **_attrs(rope)}
        if rope.output[0] != q or rope.output[1] != k or uses[q] != 1 or uses[k] != 1:
            raise NotLowered("a FusedRoPE feeding more than its Attention")
        if float(r["dynamic_factor"]) > 0 or int(r["long_after"]) > 0:
            raise NotLowered("dynamic-NTK or LongRoPE frequencies")
        head_dim, rotary_dim = int(r["head_dim"]), int(r["rotary_dim"])
        if rotary_dim != head_dim:
            raise NotLowered("partial rotary embedding")
        q, k = rope.input[0], rope.input[1]
        norms = [rope.input[i] if len(rope.input) > i else "" for i in (3, 4)]
        if any(norms):
            if not all(norms):
                raise NotLowered("a q/k-norm on one of q and k only")
            q = _head_norm(att.name + "/q", q, norms[0], head_dim, float(r["norm_eps"]), nodes)
            k = _head_norm(att.name + "/k", k, norms[1], head_dim, float(r["norm_eps"]), nodes)
        positions = max(manifest.model.context_length, 1)
        key = (tuple(np.asarray(r["inv_freq"], np.float32).tolist()),
               float(r["attention_scale"]), int(r["interleaved"]))
        if key not in tables:
            tables[key] = _rope_tables(len(tables), key, positions + exact_rows, inits)
        gqa_in = [q, k, v, att.input[4], att.input[5], seq[0], seq[1], *tables[key]]
        extra = {"do_rotary": 1, "rotary_interleaved": int(r["interleaved"])}
    outs = list(att.output)
    if exact_rows:
        for i in range(3):
            padded = f"{att.name}/gqa_in{i}_rows"
            nodes.append(helper.make_node("Pad", [gqa_in[i], "lower/row_pads"], [padded]))
            gqa_in[i] = padded
        outs[0] = f"{att.name}/gqa_out_rows"
        nodes.append(helper.make_node("Slice", [outs[0], "lower/zero", "lower/minus_one",
                                                "lower/one"], [att.output[0]]))
    nodes.append(helper.make_node(
        "GroupQueryAttention", gqa_in, outs, name=att.name + "/gqa", domain=MS,
        num_heads=int(a["q_num_heads"]), kv_num_heads=int(a["kv_num_heads"]),
        scale=float(a.get("scale", 0.0)), softcap=float(a.get("softcap", 0.0)),
        local_window_size=window, **extra))
    att.op_type = "_lowered"  # removed by _prune: nothing reads its outputs any more
    del att.output[:]
    del att.input[:]
    return positions


def _head_norm(prefix: str, x: str, weight: str, head_dim: int, eps: float,
               nodes: list[onnx.NodeProto]) -> str:
    """RMS norm of each head of x [b, s, H·D] (Qwen3's q/k-norm), back to [b, s, H·D]."""
    shape4 = numpy_helper.from_array(np.array([0, 0, -1, head_dim], np.int64))
    shape3 = numpy_helper.from_array(np.array([0, 0, -1], np.int64))
    nodes.extend([
        helper.make_node("Constant", [], [prefix + "/s4"], value=shape4),
        helper.make_node("Constant", [], [prefix + "/s3"], value=shape3),
        helper.make_node("Reshape", [x, prefix + "/s4"], [prefix + "/heads"]),
        helper.make_node("SimplifiedLayerNormalization", [prefix + "/heads", weight],
                         [prefix + "/normed"], axis=-1, epsilon=eps, stash_type=1),
        helper.make_node("Reshape", [prefix + "/normed", prefix + "/s3"], [prefix + "/out"]),
    ])
    return prefix + "/out"


def _rope_tables(i: int, key: tuple, positions: int, inits: list[TensorProto]) -> tuple[str, str]:
    """cos/sin caches [positions, rotary_dim / 2] in GroupQueryAttention's layout, from the one
    definition of the rotation's tables (passes.ops.rope_cos_sin)."""
    inv_freq, scale, interleaved = np.asarray(key[0], np.float32), key[1], key[2]
    pos = np.arange(positions, dtype=np.int64)[None, :]
    cos, sin = rope_cos_sin(pos, inv_freq, scale, interleaved)
    half = len(inv_freq)
    pick = (lambda t: t[0, :, 0, 0::2]) if interleaved else (lambda t: t[0, :, 0, :half])
    names = (f"lower/rope{i}_cos", f"lower/rope{i}_sin")
    for name, t in zip(names, (cos, sin), strict=True):
        inits.append(numpy_helper.from_array(np.ascontiguousarray(pick(t)), name))
    return names


def _prune(model: onnx.ModelProto) -> None:
    """Drop nodes and initializers nothing reaches the outputs through."""
    g = model.graph
    needed = {o.name for o in g.output}
    keep = []
    for n in reversed(g.node):
        if any(o in needed for o in n.output if o):
            keep.append(n)
            needed.update(i for i in n.input if i)
    del g.node[:]
    g.node.extend(reversed(keep))
    inits = [t for t in g.initializer if t.name in needed]
    del g.initializer[:]
    g.initializer.extend(inits)
    inputs = [i for i in g.input if i.name in needed or i.name.startswith("past_key_values.")]
    del g.input[:]
    g.input.extend(inputs)


def _topological(g: onnx.GraphProto) -> None:
    """Order nodes so each comes after the producers of its inputs (new nodes were prepended)."""
    ready = {i.name for i in g.input} | {t.name for t in g.initializer} | {""}
    pending, out = list(g.node), []
    while pending:
        rest = []
        for n in pending:
            if all(i in ready for i in n.input):
                out.append(n)
                ready.update(n.output)
            else:
                rest.append(n)
        if len(rest) == len(pending):
            raise NotLowered("a graph cycle after lowering")
        pending = rest
    del g.node[:]
    g.node.extend(out)
