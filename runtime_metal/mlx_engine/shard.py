"""One rank's share of a fused graph, for a model run over several processes (mx.distributed).

`shard_graph(model, mode, rank, size, ...)` rewrites a weight-less ModelProto in place into
the graph this rank runs and returns the `Cut` of every initializer it keeps: the slices of
the stored tensor it reads (loader.read_weights reads only those bytes of model.onnx.data).

- tensor: each layer's attention heads and MLP columns are split over the ranks. FusedQKV
  (or a q/k/v MatMul) and FusedGateUp keep the rank's output columns (heads, MLP channels);
  o_proj and down_proj keep the matching input rows, each followed by one `fuselm.dist::AllSum`
  (a bias added after it stays whole: added once). Attention's head counts, FusedQKV's sizes
  and the KV inputs' head dims shrink to the rank's. The LM head keeps the rank's vocabulary
  columns, gathered back by `AllGatherLast`; an embedding table (a tied head's is the same
  tensor) keeps the same vocabulary rows: ids outside them look up row 0 (`ShardIndex`) and
  are zeroed before one `VocabSum` adds the ranks' rows. Blocked (Q4 / 6-bit / 8-bit) weights
  keep their blocks: blocks run along the input dimension, so a column split is free and a row
  split must fall on block boundaries (refused otherwise); 6-bit codes (fuselm.UnpackUInt6's
  bytes, four codes in three along the rows) are cut at 3/4 of the rows' bounds.
- pipeline: contiguous layer ranges. Rank r keeps the nodes of its layers (rank 0 the
  embedding, the last rank the final norm and LM head), receives the hidden state from r - 1
  (`PipeRecv`) and sends its own to r + 1 (`PipeSend`); the logits reach every rank through
  `PipeLogits` (one sum over the ranks, where only the last adds non-zeros), so every rank
  samples the same token. Its KV inputs are renumbered from 0.

What a graph cannot do is refused with the reason (`ShardError`); `split_report` says, for
`fuselm inspect`, whether a split works and how many weight bytes each rank holds.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import onnx
from onnx import TensorProto, helper

from fuselm.runtime_metal.graph_io import LOGITS, LOGITS_PART, PAST, PRESENT
from fuselm.runtime_metal.loader import Cut

DOMAIN = "fuselm.dist"
MODES = ("tensor", "pipeline")
_PASS_THROUGH = ("Cast",)
_DEQUANT = ("DequantizeLinear", "DequantizeAffine")
_UNPACK6 = "UnpackUInt6"  # fuselm's: 6-bit codes, four in three bytes along axis 0
_FOUR_BIT = (TensorProto.UINT4, TensorProto.INT4)
# the hidden state pipeline ranks pass on, by the engine's activation dtype (else float32)
_HIDDEN_TYPES = {"float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}


class ShardError(ValueError):
    """The graph cannot be split this way; the message says why."""


@dataclass
class _Graph:
    model: onnx.ModelProto
    inits: dict[str, TensorProto] = field(default_factory=dict)
    producer: dict[str, onnx.NodeProto] = field(default_factory=dict)
    consumers: dict[str, list[onnx.NodeProto]] = field(default_factory=dict)

    @classmethod
    def of(cls, model: onnx.ModelProto) -> _Graph:
        g = cls(model, {t.name: t for t in model.graph.initializer})
        for n in model.graph.node:
            for o in n.output:
                if o:
                    g.producer[o] = n
            for i in n.input:
                if i:
                    g.consumers.setdefault(i, []).append(n)
        return g


def _attr(node: onnx.NodeProto, name: str, default: object = None) -> object:
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _set_attr(node: onnx.NodeProto, name: str, value: object) -> None:
    for i, a in enumerate(node.attribute):
        if a.name == name:
            del node.attribute[i]
            break
    node.attribute.append(helper.make_attribute(name, value))


def _even(total: int, size: int, rank: int) -> tuple[int, int]:
    step = total // size
    return rank * step, (rank + 1) * step


class _Cuts:
    """Cuts per initializer; one tensor cut two different ways is refused."""

    def __init__(self, g: _Graph) -> None:
        self.g = g
        self.cuts: dict[str, Cut] = {}

    def add(self, name: str, axis: int, spans: Iterable[tuple[int, int]]) -> None:
        t = self.g.inits[name]
        if not t.dims:  # one value for the whole tensor: every rank keeps it
            return
        cut = Cut(tuple(t.dims), axis, tuple(spans))
        old = self.cuts.get(name)
        if old is not None and old != cut:
            raise ShardError(f"weight {name!r} is read by two projections that split it "
                             "differently")
        self.cuts[name] = cut

    def weight(self, tensor: str, axis: int, spans: list[tuple[int, int]], what: str) -> None:
        """Cut the weight a MatMul-like op reads as [K, N] (axis 0: rows K, 1: columns N),
        following a Transpose / Cast / DequantizeLinear / DequantizeAffine to the stored
        tensors (a dequantize's scales and zero points follow its blocks)."""
        if tensor in self.g.inits:
            self.add(tensor, axis, spans)
            return
        node = self.g.producer.get(tensor)
        if node is None:
            raise ShardError(f"{what}: its weight {tensor!r} is not a stored tensor")
        if node.op_type in _PASS_THROUGH:
            self.weight(node.input[0], axis, spans, what)
        elif node.op_type == "Transpose":
            perm = list(_attr(node, "perm", [1, 0]))  # type: ignore[arg-type]
            if perm != [1, 0]:
                raise ShardError(f"{what}: weight transposed by {perm}")
            self.weight(node.input[0], 1 - axis, spans, what)
        elif node.op_type in _DEQUANT:
            block = int(_attr(node, "block_size", 0) or 0)  # type: ignore[arg-type]
            qaxis = int(_attr(node, "axis", 1))  # type: ignore[arg-type]
            self.blocked(list(node.input), axis, spans, qaxis % 2, block, what)
        elif node.op_type == _UNPACK6:
            if axis == 0 and any(a % 4 or b % 4 for a, b in spans):
                raise ShardError(f"{what}: a split at {spans} would cut its 6-bit codes' "
                                 "groups of four rows")
            self.weight(node.input[0], axis,
                        spans if axis else [(3 * a // 4, 3 * b // 4) for a, b in spans], what)
        else:
            raise ShardError(f"{what}: weight made by {node.op_type}")

    def blocked(self, names: list[str], axis: int, spans: list[tuple[int, int]], qaxis: int,
                block: int, what: str) -> None:
        """codes [K, N] with scales / zero points along `qaxis`: in blocks of `block` there
        (their other dims the codes'), or one per channel of it (block 0: 1-D)."""
        codes, *params = [n for n in names if n]
        self.weight(codes, axis, spans, what)
        if not block:  # per channel: cut with the codes only along their own axis
            if axis == qaxis:
                for p in params:
                    self.weight(p, 0, spans, what)
            return
        if axis != qaxis:  # the split runs across the blocks: parameters split the same way
            for p in params:
                self.weight(p, axis, spans, what)
            return
        if any(a % block or b % block for a, b in spans):
            raise ShardError(f"{what}: a split at {spans} would cut its {block}-wide "
                             "quantization blocks")
        for p in params:
            self.weight(p, axis, [(a // block, b // block) for a, b in spans], what)


def _retype_kv(model: onnx.ModelProto, heads: dict[str, int]) -> None:
    for v in list(model.graph.input) + list(model.graph.output):
        if v.name in heads:
            dims = v.type.tensor_type.shape.dim
            if len(dims) == 4 and dims[1].HasField("dim_value"):
                dims[1].dim_value = heads[v.name]


def _insert_after(model: onnx.ModelProto, node: onnx.NodeProto, output_index: int,
                  op_type: str, extra_inputs: list[str], **attrs: object) -> onnx.NodeProto:
    """Rename node's output to OUT.part and make OUT with `op_type(OUT.part, *extra)`."""
    name = node.output[output_index]
    part = LOGITS_PART if name == LOGITS else f"{name}.part"
    node.output[output_index] = part
    new = helper.make_node(op_type, [part, *extra_inputs], [name], domain=DOMAIN,
                           name=f"{op_type}:{name}", **attrs)
    nodes = model.graph.node
    at = list(nodes).index(node)
    nodes.insert(at + 1, new)
    return new


def _embedding_gathers(g: _Graph) -> list[onnx.NodeProto]:
    return [n for n in g.model.graph.node
            if n.op_type == "Gather" and len(n.input) > 1 and n.input[1] == "input_ids"]


def _vocab_axis(g: _Graph, tensor: str, axis: int) -> list[tuple[str, int]]:
    """The stored tensors (and their axis) behind `tensor`'s `axis`, through Cast/Transpose."""
    if tensor in g.inits:
        return [(tensor, axis)]
    node = g.producer.get(tensor)
    if node is not None and (node.op_type in _PASS_THROUGH
                             or (node.op_type == _UNPACK6 and axis == 1)):  # bytes along axis 0
        return _vocab_axis(g, node.input[0], axis)
    if node is not None and node.op_type == "Transpose":
        perm = list(_attr(node, "perm", [1, 0]))  # type: ignore[arg-type]
        return _vocab_axis(g, node.input[0], perm[axis])
    raise ShardError(f"the embedding reads {tensor!r}, which is not a stored table")


def _embedding_output(g: _Graph, gathers: list[onnx.NodeProto]) -> str:
    """The one tensor where the looked-up rows leave the embedding: the gathers, then the
    per-row ops on them (a dequantize, a cast, a constant scale)."""
    inside = {o for n in gathers for o in n.output}
    changed = True
    while changed:
        changed = False
        for n in g.model.graph.node:
            if n.output[0] in inside or n.op_type not in (*_DEQUANT, "Cast", "Mul", "Div"):
                continue
            ins = [i for i in n.input if i]
            if any(i in inside for i in ins) and all(
                    i in inside or i in g.inits or _constant(g, i) for i in ins):
                inside.update(o for o in n.output if o)
                changed = True
    leaving = [t for t in inside if any(c.output[0] not in inside for c in g.consumers.get(t, []))
               or t in {o.name for o in g.model.graph.output}]
    if len(leaving) != 1:
        raise ShardError(f"the embedding's rows leave it through {len(leaving)} tensors")
    return leaving[0]


def _constant(g: _Graph, tensor: str) -> bool:
    node = g.producer.get(tensor)
    return node is not None and node.op_type == "Constant"


def _split_vocab(g: _Graph, cuts: _Cuts, rank: int, size: int, vocab: int) -> None:
    lo, hi = _even(vocab, size, rank)
    head = g.producer.get(LOGITS)
    if head is None or head.op_type != "MatMul":
        raise ShardError("the logits are not made by a MatMul (the LM head)")
    cuts.weight(head.input[1], 1, [(lo, hi)], "the LM head")
    _insert_after(g.model, head, 0, "AllGatherLast", [])
    gathers = _embedding_gathers(g)
    if not gathers:
        return
    out = _embedding_output(g, gathers)
    for n in gathers:
        for name, axis in _vocab_axis(g, n.input[0], int(_attr(n, "axis", 0))):  # type: ignore[arg-type]
            cuts.add(name, axis, [(lo, hi)])
        n.input[1] = "input_ids.shard"
    nodes = g.model.graph.node
    first = min(list(nodes).index(n) for n in gathers)
    nodes.insert(first, helper.make_node("ShardIndex", ["input_ids"], ["input_ids.shard"],
                                         domain=DOMAIN, name="ShardIndex", lo=lo, hi=hi))
    _insert_after(g.model, g.producer[out], list(g.producer[out].output).index(out),
                  "VocabSum", ["input_ids"], lo=lo, hi=hi)


def _qkv_source(g: _Graph, attn: onnx.NodeProto, index: int) -> tuple[onnx.NodeProto, int]:
    """The node (and its output) that makes Attention input `index`, through FusedRoPE."""
    tensor = attn.input[index]
    node = g.producer[tensor]
    if node.op_type == "FusedRoPE":
        tensor = node.input[list(node.output).index(tensor)]
        node = g.producer[tensor]
    return node, list(node.output).index(tensor)


def _split_heads(g: _Graph, cuts: _Cuts, rank: int, size: int) -> dict[str, int]:
    """Attention heads and MLP columns; returns the KV inputs' new head counts."""
    kv_heads: dict[str, int] = {}
    for attn in [n for n in g.model.graph.node if n.op_type == "Attention"]:
        hq, hk = int(_attr(attn, "q_num_heads", 0)), int(_attr(attn, "kv_num_heads", 0))  # type: ignore[arg-type]
        if not hq or not hk:
            raise ShardError(f"{attn.name}: Attention without head counts (3-D q/k/v)")
        if hq % size or hk % size:
            raise ShardError(f"{hq} query / {hk} KV heads do not divide over {size} ranks")
        _set_attr(attn, "q_num_heads", hq // size)
        _set_attr(attn, "kv_num_heads", hk // size)
        for i in (4, 5):
            if len(attn.input) > i and attn.input[i]:
                kv_heads[attn.input[i]] = hk // size
        for o in attn.output[1:3]:
            if o:
                kv_heads[o] = hk // size
        src, _ = _qkv_source(g, attn, 0)
        what = f"{attn.name}'s q/k/v"
        if src.op_type == "FusedQKV":
            sizes = [int(_attr(src, k)) for k in ("q_size", "k_size", "v_size")]  # type: ignore[arg-type]
            spans, start = [], 0
            for s in sizes:
                a, b = _even(s, size, rank)
                spans.append((start + a, start + b))
                start += s
            _cut_columns(g, cuts, src, spans, what)
            for k, s in zip(("q_size", "k_size", "v_size"), sizes, strict=True):
                _set_attr(src, k, s // size)
        else:
            for i in range(3):
                node, _ = _qkv_source(g, attn, i)
                _cut_projection(g, cuts, node, rank, size, f"{what} ({'qkv'[i]})")
        o_proj = _only_consumer(g, attn.output[0], "MatMul", f"{attn.name}'s output")
        _cut_rows_and_sum(g, cuts, o_proj, rank, size, f"{attn.name}'s o_proj")
    for gu in [n for n in g.model.graph.node if n.op_type == "FusedGateUp"]:
        half = _weight_dims(g, gu.input[1])[1] // 2
        if half % size:
            raise ShardError(f"{half} MLP channels do not divide over {size} ranks")
        a, b = _even(half, size, rank)
        _cut_columns(g, cuts, gu, [(a, b), (half + a, half + b)], f"{gu.name}")
        down = _only_consumer(g, gu.output[0], "MatMul", f"{gu.name}'s output")
        _cut_rows_and_sum(g, cuts, down, rank, size, f"{gu.name}'s down projection")
    return kv_heads


def _weight_dims(g: _Graph, tensor: str) -> tuple[int, int]:
    """(K, N) of the weight a MatMul-like op reads, from the stored tensor behind it."""
    if tensor in g.inits:
        k, n = (list(g.inits[tensor].dims) + [1, 1])[:2]
        return int(k), int(n)
    node = g.producer[tensor]
    k, n = _weight_dims(g, node.input[0])
    if node.op_type == _UNPACK6:  # bytes [3K/4, N]
        return k * 4 // 3, n
    return (n, k) if node.op_type == "Transpose" else (k, n)


def _cut_columns(g: _Graph, cuts: _Cuts, node: onnx.NodeProto, spans: list[tuple[int, int]],
                 what: str) -> None:
    """A FusedQKV / FusedGateUp keeps `spans` of its packed output columns: the weight's
    columns (Q4: codes, scales, zero points) and its bias."""
    ins = list(node.input) + [""] * (5 - len(node.input))
    if ins[2]:  # Q4 codes with scales (and zero points), blocked along K
        cuts.blocked(ins[1:4], 1, spans, 0, int(_attr(node, "block_size", 32)), what)  # type: ignore[arg-type]
    else:
        cuts.weight(ins[1], 1, spans, what)
    if ins[4]:
        cuts.weight(ins[4], 0, spans, what)


def _cut_projection(g: _Graph, cuts: _Cuts, node: onnx.NodeProto, rank: int, size: int,
                    what: str) -> None:
    """A q, k or v MatMul (+ bias Add) keeps its share of the output columns."""
    bias = None
    if node.op_type == "Add":
        bias, node = node, g.producer[node.input[0]]
    if node.op_type != "MatMul":
        raise ShardError(f"{what} is made by {node.op_type}, not a projection")
    a, b = _even(_weight_dims(g, node.input[1])[1], size, rank)
    cuts.weight(node.input[1], 1, [(a, b)], what)
    if bias is not None:
        cuts.weight(bias.input[1], 0, [(a, b)], what)


def _only_consumer(g: _Graph, tensor: str, op_type: str, what: str) -> onnx.NodeProto:
    users = g.consumers.get(tensor, [])
    if len(users) != 1 or users[0].op_type != op_type:
        raise ShardError(f"{what} is read by {[u.op_type for u in users]}, not one {op_type}")
    return users[0]


def _cut_rows_and_sum(g: _Graph, cuts: _Cuts, matmul: onnx.NodeProto, rank: int, size: int,
                      what: str) -> None:
    rows = _weight_dims(g, matmul.input[1])[0]
    if rows % size:
        raise ShardError(f"{what}: {rows} input rows do not divide over {size} ranks")
    cuts.weight(matmul.input[1], 0, [_even(rows, size, rank)], what)
    _insert_after(g.model, matmul, 0, "AllSum", [])


# ---- pipeline ------------------------------------------------------------------------------

def layer_ranges(layers: int, size: int) -> list[tuple[int, int]]:
    """Contiguous layer ranges, the first ranks one layer longer when they do not divide."""
    base, extra = divmod(layers, size)
    out, start = [], 0
    for r in range(size):
        n = base + (1 if r < extra else 0)
        out.append((start, start + n))
        start += n
    return out


def _ancestors(g: _Graph, tensor: str, seen: set[int]) -> set[int]:
    """Ids of the nodes `tensor` depends on."""
    stack = [tensor]
    while stack:
        node = g.producer.get(stack.pop())
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        stack.extend(i for i in node.input if i)
    return seen


def _descendants(g: _Graph, tensors: Iterable[str]) -> set[int]:
    out: set[int] = set()
    stack = list(tensors)
    while stack:
        for node in g.consumers.get(stack.pop(), []):
            if id(node) not in out:
                out.add(id(node))
                stack.extend(o for o in node.output if o)
    return out


def _split_layers(g: _Graph, rank: int, size: int, hidden: int, dtype: str) -> None:
    model = g.model
    nodes = list(model.graph.node)
    attn = {}
    for n in nodes:
        if n.op_type == "Attention" and len(n.input) > 4 and (m := PAST.match(n.input[4])):
            attn[int(m.group(1))] = n
    layers = len(attn)
    if sorted(attn) != list(range(layers)) or layers < size:
        raise ShardError(f"{layers} layers cannot be split over {size} ranks")
    ranges = layer_ranges(layers, size)
    gathers = _embedding_gathers(g)
    if not gathers:
        raise ShardError("no embedding lookup of input_ids found")
    hidden_nodes = (_descendants(g, [o for n in gathers for o in n.output])
                    | {id(n) for n in gathers})
    index = {id(n): i for i, n in enumerate(nodes)}
    # where each stage's nodes start: at the readers of the residual stream entering its first
    # layer (the tensor between the layers that is read both on the way to that layer's
    # attention and by a later node: the skip connection)
    starts = [0]
    for first, _ in ranges[1:]:
        anc = _ancestors(g, attn[first].output[0], set())
        after = _descendants(g, [attn[first - 1].output[0]])
        cut = [o for n in nodes if id(n) in anc and id(n) in after
               for o in n.output if o
               and any(id(u) in anc for u in g.consumers.get(o, []))
               and any(id(u) not in anc and id(u) in hidden_nodes
                       for u in g.consumers.get(o, []))]
        if len(cut) != 1:
            raise ShardError(f"no single hidden state enters layer {first} ({cut})")
        starts.append(min(index[id(u)] for u in g.consumers[cut[0]] if id(u) in anc))
    starts.append(len(nodes))

    def stage(n: onnx.NodeProto) -> int:
        i = index[id(n)]
        return max(s for s in range(size) if starts[s] <= i)

    # the tensors crossing into this stage, and out of it
    def crossing(s: int) -> list[str]:
        out = []
        for n in nodes:
            if id(n) in hidden_nodes and stage(n) < s:
                for o in n.output:
                    users = [u for u in g.consumers.get(o, []) if id(u) in hidden_nodes]
                    if any(stage(u) >= s for u in users):
                        if any(stage(u) > s for u in users):
                            raise ShardError(f"{o!r} skips a pipeline stage")
                        out.append(o)
        return out

    incoming = crossing(rank) if rank > 0 else []
    outgoing = crossing(rank + 1) if rank < size - 1 else []
    lo, hi = ranges[rank]
    # which nodes this rank runs: its stage's hidden nodes, and what they need that is not
    # hidden (constant chains, the masks, the positions)
    keep: set[int] = set()
    for n in nodes:
        if id(n) in hidden_nodes and stage(n) == rank:
            keep.add(id(n))
    stack = [i for n in nodes if id(n) in keep for i in n.input if i]
    while stack:
        t = stack.pop()
        node = g.producer.get(t)
        if node is None or id(node) in keep or t in incoming:
            continue
        if id(node) in hidden_nodes:
            raise ShardError(f"stage {rank} needs {t!r} from another stage")
        keep.add(id(node))
        stack.extend(i for i in node.input if i)
    kept = [n for n in nodes if id(n) in keep]
    new: list[onnx.NodeProto] = []
    hidden_type = _HIDDEN_TYPES.get(dtype, TensorProto.FLOAT)
    for t in incoming:
        new.append(helper.make_node("PipeRecv", ["input_ids"], [t], domain=DOMAIN,
                                    name=f"PipeRecv:{t}", src=rank - 1, width=hidden,
                                    elem_type=hidden_type))
    new.extend(kept)
    if rank < size - 1:
        sent = []
        for t in outgoing:
            sent.append(f"{t}.sent")
            new.append(helper.make_node("PipeSend", [t], [f"{t}.sent"], domain=DOMAIN,
                                        name=f"PipeSend:{t}", dst=rank + 1,
                                        elem_type=hidden_type))
        vocab = _vocab_size(model)
        new.append(helper.make_node("PipeLogits", sent, [LOGITS], domain=DOMAIN,
                                    name="PipeLogits", vocab=vocab, own=0))
    del model.graph.node[:]
    model.graph.node.extend(new)
    if rank == size - 1:
        head = next(n for n in model.graph.node if LOGITS in n.output)
        _insert_after(model, head, list(head.output).index(LOGITS), "PipeLogits", [],
                      vocab=_vocab_size(model), own=1)
    _renumber_kv(model, lo, hi)


def _vocab_size(model: onnx.ModelProto) -> int:
    for o in model.graph.output:
        if o.name == LOGITS:
            d = o.type.tensor_type.shape.dim
            if d and d[-1].HasField("dim_value"):
                return int(d[-1].dim_value)
    raise ShardError("the logits output has no static vocabulary size")


def _renumber_kv(model: onnx.ModelProto, lo: int, hi: int) -> None:
    """This rank's layers' KV inputs/outputs become layers 0..hi-lo-1; the others go."""
    def local(name: str) -> str | None:
        m = PAST.match(name) or PRESENT.match(name)
        if not m:
            return name
        layer = int(m.group(1))
        if not lo <= layer < hi:
            return None
        prefix = "past_key_values" if name.startswith("past") else "present"
        return f"{prefix}.{layer - lo}.{m.group(2)}"

    for seq in (model.graph.input, model.graph.output):
        keep = []
        for v in seq:
            name = local(v.name)
            if name is not None:
                v.name = name
                keep.append(v)
        del seq[:]
        seq.extend(keep)
    for n in model.graph.node:
        for i, t in enumerate(n.input):
            if t and (PAST.match(t) or PRESENT.match(t)):
                n.input[i] = local(t) or ""
        for i, t in enumerate(n.output):
            if t and (PAST.match(t) or PRESENT.match(t)):
                n.output[i] = local(t) or ""


# ---- entry points --------------------------------------------------------------------------

def shard_graph(model: onnx.ModelProto, mode: str, rank: int, size: int, *, hidden: int,
                vocab: int, dtype: str) -> dict[str, Cut]:
    """Rewrite `model` (initializers without data) into rank `rank`'s graph; return the cut
    of every initializer it keeps (others are removed from the graph). hidden and vocab are
    the manifest's; dtype names the engine's activation dtype (a pipeline's hidden state)."""
    if mode not in MODES:
        raise ShardError(f"unknown parallel mode {mode!r}; choose from {', '.join(MODES)}")
    g = _Graph.of(model)
    cuts = _Cuts(g)
    if mode == "tensor":
        if vocab % size:
            raise ShardError(f"a vocabulary of {vocab} does not divide over {size} ranks")
        kv = _split_heads(g, cuts, rank, size)
        _split_vocab(g, cuts, rank, size, vocab)
        _retype_kv(model, kv)
    else:
        _split_layers(g, rank, size, hidden, dtype)
    used = {i for n in model.graph.node for i in n.input if i}
    keep = [t for t in model.graph.initializer if t.name in used]
    out: dict[str, Cut] = {}
    for t in keep:
        cut = cuts.cuts.get(t.name, Cut(tuple(t.dims)))
        out[t.name] = cut
        del t.dims[:]
        t.dims.extend(cut.shape)
    del model.graph.initializer[:]
    model.graph.initializer.extend(keep)
    return out


def stored_bytes(dims: Iterable[int], data_type: int) -> int:
    n = 1
    for d in dims:
        n *= int(d)
    if data_type in _FOUR_BIT:
        return (n + 1) // 2
    return n * helper.tensor_dtype_to_np_dtype(data_type).itemsize


@dataclass
class SplitReport:
    mode: str
    size: int
    error: str = ""  # why the split is refused ("" = it works)
    rank_bytes: list[int] = field(default_factory=list)  # weight bytes each rank reads
    layers: list[tuple[int, int]] = field(default_factory=list)  # pipeline: each rank's range


def split_report(model: onnx.ModelProto, mode: str, size: int, *, hidden: int, vocab: int,
                 dtype: str) -> SplitReport:
    """Whether `model` splits over `size` ranks in `mode`, and each rank's weight bytes."""
    report = SplitReport(mode, size)
    types = {t.name: t.data_type for t in model.graph.initializer}
    for rank in range(size):
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        try:
            cuts = shard_graph(copy, mode, rank, size, hidden=hidden, vocab=vocab, dtype=dtype)
        except ShardError as e:
            report.error = str(e)
            return report
        report.rank_bytes.append(sum(stored_bytes(c.shape, types[n]) for n, c in cuts.items()))
    if mode == "pipeline":
        layers = sum(1 for i in model.graph.input if (m := PAST.match(i.name))
                     and m.group(2) == "key")
        report.layers = layer_ranges(layers, size)
    return report
