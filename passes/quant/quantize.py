"""4-bit block quantization of linear weights: W4, blocks of 32 along the reduction axis.

A pass like the others: `QuantizeQ4(options).run(graph)` rewrites the onnx-graphsurgeon graph
the fusion passes rewrite, after pairing (passes/manager.py), and returns a PassResult whose
`extra["quantization"]` is fuselm.json's quantization record. Its options are one
`QuantOptions` (passes/quant/options.py), made from the user's flags.

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
tensor under a bits budget (`bits_budget`, passes/quant/q4_allocate.py); the search weighted by
each input channel's importance — RMSNorm's gamma^2 data-free (`norm_importance`), or the
activations of a calibration text (the `calibration` tokens this pass is given,
passes/quant/q4_calibration.py: mean squares, and GPTQ-style error feedback,
passes/quant/q4_gptq.py, on the weights the calibration names: the LM head by default, every
weight with `--calibration FILE`). The stored format is the same in every case.

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

**8-bit** (`bits=8`, `--q-bits 8`): the same blocks along K with uint8 codes and uint8 zero
points (symmetric: 128), the min/max formula with 255 steps (codes = clip(rint(w/s) + zp, 0,
255)), or per block the step of a grid its values already sit on where that is exacter
(passes/quant/q8_math.py); plain DequantizeLinear, which MLX reads as its 8-bit affine form.
**Mixed** (`mixed=True`, `--quant mixed`): per tensor 4-bit blocks as above, or 6- or 8-bit
blocks of 128, 64 or 32, as passes/quant/q4_allocate.choose_bits picks them by measured error
per added bit under a mean of `mixed_budget` bits per weight; the record's `mixed` names the
6- and 8-bit ones, each tensor its `bits` and block size. **6-bit** (`bits=6`, `--quant q6`,
or mixed's choice) blocks are 8-bit's formula with 63 steps (uint8 zero points below 64); ONNX
has no 6-bit type, so the codes are stored packed four in three bytes along K ([3K/4, N] uint8,
passes/ops.py `pack_uint6`) and read through `fuselm.UnpackUInt6`:
DequantizeLinear(UnpackUInt6(packed), scales, zp). Only weights stored along axis 0 (every
projection, the LM head and a tied table) with K a multiple of 4 take 6 bits (`--quant q6`
stores another K in 8-bit blocks, recorded per tensor; its options refuse an untied table).

**Given blocks** (`given`, fuselm/given_blocks.py): a weight its checkpoint gives already
quantized (a GGUF tensor of gguf/blocks.py's EXACT_TYPES) is stored as given, its codes, scales
and zero points or biases unchanged, instead of being searched again; a packed projection is
given when every part is (its parts' blocks concatenated along N, in one form that holds
each: GivenBlocks.concat), else it is quantized from the dequantized values (recorded). The forms:

    integer zero points, 4 or 8 bits  DequantizeLinear(codes, scales, zp)      (as above)
    float biases (Q4_1, Q4_K, ...)    fuselm.DequantizeAffine(codes, scales, biases, axis,
                                      block_size): w = codes*s + b (passes/ops.py)

A scale or bias that the graph's float type does not hold exactly (Q4_K's d*sc in a float16
graph) is stored float32 with a Cast after the dequantization, so nothing is rounded. In a
conversion with given blocks or 8-bit weights, FusedQKV / FusedGateUp take their packed
weight from such a dequantize node as a float input (one function-body variant per op for
every form); a plain float-to-4-bit conversion keeps the codes/scales/zp inputs.

Weights are read one at a time, each dropped once quantized. With `spill_dir`, every new tensor
(codes, scales, zero points) is written to `spill_dir/SPILL_FILE` as it is made and stays there
as a reference (passes/weights.py): the quantized model is never held in memory (an 8B model's
codes are 4 GB); the writer copies the bytes into the artifact.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx_graphsurgeon as gs
from onnx import TensorProto, helper, numpy_helper
from onnx_graphsurgeon.ir.tensor import LazyValues

from fuselm.given_blocks import GivenBlocks
from fuselm.passes import ops, weights
from fuselm.passes.graph import PassResult, is_graph_output
from fuselm.passes.model_io import runnable
from fuselm.passes.quant import q4_search
from fuselm.passes.quant.options import QuantOptions
from fuselm.passes.quant.q4_allocate import allocate_blocks, choose_bits
from fuselm.passes.quant.q4_calibration import Calibration, Moments
from fuselm.passes.quant.q4_math import Q4Tensor, quantize_array, quantize_gptq, uint4_tensor
from fuselm.passes.quant.q8_math import quantize_wide
from fuselm.passes.writer import DataFile

BITS = 4
FUSED_OPS = ("FusedQKV", "FusedGateUp")
_FLOAT_TYPES = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16)
SPILL_FILE = "quantized.data"  # QuantizeQ4(spill_dir=...): the new tensors' bytes, on disk
GRAM_BYTES = 256 << 20  # calibration Gram matrices held at once (see _rounds)

# A new tensor's values: the TensorProto made, or what it became once written to disk.
Spill = Callable[[TensorProto], LazyValues]
# Given blocks by initializer name (None: that weight comes as floats), in the checkpoint's
# [N, K] layout (export's ExportResult.given).
Given = Callable[[str], GivenBlocks | None]


class QuantizeQ4:
    """Every linear weight of the graph to 4 bits, as `options` ask.

    Linear weights are 2-D float initializers that are input 1 of a MatMul (directly, or through
    Transpose(perm=[1,0])) or input 1 of FusedQKV / FusedGateUp (packed [K, N]). The LM head (the
    MatMul whose output width is the vocabulary, or that produces `logits`) is quantized unless
    `options.lm_head` is False; an untied embedding table (input 0 of a Gather) only when
    `options.embeddings`. A weight another node also reads is refused (reported, left float).
    `calibration`: the tokens whose activations weight the rounding (None: data-free).
    `spill_dir`: where the new tensors go as they are made (see the module's last paragraph;
    give the pipeline's `base_dir`, so the writer finds them, and delete the file after saving).
    `given`: the blocks a checkpoint gives per initializer name (see the module doc).
    """

    name = "quantize_q4"

    def __init__(self, options: QuantOptions | None = None, calibration: Calibration | None = None,
                 spill_dir: str | Path | None = None, given: Given | None = None) -> None:
        self.options = options or QuantOptions()
        self.calibration = calibration
        self.spill_dir = spill_dir
        self.given = given

    def run(self, graph: gs.Graph) -> PassResult:
        opts = self.options
        if graph.opset is not None and graph.opset < 21:
            raise ValueError(f"blocked 4-bit DequantizeLinear needs opset >= 21; the graph has "
                             f"{graph.opset} (upgrade it with onnx.version_converter first)")
        result = PassResult()
        tables, gathers = _gathers(graph)
        jobs = _find_jobs(graph, tables, gathers, opts, result)
        calib = self.calibration
        # the fused float graph, before any weight changes (_apply rewires as it goes)
        model, load = runnable(graph) if calib is not None else (None, None)
        with self._spill() as spill:
            w = _Writer(graph, opts, spill)
            w.fused_via_node = self.given is not None or opts.bits != 4
            # The checkpoint's own blocks first: kept as they are, they need no statistics, so
            # only the weights left to quantize are calibrated, and a GGUF whose every tensor
            # is kept runs no calibration forward (SmolLM2's --quant q4: 59 s and ~70 MB)
            todo = []
            for job in jobs:
                given = None if self.given is None else _given_of(job.weight, self.given)
                if given is None:
                    todo.append(job)
                else:
                    _apply(w, job, given.block_size, None, tables, gathers, given)
                del given
            calib_seconds, wide = self._quantize(w, todo, model, load, tables, gathers) \
                if todo else (0.0, {})
            del model, load
        budget = opts.blocks()[1]
        order = {j.weight.name: i for i, j in enumerate(jobs)}
        w.tensors.sort(key=lambda t: order[t["name"]])  # the record in graph order
        _rewrite(graph, w)
        used = sorted({t["block_size"] for t in w.tensors})
        bits_used = sorted({t.get("bits", BITS) for t in w.tensors}) or [opts.bits]
        result.count = len(jobs)
        result.extra["quantization"] = {
            "bits": bits_used[0] if len(bits_used) == 1 else "mixed " + "/".join(
                map(str, bits_used)),
            "block_size": used[0] if len(used) == 1 else "mixed " + "/".join(map(str, used)),
            "bits_budget": budget,
            "mixed": None if not opts.mixed else {
                "bits_budget": opts.mixed_budget,
                "eight_bit": sorted(n for n, b in wide.items() if b == 8),
                "six_bit": sorted(n for n, b in wide.items() if b == 6),
                "measure": "relative importance-weighted error drop per added bit"},
            # (None too when every weight kept its given blocks: no forward ran, none needed)
            "calibration": None if self.calibration is None or not todo else {
                **self.calibration.record(), "seconds": round(calib_seconds, 2)},
            # (6- and 8-bit blocks take min/max: no importance, unless mixed's choice used it)
            "norm_importance": opts.norm_importance and self.calibration is None
            and (opts.bits == 4 or opts.mixed),
            "symmetric": opts.symmetric,
            "zero_point": _zero_point_text(opts),
            "given": _given_record(w.tensors),
            "scale_dtype": _scale_text(w.tensors),
            "rounding": "scale: float16 round-to-nearest-even; codes: round-half-to-even of w/s, "
                        "+ zp" + ("; given blocks: the checkpoint's own scales and codes"
                                  if any("given" in t for t in w.tensors) else ""),
            "tensors": w.tensors,
            "method": opts.method if opts.bits == 4 or opts.method != "search"
            else "minmax+grid",
            "lm_head": any(t["role"] in ("lm_head", "tied_embedding_lm_head") for t in w.tensors),
            "embeddings": any(t["role"] in ("embedding", "tied_embedding_lm_head")
                              for t in w.tensors),
            "roles": _roles(w.tensors),
            "bits_per_weight_overall": _overall_bits(graph, w),
            "tied": [j.weight.name for j in jobs if j.kind == "tied"],
            "weights": w.weights,
            "bits_per_weight": round(8 * w.quantized_bytes / w.weights, 4) if w.weights else None,
            "bytes_before": w.original_bytes,
            "bytes_after": w.quantized_bytes,
        }
        return result

    def _quantize(self, w: _Writer, jobs: list[_Job], model: Any, load: Any,
                  tables: dict[str, gs.Constant], gathers: dict[str, list[gs.Node]]
                  ) -> tuple[float, dict[str, int]]:
        """Quantize `jobs` (the weights without given blocks), with the calibration forward(s)
        through `model` / `load` when there is a calibration; the seconds those took, and the
        weights stored at 6 or 8 bits by `--quant mixed` (name -> bits)."""
        opts, calib = self.options, self.calibration
        block_size, budget = opts.blocks()
        calib_seconds = 0.0
        moments: dict[str, Moments] | None = None
        prior = False  # every activation's mean squares collected before the rounds
        if calib is not None and (budget is not None or opts.mixed):
            t0 = time.perf_counter()  # the choice needs every importance first
            moments = calib.moments(model, load, _activations(jobs), gram=False)
            prior = True
            calib_seconds = time.perf_counter() - t0
        elif calib is None and opts.norm_importance:
            moments = _norm_moments(jobs)
        plan = _mixed_plan(jobs, block_size, opts, moments) if opts.mixed else {}
        wide = {n: bits for n, (bits, _) in plan.items() if bits != BITS}
        w.fused_via_node = w.fused_via_node or bool(wide)
        # Which jobs get their statistics from which forward (see _rounds).
        rounds = _rounds(jobs, calib, set(wide))
        total = sum(int(np.prod(j.weight.shape)) for j in jobs)
        with q4_search.for_model(total):
            for n, (part, gram) in enumerate(rounds):
                if calib is not None and (gram or not prior):  # else `moments` has them
                    t0 = time.perf_counter()
                    moments = {**(moments or {}),
                               **calib.moments(model, load, _activations(part), gram)}
                    calib_seconds += time.perf_counter() - t0
                if n == 0:
                    blocks = _block_sizes(jobs, block_size, budget, opts, moments)
                    blocks.update({name: b for name, (_, b) in plan.items()})
                for job in part:
                    stats = (None if moments is None or job.activation is None
                             else moments.get(job.activation.name))
                    _apply(w, job, blocks[job.weight.name], stats, tables, gathers, None,
                           wide.get(job.weight.name))
                if moments is not None and len(rounds) > 1:  # this round's Gram matrices go
                    moments = {k: v for k, v in moments.items() if v.gram is None}
        return calib_seconds, wide

    @contextlib.contextmanager
    def _spill(self) -> Iterator[Spill | None]:
        """Writes each new tensor to SPILL_FILE under `spill_dir` (None: kept in memory)."""
        if self.spill_dir is None:
            yield None
            return
        base = Path(self.spill_dir)
        with (base / SPILL_FILE).open("ab") as f:
            out = DataFile(f, SPILL_FILE, f.tell())

            def spill(t: TensorProto) -> LazyValues:
                out.put(t, t.raw_data)  # its bytes go to disk now: memory stays at one tensor
                # A fresh message: clearing `t`'s bytes leaves them in its protobuf arena,
                # which lives as long as `t` does.
                ref = TensorProto()
                ref.CopyFrom(t)
                return weights.ExternalValues(ref, base)

            yield spill


# ---------------------------------------------------------------------------------------------
# Finding the weights (nothing is changed yet: the plan needs the whole list first)
# ---------------------------------------------------------------------------------------------


@dataclass
class _Job:
    """One weight to quantize."""

    kind: str  # "tied" | "plain" | "fused" | "embedding"
    node: gs.Node | None  # the MatMul / fused op (None for an untied embedding)
    weight: gs.Constant
    trans: gs.Node | None  # Transpose(perm=[1, 0]) between the weight and the MatMul
    role: str

    @property
    def activation(self) -> gs.Tensor | None:
        """The activation this weight multiplies (calibration statistics are keyed by it)."""
        return None if self.node is None else self.node.inputs[0]

    def kn(self) -> np.ndarray:
        """The weight as [K, N], blocks along K (read now; the caller drops it)."""
        a = weights.read(self.weight)
        return a.T if self.kind in ("tied", "embedding") or self.trans is not None else a


def _float_weight(t: gs.Tensor) -> gs.Constant | None:
    """`t` when it is a 2-D float initializer."""
    if isinstance(t, gs.Constant) and len(t.shape) == 2 and \
            weights.data_type(t) in _FLOAT_TYPES:
        return t
    return None


def _transpose_of_weight(t: gs.Tensor) -> tuple[gs.Node, gs.Constant] | None:
    """If `t` is Transpose(perm=[1, 0]) of a 2-D float initializer, that node and weight."""
    if isinstance(t, gs.Constant) or len(t.inputs) != 1 or t.inputs[0].op != "Transpose":
        return None
    node = t.inputs[0]
    w = _float_weight(node.inputs[0])
    if w is None or list(node.attrs.get("perm", [1, 0])) != [1, 0]:
        return None
    return node, w


def _used_only_by(graph: gs.Graph, t: gs.Tensor, nodes: list[gs.Node]) -> bool:
    return not is_graph_output(graph, t) and all(
        any(c is n for n in nodes) for c in t.outputs)


def _gathers(graph: gs.Graph) -> tuple[dict[str, gs.Constant], dict[str, list[gs.Node]]]:
    """Embedding tables: Gather(E, ids) with E a 2-D float initializer, gathered along axis 0;
    (table by name, its Gathers by name)."""
    tables: dict[str, gs.Constant] = {}
    gathers: dict[str, list[gs.Node]] = {}
    for node in graph.nodes:
        if node.op != "Gather" or int(node.attrs.get("axis", 0)) != 0:
            continue
        table = _float_weight(node.inputs[0])
        if table is not None:
            tables[table.name] = table
            gathers.setdefault(table.name, []).append(node)
    return tables, gathers


def _find_jobs(
    graph: gs.Graph,
    tables: dict[str, gs.Constant],
    gathers: dict[str, list[gs.Node]],
    opts: QuantOptions,
    result: PassResult,
) -> list[_Job]:
    """Every weight the pass will quantize, in graph order; shared weights refused."""
    vocab = {int(t.shape[0]) for t in tables.values()}

    def is_head(node: gs.Node, n_out: int) -> bool:
        # The LM head maps to the vocabulary: as wide as an embedding table has rows. Without
        # any embedding table, only a MatMul producing the `logits` output counts.
        return n_out in vocab or (not vocab and node.outputs[0].name == "logits")

    jobs: list[_Job] = []
    tied: set[str] = set()
    for node in graph.nodes:
        fused = node.domain == ops.DOMAIN and node.op in FUSED_OPS
        if node.op != "MatMul" and not fused:
            continue
        if fused and len(node.inputs) > 2 and node.inputs[2].name:
            continue  # already quantized
        t = _float_weight(node.inputs[1])
        trans = None
        if t is None and not fused:
            found = _transpose_of_weight(node.inputs[1])
            if found is None:
                continue
            trans, t = found
        if t is None:
            continue
        n_out = int(t.shape[0] if trans is not None else t.shape[1])
        head = not fused and is_head(node, n_out)
        if trans is not None and t.name in gathers:
            # One tensor for both uses; either flag asks for it (they name the same tensor).
            if not (opts.lm_head or opts.embeddings):
                continue
            if not _used_only_by(graph, t, [*gathers[t.name], trans]) or \
                    not _used_only_by(graph, trans.outputs[0], [node]):
                result.refuse(node, f"the tied table {t.name} is also read by another node")
                continue
            jobs.append(_Job("tied", node, t, trans, "tied_embedding_lm_head"))
            tied.add(t.name)
            continue
        if head and not opts.lm_head:
            continue
        if trans is not None:
            shared = not _used_only_by(graph, trans.outputs[0], [node]) or \
                not _used_only_by(graph, t, [trans])
        else:
            shared = not _used_only_by(graph, t, [node])
        if shared:
            result.refuse(node, f"the weight {t.name} is also read by another node")
            continue
        role = "lm_head" if head else ("fused:" + node.op if fused else "linear")
        jobs.append(_Job("fused" if fused else "plain", node, t, trans, role))
    if opts.embeddings:  # untied tables: quantized [V, H] along H, rows gathered then dequantized
        for name, users in gathers.items():
            if name not in tied and _used_only_by(graph, tables[name], users):
                jobs.append(_Job("embedding", None, tables[name], None, "embedding"))
    return jobs


def _activations(jobs: list[_Job]) -> dict[str, int]:
    """The activations the jobs' weights multiply (name -> float type), in job order."""
    return {j.activation.name: weights.data_type(j.weight) for j in jobs if j.activation}


def _reduction_size(job: _Job) -> int:
    """K of the job's [K, N] weight (its input's width)."""
    t = job.weight
    return int(t.shape[1] if job.kind in ("tied", "embedding") or job.trans is not None
               else t.shape[0])


def _rounds(jobs: list[_Job], calib: Calibration | None, wide: set[str]
            ) -> list[tuple[list[_Job], bool]]:
    """Groups of jobs, each with one calibration forward, and whether that forward keeps Gram
    matrices (for the 4-bit jobs the calibration gives error feedback, Calibration.feedback;
    `wide` names the jobs at 6 or 8 bits).

    The jobs without feedback take their importance from one forward without Gram matrices.
    The Gram matrices go in consecutive groups of at most GRAM_BYTES (K^2 float64 each: all at
    once would be 3.4 GB for Qwen3-0.6B), each group's dropped once its weights are quantized.
    """
    if calib is None:
        return [(jobs, False)] if jobs else []

    def fed(j: _Job) -> bool:
        return (j.activation is not None and j.weight.name not in wide
                and calib.feedback(j.role))

    plain = [j for j in jobs if not fed(j)]
    out: list[tuple[list[_Job], bool]] = [(plain, False)] if plain else []
    size = 0
    fresh = True
    for job in filter(fed, jobs):
        cost = 8 * _reduction_size(job) ** 2
        if not fresh and size + cost <= GRAM_BYTES:
            out[-1][0].append(job)
            size += cost
        else:
            out.append(([job], True))
            size, fresh = cost, False
    return out


def _given_of(t: gs.Constant, given: Given) -> GivenBlocks | None:
    """The blocks the checkpoint gives for weight `t` ([N, K]): its own, or for a packed
    projection (pairing's recipe, its parts [K, N_i] concatenated along axis 1) its parts'
    blocks concatenated along N. None when any part comes as floats (or the parts' blocks
    share no form: GivenBlocks.concat)."""
    own = given(t.name)
    if own is not None:
        return own
    src = weights.source(t)
    if type(src) is weights.PackedValues:
        if src.axis != 1:
            return None
        parts = []
        for p in src.parts:
            g = given(p.tensor.name) if isinstance(p, LazyValues) else None
            if g is None:
                return None
            parts.append(g)
        return GivenBlocks.concat(parts)
    return None


def _given_record(tensors: list[dict[str, Any]]) -> dict[str, Any] | None:
    """How many tensors kept their checkpoint's blocks, per source type; None without any."""
    kept: dict[str, int] = {}
    for t in tensors:
        if "given" in t:
            kept[t["given"]] = kept.get(t["given"], 0) + 1
    requantized = sum(1 for t in tensors if "given" not in t)
    return {"kept": kept, "quantized": requantized} if kept else None


def _scale_text(tensors: list[dict[str, Any]]) -> str:
    """What the scales (and float biases) hold: float16 values, except the tensors whose given
    blocks' scales float16 cannot hold (a K-quant's d*sc), counted per source type."""
    text = "float16 values (stored in the graph's float type)"
    wide: dict[str, int] = {}
    for t in tensors:
        if t["scale_values"] != "float16":
            kind = t.get("given", "quantized")
            wide[kind] = wide.get(kind, 0) + 1
    if not wide:
        return text
    where = ", ".join(f"{k} x{n}" for k, n in sorted(wide.items()))
    wide_text = f"float32 values (stored float32) in {where}"
    return wide_text if sum(wide.values()) == len(tensors) else f"{text}; {wide_text}"


def _zero_point_text(opts: QuantOptions) -> str:
    kind = "uint4/uint8" if opts.mixed else "uint4" if opts.bits == 4 else "uint8"
    # q6 stores a K that is no multiple of 4 in 8-bit blocks
    fixed = ("8/32/128 (4/6/8 bits)" if opts.mixed else 8 if opts.bits == 4
             else "32/128 (6/8 bits)" if opts.bits == 6 else 128)
    return f"fixed {fixed} ({kind})" if opts.symmetric else f"{kind} per block"


def _mixed_plan(jobs: list[_Job], block_size: int, opts: QuantOptions,
                moments: dict[str, Moments] | None) -> dict[str, tuple[int, int]]:
    """`--quant mixed`: (bits, block size) per weight (passes/quant/q4_allocate.choose_bits)."""
    return choose_bits(
        [(j.weight.name, j.kn, None if j.activation is None else j.activation.name)
         for j in jobs], opts.mixed_budget, block_size, opts.symmetric, opts.method,
        None if moments is None else {k: v.sq for k, v in moments.items()},
        frozenset(j.weight.name for j in jobs if j.kind == "embedding"))


def _norm_moments(jobs: list[_Job]) -> dict[str, Moments]:
    """Data-free importance: a weight fed by RMSNormalization(x, gamma) sees inputs whose
    channel k is gamma_k times a unit-RMS value, so gamma_k^2 stands in for the mean squared
    activation (a calibration text's measurement) of that input channel. Other inputs (the
    attention output, the MLP's product) have no such proxy and keep the plain search."""
    out: dict[str, Moments] = {}
    for job in jobs:
        act = job.activation
        if act is None or isinstance(act, gs.Constant) or len(act.inputs) != 1:
            continue
        node = act.inputs[0]
        if node.op != "RMSNormalization" or len(node.inputs) < 2:
            continue
        scale = node.inputs[1]
        if not isinstance(scale, gs.Constant) or len(scale.shape) != 1:
            continue
        gamma = np.asarray(weights.read(scale), np.float64)
        out[act.name] = Moments(gamma * gamma, None, 0)
    return out


def _block_sizes(jobs: list[_Job], block_size: int, budget: float | None, opts: QuantOptions,
                 moments: dict[str, Moments] | None) -> dict[str, int]:
    """Each job's block size: the budget's choice (passes/quant/q4_allocate.py), or
    `block_size` for every one."""
    if budget is None:
        return dict.fromkeys((j.weight.name for j in jobs), block_size)
    return allocate_blocks(
        [(j.weight.name, j.kn, None if j.activation is None else j.activation.name)
         for j in jobs], block_size, budget, opts.symmetric, opts.method,
        None if moments is None else {k: v.sq for k, v in moments.items()},
    )


# ---------------------------------------------------------------------------------------------
# Writing the 4-bit tensors and the nodes that read them
# ---------------------------------------------------------------------------------------------


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


@dataclass
class _Q4:
    """One quantized weight in the graph: its initializers and a Cast target. `offsets` is
    the zero points (DequantizeLinear) or, for the affine form, the float biases
    (fuselm.DequantizeAffine)."""

    codes: gs.Constant
    scales: gs.Constant
    offsets: gs.Constant
    block_size: int
    cast_to: int | None  # the weight's own type, when the scales' is another (bfloat16)
    affine: bool = False
    unpacked: gs.Variable | None = None  # 6-bit: UnpackUInt6's output, the uint8 codes [K, N]

    @property
    def code_values(self) -> gs.Tensor:
        """What DequantizeLinear reads as codes: the stored ones, or the 6-bit ones unpacked."""
        return self.codes if self.unpacked is None else self.unpacked

    @property
    def zero_points(self) -> gs.Constant:
        assert not self.affine
        return self.offsets

    def dequantize_node(self, out: gs.Variable, axis: int, name: str,
                        inputs: list[gs.Tensor] | None = None) -> gs.Node:
        """The node computing the weight from (codes, scales, offsets), or from `inputs`."""
        ins = inputs or [self.code_values, self.scales, self.offsets]
        attrs = {"axis": axis, "block_size": self.block_size}
        if self.affine:
            return gs.Node("DequantizeAffine", name=name, domain=ops.DOMAIN, attrs=attrs,
                           inputs=ins, outputs=[out])
        return gs.Node("DequantizeLinear", name=name, attrs=attrs, inputs=ins, outputs=[out])


class _Writer:
    """Makes the 4-bit initializers and the nodes that read them, and keeps the record."""

    def __init__(self, graph: gs.Graph, opts: QuantOptions, spill: Spill | None) -> None:
        self.opts = opts
        self.spill = spill
        self.taken = set(graph.tensors()) | {t.name for t in graph.inputs}
        self.groups: list[list[gs.Node]] = []  # new nodes; each group's last output is read
        self.dead: list[gs.Node] = []  # replaced nodes
        self.tensors: list[dict[str, Any]] = []
        self.original_bytes = 0
        self.quantized_bytes = 0
        self.weights = 0
        self.fused_via_node = False  # fused ops read their weight from a dequantize node

    def unique(self, base: str) -> str:
        name, i = base, 1
        while name in self.taken:
            name, i = f"{base}_{i}", i + 1
        self.taken.add(name)
        return name

    def quantize(self, src: gs.Constant, w_kn: np.ndarray, role: str, axis: int,
                 block_size: int, stats: Moments | None = None, bits: int | None = None
                 ) -> _Q4:
        """Quantize `w_kn` ([K, N]; stored transposed when axis == 1) into new initializers,
        in `bits`-bit blocks (None: the options' bits).

        With calibration `stats` of its input: error feedback on the input's second moments
        (passes/quant/q4_gptq.py) when they hold a Gram matrix, else the importance-weighted
        search.
        """
        symmetric = self.opts.symmetric
        calibrated = None
        bits = bits or self.opts.bits
        if bits == 6 and w_kn.shape[0] % 4:
            bits = 8  # `--quant q6`: four codes pack in three bytes along K; else the 8-bit form
        if bits != BITS:
            q = quantize_wide(w_kn, block_size, symmetric, self.opts.method == "search", bits)
        elif stats is not None and stats.gram is not None:
            q, calibrated = quantize_gptq(w_kn, stats.gram, block_size, symmetric), "gptq"
        else:
            imp = None if stats is None else stats.sq
            q = quantize_array(w_kn, block_size, symmetric, self.opts.method, imp)
            calibrated = None if stats is None else "importance" if stats.count else "norm-weight"
        extra = {"calibration": calibrated} if calibrated else {}
        return self._store(src, role, axis, q, bits, None, q.rel_rms_error or 0.0, extra)

    def keep(self, src: gs.Constant, given: GivenBlocks, role: str, axis: int) -> _Q4:
        """Store the checkpoint's own blocks of `src` (axis 1: in its [N, K] layout, as
        given; axis 0: as [K, N])."""
        t = (lambda a: a) if axis == 1 else (lambda a: None if a is None else a.T)
        q = Q4Tensor(t(given.codes), t(given.scales), t(given.zero_points), given.block_size)
        return self._store(src, role, axis, q, given.bits, t(given.biases), 0.0,
                           {"given": given.source}, transposed=True)

    def _store(self, src: gs.Constant, role: str, axis: int, q: Q4Tensor, bits: int,
               biases: np.ndarray | None, err: float, extra: dict[str, Any],
               transposed: bool = False) -> _Q4:
        """New initializers for q's codes, scales and zero points (or `biases`); `transposed`:
        q is already in the stored layout."""
        data_type = weights.data_type(src)
        sdtype, cast_to = _scale_dtype(data_type)
        offsets = q.zero_points if biases is None else biases
        floats = [a for a in (q.scales, offsets) if a.dtype.kind == "f"]
        half = all(np.array_equal(a.astype(np.float16).astype(np.float32), a.astype(np.float32))
                   for a in floats)  # the values the record names (scale_values)
        if not all(np.array_equal(a.astype(sdtype).astype(np.float32), a.astype(np.float32))
                   for a in floats):
            # values the graph's float type does not hold (Q4_K's d*sc in float16): kept
            # float32, the dequantized weight cast to the graph's type
            sdtype, cast_to = np.dtype(np.float32), (None if data_type == TensorProto.FLOAT
                                                      else data_type)
        codes, scales = q.codes, q.scales.astype(sdtype)
        if biases is not None:
            offsets = biases.astype(sdtype)
        if axis == 1 and not transposed:  # stored in the source's own [N, K] layout
            codes, scales, offsets = codes.T, scales.T, offsets.T
        if bits == 6 and (axis != 0 or biases is not None or codes.shape[0] % 4):
            raise ValueError(f"{src.name}: 6-bit codes pack along axis 0 of [K, N] with K a "
                             f"multiple of 4 and integer zero points")
        names = (self.unique(f"{src.name}_q{bits}"), self.unique(src.name + "_scale"),
                 self.unique(src.name + ("_bias" if biases is not None else "_zp")))

        def packed(a: np.ndarray, name: str, width: int) -> TensorProto:
            a = np.ascontiguousarray(a)
            if width == 4:
                return uint4_tensor(a, name)
            return numpy_helper.from_array(ops.pack_uint6(a) if width == 6 else a, name)

        zp_bits = 4 if bits == 4 else 8  # 6-bit zero points are plain uint8
        made = []
        for t in (packed(codes, names[0], bits),
                  numpy_helper.from_array(np.ascontiguousarray(scales), names[1]),
                  numpy_helper.from_array(np.ascontiguousarray(offsets), names[2])
                  if biases is not None else packed(offsets, names[2], zp_bits)):
            made.append(weights.Weight(t.name, self.spill(t) if self.spill else LazyValues(t)))
        size = codes.size
        k = int(src.shape[1] if axis == 1 else src.shape[0])
        block_size = q.block_size
        nbytes = ((size * bits + 7) // 8 + scales.nbytes
                  + (offsets.nbytes if biases is not None else (offsets.size * zp_bits + 7) // 8))
        if bits == 4 and biases is None:  # the 4-bit record's own rounding, kept as it was
            nbytes = (size + offsets.size + 1) // 2 + scales.nbytes
        itemsize = np.dtype(helper.tensor_dtype_to_np_dtype(data_type)).itemsize
        self.original_bytes += size * itemsize
        self.quantized_bytes += nbytes
        self.weights += size
        self.tensors.append(
            {
                "name": src.name,
                "role": role,
                "shape": [int(d) for d in src.shape],
                "axis": axis,
                "codes": names[0],
                "scales": names[1],
                ("biases" if biases is not None else "zero_points"): names[2],
                "block_size": block_size,
                "scale_values": "float16" if half else "float32",
                "scale_stored": str(scales.dtype),
                "partial_block": k % block_size != 0,
                "bits_per_weight": round(8 * nbytes / size, 4),
                "rel_rms_error": round(err, 6),
                **({"bits": bits} if bits != 4 or biases is not None else {}),
                **extra,
            }
        )
        unpacked = None
        if bits == 6:  # one UnpackUInt6 for every reader (the tied table's lookup too)
            unpacked = gs.Variable(self.unique(f"{src.name}_codes"), np.uint8,
                                   [int(d) for d in codes.shape])
            self.groups.append([gs.Node("UnpackUInt6", name=unpacked.name + "_UnpackUInt6",
                                        domain=ops.DOMAIN, inputs=[made[0]],
                                        outputs=[unpacked])])
        return _Q4(*made, block_size, cast_to, biases is not None, unpacked)

    def dequantize(self, q: _Q4, out: gs.Variable, axis: int) -> None:
        """DequantizeLinear (+ Cast) of `q` into `out`."""
        dq_out = out if q.cast_to is None else gs.Variable(out.name + "_f32")
        nodes = [q.dequantize_node(dq_out, axis, out.name + "_DequantizeLinear")]
        if q.cast_to is not None:
            nodes.append(gs.Node("Cast", name=out.name + "_Cast", attrs={"to": q.cast_to},
                                 inputs=[dq_out], outputs=[out]))
        self.groups.append(nodes)

    def gather(self, q: _Q4, gather: gs.Node, stored_kn: bool) -> None:
        """Replace Gather(E, ids) by a gather of rows of codes/scales/zero points + dequantize.

        Standard Gather takes no 4-bit tensors, so codes and zero points are Cast to uint8 first
        (constant-folded once at session creation; the artifact keeps uint4). When the tensor is
        stored as the tied LM head's [H, V], a Transpose (also folded) gives rows again.
        The scales take a lossless round trip through the other float type (their values are
        float16-representable): it gives the lookup its own constant, because onnxruntime
        does not fuse a DequantizeLinear into MatMulNBits when its scales have another consumer.
        Gathered rows dequantize along the last axis, blocks of B, to exactly the head's values.
        """
        out, ids = gather.outputs[0], gather.inputs[1]
        base = self.unique(out.name + "_q4")
        sdt = weights.data_type(q.scales)
        other = TensorProto.FLOAT16 if sdt == TensorProto.FLOAT else TensorProto.FLOAT
        if q.cast_to is not None and sdt == TensorProto.FLOAT:  # not float16 values
            other = TensorProto.DOUBLE
        nodes: list[gs.Node] = []

        def step(op: str, src: gs.Tensor, name: str, **attrs: Any) -> gs.Variable:
            v = gs.Variable(name)
            nodes.append(gs.Node(op, attrs=attrs, inputs=[src], outputs=[v]))
            return v

        def table(src: gs.Constant, tag: str, to: int) -> gs.Variable:
            cur = step("Cast", src, f"{base}_{tag}_cast", to=to)
            if stored_kn:
                cur = step("Transpose", cur, f"{base}_{tag}_rows", perm=[1, 0])
            rows = gs.Variable(f"{base}_{tag}_g")
            nodes.append(gs.Node("Gather", attrs={"axis": 0}, inputs=[cur, ids], outputs=[rows]))
            return rows

        cg = table(q.code_values, "codes", TensorProto.UINT8)
        if q.affine:  # the biases take the scales' lossless round trip too
            zg = step("Cast", table(q.offsets, "bias", other), f"{base}_bias_back", to=sdt)
        else:
            zg = table(q.zero_points, "zp", TensorProto.UINT8)
        sg = table(q.scales, "scale", other)
        back = step("Cast", sg, f"{base}_scale_back", to=sdt)
        gather.outputs.clear()  # `out` is the new nodes' now
        dq_out = out if q.cast_to is None else gs.Variable(f"{base}_dq")
        nodes.append(q.dequantize_node(dq_out, -1, f"{base}_DequantizeLinear", [cg, back, zg]))
        if q.cast_to is not None:
            nodes.append(gs.Node("Cast", attrs={"to": q.cast_to}, inputs=[dq_out], outputs=[out]))
        self.groups.append(nodes)
        self.dead.append(gather)


def _apply(w: _Writer, job: _Job, block_size: int, stats: Moments | None,
           tables: dict[str, gs.Constant], gathers: dict[str, list[gs.Node]],
           given: GivenBlocks | None = None, bits: int | None = None) -> None:
    """Quantize one job's weight (or keep its `given` blocks) and rewire its consumers to the
    quantized form."""
    t, node, trans = job.weight, job.node, job.trans
    axis = 1 if job.kind == "embedding" else 0  # stored in the source's own layout
    if given is not None:
        q = w.keep(t, given, job.role, axis)
    else:
        arr = job.kn()
        q = w.quantize(t, arr, job.role, axis, block_size, stats, bits)
        del arr  # the float copy goes before the next weight is read
    if job.kind == "tied":
        # Stored as the LM head's [K=H, N=V] (blocks along H, axis 1 of E): the head is then
        # the plain DequantizeLinear + MatMul that onnxruntime fuses into MatMulNBits; the
        # lookups gather rows from the same codes (see _Writer.gather).
        assert node is not None and trans is not None
        dq_out = gs.Variable(w.unique(t.name + "_dq"))
        w.dequantize(q, dq_out, axis=0)
        node.inputs[1] = dq_out
        w.dead.append(trans)
        for gather in gathers.pop(t.name):
            w.gather(q, gather, stored_kn=True)
    elif job.kind == "embedding":
        for gather in gathers[t.name]:
            w.gather(q, gather, stored_kn=False)
    elif job.kind == "fused" and w.fused_via_node:
        assert node is not None
        dq_out = gs.Variable(w.unique(t.name + "_dq"))
        w.dequantize(q, dq_out, axis=0)
        node.inputs[1] = dq_out
    elif job.kind == "fused":
        assert node is not None
        bias = node.inputs[4] if len(node.inputs) > 4 and node.inputs[4].name else None
        while len(node.inputs) > 1:  # x stays; the float weight (and empty slots) go
            node.inputs.pop()
        node.inputs.extend([q.codes, q.scales, q.zero_points, *([bias] if bias else [])])
        node.attrs.pop("block_size", None)
        node.attrs["block_size"] = block_size
    else:
        assert node is not None
        dq_out = gs.Variable(w.unique(t.name + "_dq"))
        w.dequantize(q, dq_out, axis=0)
        node.inputs[1] = dq_out
        if trans is not None:
            w.dead.append(trans)


def _rewrite(graph: gs.Graph, w: _Writer) -> None:
    """Insert each new group of nodes just before the first node that reads its value (a group
    reading another new group's value, a 6-bit weight's unpacked codes, gets that group first);
    drop the replaced nodes (their float weights go with them, read by nothing now)."""
    pending = {id(group[-1].outputs[0]): group for group in w.groups}
    dead = {id(n) for n in w.dead}
    order: list[gs.Node] = []

    def place(t: gs.Tensor) -> None:
        group = pending.pop(id(t), None)
        if group is not None:
            for made in group:
                for i in made.inputs:
                    place(i)
            order.extend(group)

    for node in graph.nodes:
        if id(node) in dead:
            continue
        for t in node.inputs:
            place(t)
        order.append(node)
    for group in list(pending.values()):  # a value only the graph outputs read
        place(group[-1].outputs[0])
    graph.nodes = order
    for node in w.dead:
        node.inputs.clear()
        node.outputs.clear()


def _roles(tensors: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per role (linear, fused:FusedQKV, lm_head, ...): tensors, weights, worst error."""
    out: dict[str, dict[str, Any]] = {}
    for t in tensors:
        r = out.setdefault(t["role"], {"tensors": 0, "weights": 0, "max_rel_rms_error": 0.0})
        r["tensors"] += 1
        r["weights"] += int(np.prod(t["shape"]))
        r["max_rel_rms_error"] = max(r["max_rel_rms_error"], t["rel_rms_error"])
    return out


def _overall_bits(graph: gs.Graph, w: _Writer) -> float | None:
    """Bits per weight over every float weight of the graph (quantized and kept float alike):
    the Q4 tensors' codes, scales and zero points plus each float initializer as stored."""
    qparams = {t["scales"] for t in w.tensors} | {t["biases"] for t in w.tensors
                                                   if "biases" in t}
    kept_bytes = kept = 0
    for t in graph.tensors().values():
        if not isinstance(t, gs.Constant) or t.name in qparams:
            continue
        data_type = weights.data_type(t)
        if data_type in _FLOAT_TYPES:
            numel = int(np.prod(t.shape)) if len(t.shape) else 1
            kept += numel
            kept_bytes += numel * np.dtype(helper.tensor_dtype_to_np_dtype(data_type)).itemsize
    total = w.weights + kept
    return round(8 * (w.quantized_bytes + kept_bytes) / total, 4) if total else None
