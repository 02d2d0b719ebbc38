"""4-bit block quantization of linear weights: W4, blocks of 32 along the reduction axis.

The stored form is the standard one fixed by docs/DESIGN.md, so every ONNX runtime runs it and
onnxruntime fuses it into `MatMulNBits`:

    plain projection   MatMul(x, W)            -> MatMul(x, DequantizeLinear(codes, scales, zp,
                                                                 axis=0, block_size=B))
    fused projection   FusedQKV / FusedGateUp  -> inputs 1/2/3 = codes, scales, zp; attr block_size
    embedding (opt-in) Gather(E, ids)          -> Gather(DequantizeLinear(E codes, axis=1), ids)
    LM head (default)  MatMul(h, W_head)       -> as a plain projection

Defaults follow the peers (onnxruntime-genai's int4 builder and mlx-lm quantize the LM head):
the LM head is quantized unless `lm_head=False` (`--no-quant-lm-head`); a table tied to it goes
with it, stored once; an untied embedding table stays float unless `embeddings=True`.

Scales and zero points are chosen per block by an error-minimizing search (quant/q4_search.py,
`method="search"`, the default; never worse than the min/max formula below on any block).
Optional, decided before any weight is written (the jobs are found first): a block size per
tensor under a bits budget (`bits_budget`, passes/quant/q4_allocate.py); the search weighted by each
input channel's importance — RMSNorm's gamma^2 data-free (`norm_importance`), or the activations
of a calibration text (`calibration`, passes/quant/q4_calibration.py: mean squares only, or with
GPTQ-style error feedback, passes/quant/q4_gptq.py). The converter's default is the shipped text's
importance under DEFAULT_BITS_BUDGET (converter/calibration_input.py, `resolve_budget`); this
function's own defaults stay data-free. The stored format is the same in every case.

Codes and zero points are uint4 ([K, N] and [ceil(K/B), N]); scales have the weight's float
dtype (float16 in a float16 graph: 4.625 bits per weight at B = 32) but their *values* are always
float16-representable, so MLX's affine form `w = q*s + b` with `b = -zp*s` reproduces the ONNX
weights exactly at float32 compute.

The min/max formula (`method="minmax"`, and the search's first candidate), per block of B
weights w along K (rows k .. k+B-1 of one column n):

    asymmetric:  lo = min(w, 0), hi = max(w, 0)         # the range always holds 0
                 s  = fp16(( hi - lo) / 15)             # round-to-nearest-even to float16
                 zp = clip(rint(-lo / s), 0, 15)
    symmetric:   s  = fp16(max|w| / 7), zp = 8          # q - 8 in [-7, 7]: nothing clips
    codes = clip(rint(w / s) + zp, 0, 15)               # ONNX QuantizeLinear's formula
    w'    = (codes - zp) * s                            # ONNX DequantizeLinear

`rint` is round-half-to-even (NumPy's and ONNX QuantizeLinear's rule), division is float32
division (not a multiply by the reciprocal), so the result is deterministic and bit-reproducible.
A block whose scale is 0 (all zeros) gets s = 0, zp = 0 (asymmetric), codes = zp: it
dequantizes to exact zeros. A weight lying on a 4-bit grid `(q - zp) * s` with q spanning 0..15 and
s a power of two is reproduced exactly (hi - lo = 15 s exactly, so s, zp and q come back).

Symmetric keeps uint4 codes with a fixed zero point of 8 (rather than int4 codes with no zero
point): one storage format for both modes, the same fused-op function-body variant (the zero-point
input stays present), and it is exactly what `MatMulNBits` and MLX's affine kernels expect.

A reduction size K that is not a multiple of B is stored with a partial last block: ONNX blocked
DequantizeLinear defines scales of shape ceil(K/B) along the axis, and the partial block is
quantized from its own values only (no padding values enter its min/max). Such tensors are
listed with `partial_block: true` in the info so a runtime that needs whole groups (MLX) pads
the codes itself.

A tied embedding / LM head (Gather(E) and MatMul(h, Transpose(E)) on one initializer E [V, H])
is quantized as ONE tensor, blocks along H (axis 1 of E, i.e. the LM head's reduction axis): one
DequantizeLinear feeds both uses. Tied, the two flags name the same tensor, so either one
quantizes it (the info records that).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from fuselm.passes import ops, weights
from fuselm.passes.errors import PassesError
from fuselm.passes.quant import q4_search
from fuselm.passes.quant.q4_allocate import allocate_blocks
from fuselm.passes.quant.q4_calibration import Calibration, Moments
from fuselm.passes.quant.q4_math import (  # noqa: F401 - part of this module's API
    METHODS,
    SYMMETRIC_ZERO_POINT,
    Q4Tensor,
    quantize_array,
    quantize_gptq,
    to_uint4,
    uint4_tensor,
)

BITS = 4
BLOCK_SIZES = (32, 64, 128)
QUANT_CHOICES = ("none", "q4")
DEFAULT_BLOCK_SIZE = 32
DEFAULT_METHOD = "search"
# With calibration statistics and no explicit --block-size / --bits-budget: blocks of 32 or 64
# per tensor under this mean (fewer bits than mlx-lm's default 4.5). On SmolLM2 it gives
# +14 % PPL where every tensor at 64 gives +19 % and the data-free block 32 +27 % at 4.625
# (BENCHMARKS.md 'Quantization quality'). Data-free, a budget costs more than it saves
# (+39 % at 4.45), so without statistics the default stays block 32 everywhere.
DEFAULT_BITS_BUDGET = 4.45
FUSED_OPS = ("FusedQKV", "FusedGateUp")
_FLOAT_TYPES = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16)
SPILL_FILE = "quantized.data"  # QuantizeQ4(spill_dir=...): the new tensors' bytes, on disk


# ---------------------------------------------------------------------------------------------
# Options and their validation (the CLI's `--quant q4 --block-size --sym ...`)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class QuantOptions:
    block_size: int = DEFAULT_BLOCK_SIZE
    symmetric: bool = False
    lm_head: bool = True
    embeddings: bool = False
    method: str = DEFAULT_METHOD


def validate_options(
    quant: str | None = "q4",
    *,
    block_size: int | None = DEFAULT_BLOCK_SIZE,
    symmetric: bool = False,
    lm_head: bool | None = None,
    embeddings: bool = False,
    method: str = DEFAULT_METHOD,
    bits_budget: float | None = None,
) -> QuantOptions | None:
    """Check the CLI's quantization options; None means "no quantization".

    `lm_head=None` is the default: quantized with q4. Raises passes.errors.PassesError naming
    the valid values.
    """
    q = (quant or "none").lower()
    if q not in QUANT_CHOICES:
        raise PassesError(
            f"--quant {quant!r} is not supported; valid values: {', '.join(QUANT_CHOICES)}"
        )
    if bits_budget is not None and not 4.3125 <= bits_budget <= 4.625:
        raise PassesError(
            f"--bits-budget {bits_budget} is out of range; give 4.3125 .. 4.625 bits/weight "
            "(every tensor in blocks of 64 .. of 32)")
    if block_size is not None and block_size not in BLOCK_SIZES:
        raise PassesError(
            f"--block-size {block_size} is not supported; valid values: "
            f"{', '.join(str(b) for b in BLOCK_SIZES)}"
        )
    if method not in METHODS:
        raise PassesError(
            f"--quant-method {method!r} is not supported; valid values: {', '.join(METHODS)}"
        )
    if q == "none":
        if symmetric or lm_head or embeddings:
            raise PassesError("--sym/--quant-lm-head/--quant-embeddings need --quant q4")
        return None
    return QuantOptions(block_size or DEFAULT_BLOCK_SIZE, symmetric, lm_head is not False,
                        embeddings, method)


def resolve_budget(
    bits_budget: float | None, block_size: int | None, calibrated: bool
) -> float | None:
    """The bits budget a conversion uses: the one asked for; else DEFAULT_BITS_BUDGET when the
    weights have calibration statistics and no block size was asked for; else none."""
    if bits_budget is not None:
        return bits_budget
    return DEFAULT_BITS_BUDGET if calibrated and block_size is None else None


# ---------------------------------------------------------------------------------------------
# The graph pass
# ---------------------------------------------------------------------------------------------


@dataclass
class PassResult:
    """What the pass manager records in fuselm.json's pass report."""

    name: str
    changed: int
    seconds: float
    info: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "changed": self.changed,
            "seconds": round(self.seconds, 3),
            **self.info,
        }


@dataclass
class _Graph:
    """Producer/consumer indexes over the top-level graph."""

    model: onnx.ModelProto
    base_dir: str | None
    load: Callable[[TensorProto], np.ndarray] | None = None  # values of data-less tensors

    def __post_init__(self) -> None:
        g = self.model.graph
        self.inits = {t.name: t for t in g.initializer}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        self.producer: dict[str, onnx.NodeProto] = {}
        for node in g.node:
            for i in node.input:
                if i:
                    self.consumers.setdefault(i, []).append(node)
            for o in node.output:
                self.producer[o] = node
        self.graph_outputs = {o.name for o in g.output}
        self.inits_dtype: dict[str, int] = {}

    def float_init(self, name: str) -> TensorProto | None:
        t = self.inits.get(name)
        if t is None or t.data_type not in _FLOAT_TYPES or len(t.dims) != 2:
            return None
        return t

    def array(self, t: TensorProto) -> np.ndarray:
        """One weight's values, read only now (the caller quantizes, then drops them)."""
        if self.load is not None:
            return self.load(t)
        if self.base_dir is not None and weights.is_external(t):
            return weights.read_array(t, self.base_dir)
        return numpy_helper.to_array(t)

    def used_only_by(self, name: str, nodes: list[onnx.NodeProto]) -> bool:
        ids = {id(n) for n in nodes}
        return name not in self.graph_outputs and all(
            id(c) in ids for c in self.consumers.get(name, [])
        )


def _transpose_of_init(g: _Graph, name: str) -> tuple[onnx.NodeProto, TensorProto] | None:
    """If `name` is Transpose(perm=[1, 0]) of a 2-D float initializer, that node and tensor."""
    node = g.producer.get(name)
    if node is None or node.op_type != "Transpose":
        return None
    perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), [1, 0])
    t = g.float_init(node.input[0])
    if t is None or perm != [1, 0]:
        return None
    return node, t


def _scale_dtype(data_type: int) -> tuple[np.dtype, int | None]:
    """Scales' storage dtype for a weight of `data_type`, and a Cast target if one is needed.

    float16 graph -> float16 scales (4.625 bits/weight); float32 graph -> float32 scales holding
    float16-representable values (onnxruntime's MatMulNBits takes scales in the activation
    type, and DequantizeLinear outputs the scales' type, so this keeps MatMul's types matched);
    bfloat16 -> float32 scales and a Cast back, since float16 values need not be bf16 values.
    """
    if data_type == TensorProto.FLOAT16:
        return np.dtype(np.float16), None
    if data_type == TensorProto.BFLOAT16:
        return np.dtype(np.float32), TensorProto.BFLOAT16
    return np.dtype(np.float32), None


class _Writer:
    def __init__(
        self, g: _Graph, block_size: int, symmetric: bool, method: str,
        spill: Callable[[TensorProto], None] | None = None,
    ) -> None:
        self.g = g
        self.spill = spill
        self.block_size = block_size
        self.symmetric = symmetric
        self.method = method
        self.new_nodes: list[list[onnx.NodeProto]] = []
        self.dead: set[str] = set()  # initializers no longer used
        self.dead_nodes: set[int] = set()  # ids of replaced nodes
        self.tensors: list[dict[str, Any]] = []
        self.original_bytes = 0
        self.quantized_bytes = 0
        self.weights = 0
        self.block_of: dict[str, int] = {}  # codes initializer -> its block size

    def _unique(self, base: str) -> str:
        name, i = base, 1
        while name in self.g.inits or name in self.g.producer or name in self.g.consumers:
            name, i = f"{base}_{i}", i + 1
        self.g.inits[name] = TensorProto()  # reserve
        return name

    def quantize(
        self, src: TensorProto, w_kn: np.ndarray, role: str, axis: int, block_size: int,
        stats: Moments | None = None,
    ) -> tuple[str, str, str, int | None]:
        """Quantize `w_kn` ([K, N]; stored transposed when axis == 1) and add its initializers.

        With calibration `stats` of its input: error feedback on the input's second moments
        (passes/quant/q4_gptq.py) when they hold a Gram matrix, else the importance-weighted search.
        """
        calibrated = None
        if stats is not None and stats.gram is not None:
            q, calibrated = quantize_gptq(w_kn, stats.gram, block_size, self.symmetric), "gptq"
        else:
            imp = None if stats is None else stats.sq
            q = quantize_array(w_kn, block_size, self.symmetric, self.method, imp)
            calibrated = None if stats is None else "importance" if stats.count else "norm-weight"
        err = q.rel_rms_error or 0.0
        sdtype, cast_to = _scale_dtype(src.data_type)
        codes, scales, zps = q.codes, q.scales.astype(sdtype), q.zero_points
        if axis == 1:  # stored in the source's own [N, K] layout, blocks along its axis 1
            codes, scales, zps = codes.T, scales.T, zps.T
        base = src.name
        names = (
            self._unique(base + "_q4"),
            self._unique(base + "_scale"),
            self._unique(base + "_zp"),
        )
        # Appended straight to the model (after every original initializer, where _rewrite
        # keeps them): one copy of the codes in memory, not a second one on the way in.
        inits = self.g.model.graph.initializer
        for t in (uint4_tensor(codes, names[0]),
                  numpy_helper.from_array(np.ascontiguousarray(scales), names[1]),
                  uint4_tensor(zps, names[2])):
            if self.spill is not None:
                self.spill(t)  # its bytes go to disk now: memory stays at one tensor
            inits.append(t)
        self.g.inits_dtype[names[1]] = helper.np_dtype_to_tensor_dtype(sdtype)
        k, n = w_kn.shape
        nbytes = (codes.size + zps.size + 1) // 2 + scales.nbytes
        itemsize = np.dtype(helper.tensor_dtype_to_np_dtype(src.data_type)).itemsize
        self.original_bytes += w_kn.size * itemsize
        self.quantized_bytes += nbytes
        self.weights += w_kn.size
        self.tensors.append(
            {
                "name": src.name,
                "role": role,
                "shape": [int(d) for d in src.dims],
                "axis": axis,
                "codes": names[0],
                "scales": names[1],
                "zero_points": names[2],
                "block_size": block_size,
                "partial_block": k % block_size != 0,
                "bits_per_weight": round(8 * nbytes / w_kn.size, 4),
                "rel_rms_error": round(err, 6),
                **({"calibration": calibrated} if calibrated else {}),
            }
        )
        self.block_of[names[0]] = block_size
        return (*names, cast_to)

    def dq_node(
        self, names: tuple[str, str, str, int | None], out: str, axis: int
    ) -> list[onnx.NodeProto]:
        codes, scales, zps, cast_to = names
        dq_out = out if cast_to is None else out + "_f32"
        nodes = [
            helper.make_node(
                "DequantizeLinear",
                [codes, scales, zps],
                [dq_out],
                name=out + "_DequantizeLinear",
                axis=axis,
                block_size=self.block_of[codes],
            )
        ]
        if cast_to is not None:
            nodes.append(helper.make_node("Cast", [dq_out], [out], name=out + "_Cast", to=cast_to))
        return nodes

    def gather_nodes(
        self, names: tuple[str, str, str, int | None], gather: onnx.NodeProto, stored_kn: bool
    ) -> list[onnx.NodeProto]:
        """Replace Gather(E, ids) by a gather of rows of codes/scales/zero points + dequantize.

        Standard Gather takes no 4-bit tensors, so codes and zero points are Cast to uint8 first
        (constant-folded once at session creation; the artifact keeps uint4). When the tensor is
        stored as the tied LM head's [H, V], a Transpose (also folded) gives rows again.
        The scales take a lossless round trip through the other float type (their values are
        float16-representable): it gives the lookup its own constant, because onnxruntime
        does not fuse a DequantizeLinear into MatMulNBits when its scales have another consumer.
        Gathered rows dequantize along the last axis, blocks of B, to exactly the head's values.
        """
        codes, scales, zps, cast_to = names
        out, ids = gather.output[0], gather.input[1]
        base = self._unique(out + "_q4")
        sdt = self.g.inits_dtype[scales]
        other = TensorProto.FLOAT16 if sdt == TensorProto.FLOAT else TensorProto.FLOAT
        nodes: list[onnx.NodeProto] = []

        def table(src: str, tag: str, to: int) -> str:
            nodes.append(helper.make_node("Cast", [src], [f"{base}_{tag}_cast"], to=to))
            cur = f"{base}_{tag}_cast"
            if stored_kn:
                nodes.append(
                    helper.make_node("Transpose", [cur], [f"{base}_{tag}_rows"], perm=[1, 0])
                )
                cur = f"{base}_{tag}_rows"
            nodes.append(helper.make_node("Gather", [cur, ids], [f"{base}_{tag}_g"], axis=0))
            return f"{base}_{tag}_g"

        cg = table(codes, "codes", TensorProto.UINT8)
        zg = table(zps, "zp", TensorProto.UINT8)
        sg = table(scales, "scale", other)
        nodes.append(helper.make_node("Cast", [sg], [f"{base}_scale_back"], to=sdt))
        dq_out = out if cast_to is None else f"{base}_dq"
        nodes.append(
            helper.make_node(
                "DequantizeLinear",
                [cg, f"{base}_scale_back", zg],
                [dq_out],
                name=f"{base}_DequantizeLinear",
                axis=-1,
                block_size=self.block_of[codes],
            )
        )
        if cast_to is not None:
            nodes.append(helper.make_node("Cast", [dq_out], [out], to=cast_to))
        return nodes


@dataclass
class _Job:
    """One weight to quantize, found before any is: the plan (block sizes, calibration) needs
    the whole list first."""

    kind: str  # "tied" | "plain" | "fused" | "embedding"
    node: onnx.NodeProto | None  # the MatMul / fused op (None for an untied embedding)
    t: TensorProto
    trans: onnx.NodeProto | None  # Transpose(perm=[1, 0]) between t and the MatMul
    role: str

    @property
    def activation(self) -> str | None:
        """The activation this weight multiplies (calibration statistics are keyed by it)."""
        return None if self.node is None else self.node.input[0]

    def kn(self, g: _Graph) -> np.ndarray:
        """The weight as [K, N], blocks along K (read now; the caller drops it)."""
        a = g.array(self.t)
        return a.T if self.kind in ("tied", "embedding") or self.trans is not None else a


def _find_jobs(
    g: _Graph,
    gathers: dict[str, list[onnx.NodeProto]],
    is_head: Callable[[onnx.NodeProto, int], bool],
    lm_head: bool,
    embeddings: bool,
) -> list[_Job]:
    """Every weight the pass will quantize, in graph order (nothing is changed yet)."""
    jobs: list[_Job] = []
    tied: set[str] = set()
    for node in g.model.graph.node:
        if node.op_type == "MatMul" or (node.domain == ops.DOMAIN and node.op_type in FUSED_OPS):
            fused = node.op_type != "MatMul"
            if fused and len(node.input) > 2 and node.input[2]:
                continue  # already quantized
            wname = node.input[1]
            t = g.float_init(wname)
            trans = None
            if t is None and not fused:
                found = _transpose_of_init(g, wname)
                if found is None:
                    continue
                trans, t = found
            if t is None:
                continue
            n_out = int(t.dims[0] if trans is not None else t.dims[1])
            head = not fused and is_head(node, n_out)
            if trans is not None and t.name in gathers:
                # One tensor for both uses; either flag asks for it (they name the same tensor).
                if not (lm_head or embeddings):
                    continue
                users = [*gathers[t.name], trans]
                if not g.used_only_by(t.name, users) or not g.used_only_by(trans.output[0], [node]):
                    continue
                jobs.append(_Job("tied", node, t, trans, "tied_embedding_lm_head"))
                tied.add(t.name)
                continue
            if head and not lm_head:
                continue
            if trans is not None:
                if not g.used_only_by(trans.output[0], [node]) or not g.used_only_by(
                    t.name, [trans]
                ):
                    continue
            elif not g.used_only_by(t.name, [node]):
                continue
            role = "lm_head" if head else ("fused:" + node.op_type if fused else "linear")
            jobs.append(_Job("fused" if fused else "plain", node, t, trans, role))
    if embeddings:  # untied tables: quantized [V, H] along H, rows gathered then dequantized
        for name, users in gathers.items():
            if name not in tied and g.used_only_by(name, users):
                jobs.append(_Job("embedding", None, g.inits[name], None, "embedding"))
    return jobs


def _apply(
    w: _Writer,
    g: _Graph,
    job: _Job,
    block_size: int,
    stats: Moments | None,
    gathers: dict[str, list[onnx.NodeProto]],
) -> None:
    """Quantize one job's weight and rewire its consumers to the 4-bit form."""
    t, node, trans = job.t, job.node, job.trans
    arr = job.kn(g)
    axis = 1 if job.kind == "embedding" else 0  # stored in the source's own layout
    names = w.quantize(t, arr, job.role, axis, block_size, stats)
    del arr  # the float copy goes before the next weight is read
    if job.kind == "tied":
        # Stored as the LM head's [K=H, N=V] (blocks along H, axis 1 of E): the head is then
        # the plain DequantizeLinear + MatMul that onnxruntime fuses into MatMulNBits; the
        # lookups gather rows from the same codes (see gather_nodes).
        assert node is not None and trans is not None
        dq_out = w._unique(t.name + "_dq")
        w.new_nodes.append(w.dq_node(names, dq_out, axis=0))
        node.input[1] = dq_out
        w.dead_nodes.add(id(trans))
        for gather in gathers.pop(t.name):
            w.new_nodes.append(w.gather_nodes(names, gather, stored_kn=True))
            w.dead_nodes.add(id(gather))
    elif job.kind == "embedding":
        for gather in gathers[t.name]:
            w.new_nodes.append(w.gather_nodes(names, gather, stored_kn=False))
            w.dead_nodes.add(id(gather))
    elif job.kind == "fused":
        assert node is not None
        codes, scales, zps, _ = names
        bias = node.input[4] if len(node.input) > 4 else ""
        x = node.input[0]
        del node.input[:]
        node.input.extend([x, codes, scales, zps] + ([bias] if bias else []))
        kept = [a for a in node.attribute if a.name != "block_size"]
        del node.attribute[:]
        node.attribute.extend([*kept, helper.make_attribute("block_size", block_size)])
    else:
        assert node is not None
        dq_out = w._unique(t.name + "_dq")
        w.new_nodes.append(w.dq_node(names, dq_out, axis=0))
        node.input[1] = dq_out
        if trans is not None:
            w.dead_nodes.add(id(trans))
    w.dead.add(t.name)


def _norm_moments(g: _Graph, jobs: list[_Job]) -> dict[str, Moments]:
    """Data-free importance: a weight fed by RMSNormalization(x, gamma) sees inputs whose
    channel k is gamma_k times a unit-RMS value, so gamma_k^2 stands in for the mean squared
    activation (a calibration text's measurement) of that input channel. Other inputs (the
    attention output, the MLP's product) have no such proxy and keep the plain search."""
    out: dict[str, Moments] = {}
    for job in jobs:
        act = job.activation
        node = g.producer.get(act) if act else None
        if node is None or node.op_type != "RMSNormalization" or len(node.input) < 2:
            continue
        scale = g.inits.get(node.input[1])
        if scale is None or len(scale.dims) != 1:
            continue
        gamma = np.asarray(g.array(scale), np.float64)
        out[act] = Moments(gamma * gamma, None, 0)
    return out


def _quantize_jobs(
    g: _Graph, w: _Writer, jobs: list[_Job], block_size: int, bits_budget: float | None,
    symmetric: bool, method: str, moments: dict[str, Moments] | None,
    gathers: dict[str, list[onnx.NodeProto]],
) -> tuple[dict[str, int], list[str]]:
    """Each job's block size (the budget's choice, or `block_size`), then each job quantized."""
    blocks = allocate_blocks(
        [(j.t.name, lambda j=j: j.kn(g), j.activation) for j in jobs], block_size, bits_budget,
        symmetric, method, None if moments is None else {k: v.sq for k, v in moments.items()},
    ) if bits_budget is not None else dict.fromkeys((j.t.name for j in jobs), block_size)
    tied_names: list[str] = []
    for job in jobs:
        stats = None if moments is None or job.activation is None else moments.get(job.activation)
        _apply(w, g, job, blocks[job.t.name], stats, gathers)
        if job.kind == "tied":
            tied_names.append(job.t.name)
    return blocks, tied_names


def quantize_q4(
    model: onnx.ModelProto,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    symmetric: bool = False,
    lm_head: bool = True,
    embeddings: bool = False,
    method: str = DEFAULT_METHOD,
    base_dir: str | Path | None = None,
    load: Callable[[TensorProto], np.ndarray] | None = None,
    bits_budget: float | None = None,
    calibration: Calibration | None = None,
    norm_importance: bool = False,
    spill: Callable[[TensorProto], None] | None = None,
) -> tuple[onnx.ModelProto, PassResult]:
    """Quantize every linear weight of `model` to 4 bits in place; returns (model, result).

    Linear weights are 2-D float initializers that are input 1 of a MatMul (directly, or through
    Transpose(perm=[1,0])) or input 1 of FusedQKV / FusedGateUp (packed [K, N]). The LM head (the
    MatMul whose output width is the vocabulary, or that produces `logits`) is quantized unless
    `lm_head=False`; an untied embedding table (input 0 of a Gather) only when asked.
    `method` picks each block's scale and zero point ("search" or "minmax"). `base_dir` is where
    the model's external data lives, if its weights are not loaded yet; `load`, if given, reads a
    weight's values instead (for stand-ins whose values come from elsewhere). Weights are read
    one at a time, each dropped once quantized. `spill`, if given, is called with each new
    initializer (codes, scales, zero points) and turns it into an external reference, its bytes
    written out: the quantized model is then never held in memory (an 8B model's codes are 4 GB).
    """
    if block_size not in BLOCK_SIZES:
        raise ValueError(f"block_size {block_size} not supported; valid values: {BLOCK_SIZES}")
    _ensure_opset(model)
    t0 = time.perf_counter()
    g = _Graph(model, None if base_dir is None else str(base_dir), load)
    w = _Writer(g, block_size, symmetric, method, spill)

    # Embedding tables: Gather(E, ids) with E a 2-D float initializer, gathered along axis 0.
    gathers: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        if node.op_type == "Gather" and g.float_init(node.input[0]) is not None:
            axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
            if axis == 0:
                gathers.setdefault(node.input[0], []).append(node)
    vocab = {int(g.inits[name].dims[0]) for name in gathers}

    def is_head(node: onnx.NodeProto, n_out: int) -> bool:
        # The LM head maps to the vocabulary: as wide as an embedding table has rows. Without
        # any embedding table, only a MatMul producing the `logits` output counts.
        return n_out in vocab or (not vocab and node.output[0] == "logits")

    jobs = _find_jobs(g, gathers, is_head, lm_head, embeddings)
    moments = None
    calib_seconds = 0.0
    if calibration is not None:
        tc = time.perf_counter()
        moments = calibration.moments(
            model, g.array, {j.activation: j.t.data_type for j in jobs if j.activation}
        )
        calib_seconds = time.perf_counter() - tc
    if moments is None and norm_importance:
        moments = _norm_moments(g, jobs)
    total = sum(int(np.prod(j.t.dims)) for j in jobs)
    with q4_search.for_model(total):
        blocks, tied_names = _quantize_jobs(g, w, jobs, block_size, bits_budget, symmetric,
                                            method, moments, gathers)
    edits = len(jobs)

    _rewrite(model, w)
    if any(n.domain == ops.DOMAIN for n in model.graph.node):
        ops.attach_functions(model)
    used = sorted({t["block_size"] for t in w.tensors})
    info = {
        "bits": BITS,
        "block_size": used[0] if len(used) == 1 else "mixed " + "/".join(map(str, used)),
        "bits_budget": bits_budget,
        "calibration": None if calibration is None else {
            **calibration.record(), "seconds": round(calib_seconds, 2)},
        "norm_importance": norm_importance and calibration is None,
        "symmetric": symmetric,
        "zero_point": "fixed 8 (uint4)" if symmetric else "uint4 per block",
        "scale_dtype": "float16 values (stored in the graph's float type)",
        "rounding": "scale: float16 round-to-nearest-even; codes: round-half-to-even of w/s, + zp",
        "tensors": w.tensors,
        "method": method,
        "lm_head": any(t["role"] in ("lm_head", "tied_embedding_lm_head") for t in w.tensors),
        "embeddings": any(t["role"] in ("embedding", "tied_embedding_lm_head") for t in w.tensors),
        "roles": _roles(w.tensors),
        "bits_per_weight_overall": _overall_bits(model, w),
        "tied": tied_names,
        "weights": w.weights,
        "bits_per_weight": round(8 * w.quantized_bytes / w.weights, 4) if w.weights else None,
        "bytes_before": w.original_bytes,
        "bytes_after": w.quantized_bytes,
    }
    return model, PassResult("quantize_q4", edits, time.perf_counter() - t0, info)


def _roles(tensors: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per role (linear, fused:FusedQKV, lm_head, ...): tensors, weights, worst error."""
    out: dict[str, dict[str, Any]] = {}
    for t in tensors:
        r = out.setdefault(t["role"], {"tensors": 0, "weights": 0, "max_rel_rms_error": 0.0})
        r["tensors"] += 1
        r["weights"] += int(np.prod(t["shape"]))
        r["max_rel_rms_error"] = max(r["max_rel_rms_error"], t["rel_rms_error"])
    return out


def _overall_bits(model: onnx.ModelProto, w: _Writer) -> float | None:
    """Bits per weight over every float weight of the model (quantized and kept float alike):
    the Q4 tensors' codes, scales and zero points plus each float initializer as stored."""
    qparams = {t["scales"] for t in w.tensors}
    kept_bytes = kept = 0
    for t in model.graph.initializer:
        if t.data_type in _FLOAT_TYPES and t.name not in qparams:
            numel = int(np.prod(t.dims)) if t.dims else 1
            kept += numel
            kept_bytes += numel * np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize
    total = w.weights + kept
    return round(8 * (w.quantized_bytes + kept_bytes) / total, 4) if total else None


def _rewrite(model: onnx.ModelProto, w: _Writer) -> None:
    """Insert each DequantizeLinear group before its first consumer; drop dead tensors/nodes."""
    g = model.graph
    pending = {nodes[-1].output[0]: nodes for nodes in w.new_nodes}
    order: list[onnx.NodeProto] = []
    for node in g.node:
        if id(node) in w.dead_nodes:
            continue
        for name in node.input:
            if name in pending:
                order.extend(pending.pop(name))
        order.append(node)
    del g.node[:]
    g.node.extend(order)
    # In place: rebuilding the list would copy every initializer, the new codes included.
    for i in reversed(range(len(g.initializer))):
        if g.initializer[i].name in w.dead:
            del g.initializer[i]
    # Stale value_info for removed tensors would contradict the new types.
    vi = [v for v in g.value_info if v.name not in w.dead]
    del g.value_info[:]
    g.value_info.extend(vi)


def _ensure_opset(model: onnx.ModelProto) -> None:
    """Blocked DequantizeLinear with uint4 needs opset >= 21."""
    for o in model.opset_import:
        if o.domain in ("", "ai.onnx") and o.version < 21:
            raise ValueError(
                f"blocked 4-bit DequantizeLinear needs opset >= 21; model has {o.version} "
                "(upgrade it with onnx.version_converter first)"
            )


# ---------------------------------------------------------------------------------------------
# The pass manager's interface (onnx-graphsurgeon graphs)
# ---------------------------------------------------------------------------------------------


@dataclass
class QuantizeQ4:
    """`quantize_q4` as a pipeline pass: `run(graph)` rewrites the gs.Graph in place.

    The rewrite itself works on ModelProto + NumPy (one implementation, tested on its own); the
    graph goes out through onnx-graphsurgeon's exporter and the result is imported back. Weights
    go out as data-less stand-ins and come back as the same lazy values (passes/weights.py):
    only the weights being quantized are read, one at a time. The returned PassResult carries
    the fuselm.json quantization record in `extra["quantization"]`.
    """

    block_size: int = DEFAULT_BLOCK_SIZE
    symmetric: bool = False
    lm_head: bool = True
    embeddings: bool = False
    method: str = DEFAULT_METHOD
    bits_budget: float | None = None
    calibration: Calibration | None = None
    norm_importance: bool = False
    spill_dir: str | Path | None = None  # the codes go to SPILL_FILE here (the writer's base_dir)
    name: str = "quantize_q4"
    info: dict[str, Any] = field(default_factory=dict)

    def run(self, graph: Any) -> Any:
        import onnx_graphsurgeon as gs

        from fuselm.passes.graph import PassResult as GraphPassResult
        from fuselm.passes.model_io import infer_shapes

        sources = _stand_ins(graph)
        try:
            model = gs.export_onnx(graph, do_type_check=False)
        finally:
            for t, lazy in sources.values():
                t._values = lazy  # noqa: SLF001 - back to the real values
        if not any(o.domain in ("", "ai.onnx") for o in model.opset_import):
            model.opset_import.append(helper.make_opsetid("", ops.ONNX_OPSET))

        def load(t: TensorProto) -> np.ndarray:
            found = sources.get(t.name)
            return weights.array(found[1]) if found is not None else numpy_helper.to_array(t)

        with contextlib.ExitStack() as stack:
            spill = None
            if self.spill_dir is not None:
                from fuselm.passes.writer import DataFile

                path = Path(self.spill_dir) / SPILL_FILE
                f = stack.enter_context(path.open("ab"))
                out = DataFile(f, SPILL_FILE, f.tell())

                def spill(t: TensorProto) -> None:
                    out.put(t, t.raw_data)

            model, res = quantize_q4(
                model,
                block_size=self.block_size,
                symmetric=self.symmetric,
                lm_head=self.lm_head,
                embeddings=self.embeddings,
                method=self.method,
                load=load,
                bits_budget=self.bits_budget,
                calibration=self.calibration,
                norm_importance=self.norm_importance,
                spill=spill,
            )
        infer_shapes(model)
        new = gs.import_onnx(model)
        for t in new.tensors().values():
            if not isinstance(t, gs.Constant):
                continue
            found = sources.get(t.name)
            if found is not None:  # untouched weights: their lazy values again
                t._values = found[1]  # noqa: SLF001
            elif self.spill_dir is not None and weights.is_external(t._values.tensor):  # noqa: SLF001
                t._values = weights.ExternalValues(t._values.tensor, self.spill_dir)  # noqa: SLF001
        graph.nodes = new.nodes
        graph.inputs = new.inputs
        graph.outputs = new.outputs
        if hasattr(new, "functions"):
            graph.functions = new.functions
        self.info = res.info
        return GraphPassResult(count=res.changed, extra={"quantization": res.info})


def _stand_ins(graph: Any) -> dict[str, tuple[Any, Any]]:
    """Swap every weight whose values are not loaded for a data-less TensorProto (name, type,
    dims: all quantize_q4 reads until it quantizes one); name -> (constant, real values)."""
    import onnx_graphsurgeon as gs
    from onnx_graphsurgeon.ir.tensor import LazyValues

    swapped: dict[str, tuple[Any, Any]] = {}
    for t in graph.tensors().values():
        lazy = t._values if isinstance(t, gs.Constant) else None  # noqa: SLF001
        if not isinstance(lazy, LazyValues):
            continue
        if weights.is_external(lazy.tensor):  # a reference already: exported as it is
            swapped[t.name] = (t, lazy)
            continue
        if not isinstance(lazy, weights.PackedValues) and weights.numel(lazy.tensor) <= 1024:
            continue  # small constants go out with their values (shape inference uses them)
        stub = TensorProto(name=t.name, data_type=lazy.tensor.data_type)
        stub.dims.extend(lazy.tensor.dims)
        # Marked external so shape inference treats it as a typed input, not an empty value.
        stub.data_location = TensorProto.EXTERNAL
        swapped[t.name] = (t, lazy)
        t._values = LazyValues(stub)  # noqa: SLF001
    return swapped


def quantize_pass(
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    symmetric: bool = False,
    lm_head: bool = True,
    embeddings: bool = False,
    method: str = DEFAULT_METHOD,
    bits_budget: float | None = None,
    calibration: Calibration | None = None,
    norm_importance: bool = False,
    spill_dir: str | Path | None = None,
) -> QuantizeQ4:
    """The pass for `run_pipeline(..., extra=[quantize_pass(...)])`; options as validated by
    `validate_options` (raises ValueError on a block size outside BLOCK_SIZES). `spill_dir`: write
    the quantized tensors to `spill_dir/SPILL_FILE` as they are made, instead of holding them
    (pass the pipeline's `base_dir`, so the writer finds them; delete the file after saving)."""
    if block_size not in BLOCK_SIZES:
        raise ValueError(f"block_size {block_size} not supported; valid values: {BLOCK_SIZES}")
    return QuantizeQ4(block_size, symmetric, lm_head, embeddings, method, bits_budget, calibration,
                      norm_importance, spill_dir)
