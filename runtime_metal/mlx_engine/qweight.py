"""Q4 weights in MLX's affine form, taken from ONNX blocked DequantizeLinear without re-quantizing.

ONNX: w[k, n] = (codes[k, n] - zp[k // B, n]) * scale[k // B, n]   (blocks along the reduction
axis K; axis 0 for a [K, N] MatMul weight, axis 1 for a tied [V, H] embedding).
MLX:  w = scale * q + bias, codes packed 8 per uint32 along the grouped (last) axis.
So q = codes, scale = scale, bias = -zp * scale: the same weights, bit for bit. Computing the bias
in float32 keeps it exact (a float16 scale has 11 significant bits, zp < 16 adds 4; zp < 256 of
8-bit codes adds 8). fuselm.DequantizeAffine (w = codes * scale + bias, passes/ops.py) is MLX's
form itself: its biases are taken as they are. 4-bit codes pack 8 per uint32, 8-bit ones 4,
6-bit ones (DequantizeLinear over fuselm.UnpackUInt6) as MLX's little-endian bit stream along
the grouped axis, four codes in three bytes: the artifact's own layout (passes/ops.py
`pack_uint6`) of each row. fuselm's CUDA kernels take 4- and 8-bit weights only
(q4_gemv.fits, embedding.take_fits); a 6-bit one always runs MLX's own quantized ops.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import ml_dtypes
import mlx.core as mx
import numpy as np

from fuselm.passes import ops as contract
from fuselm.runtime_metal.cuda_kernels import embedding as kernels_embedding
from fuselm.runtime_metal.cuda_kernels import q4_gemv as kernels_q4
from fuselm.runtime_metal.cuda_kernels import selection as kernels
from fuselm.runtime_metal.dtypes import FOUR_BIT, to_device

MLX_GROUP_SIZES = (32, 64, 128)
_tracing = 0  # > 0 while mx.compile traces the decode step: values are placeholders then
_gemv = 0  # > 0 while the compiled program traces a decode step with fuselm's CUDA kernels on
# The rows h and y of the add+norm GEMV's one output hy (kernels_q4.q4_gemv_add_norm):
# id of the lazy view h or y -> (the view, kept so that its id stays unique; hy; the view's
# element offset in hy). A GEMV kernel reading a view reads it out of hy at that offset
# instead (`_packed_source`), so the view is never evaluated: no Slice node a step (~1.7 µs
# of MLX-CUDA host time each). Any other reader evaluates the view (correct, only slower).
# Emptied when gemv_kernel ends.
_packed: dict[int, tuple[mx.array, mx.array, int]] = {}


@contextmanager
def gemv_kernel(on: bool = True) -> Iterator[None]:
    """Inside (when `on`), a matmul of at most kernels_q4.MAX_ROWS rows runs fuselm's Q4 GEMV
    kernel (cuda_kernels/q4_gemv.py) where it fits: the compiled program's decode steps on
    MLX-CUDA, one row per sequence. Prefill chunks and the executor keep MLX's matmul."""
    global _gemv
    _gemv += int(on)
    try:
        yield
    finally:
        _gemv -= int(on)
        if not _gemv:
            _packed.clear()


def _pack(hy: mx.array) -> tuple[mx.array, mx.array]:
    """(h, y): the views of hy (kernels_q4.halves), registered in `_packed`."""
    h, y = kernels_q4.halves(hy)
    _packed[id(h)] = (h, hy, 0)
    _packed[id(y)] = (y, hy, kernels_q4.y_offset(hy))
    return h, y


def _packed_source(x: object) -> kernels_q4.Source | None:
    """(hy, offset) where x is a view of an add+norm GEMV's output registered in `_packed`,
    else None (a kernel then reads x itself)."""
    got = _packed.get(id(x)) if _packed else None
    return None if got is None else (got[1], got[2])


def packed_pending() -> int:
    """Views of add+norm outputs registered now (0 outside gemv_kernel)."""
    return len(_packed)


_float32_result = 0  # > 0 while the LM head's matmul is traced: its GEMV writes float32


@contextmanager
def float32_result() -> Iterator[None]:
    """Inside, a matmul that runs the Q4 GEMV kernel writes its result as float32 (rounded to
    the activation dtype first: the values of the usual result cast to float32). The decode
    step's LM head runs so: the logits come out float32 without a cast launch a step."""
    global _float32_result
    _float32_result += 1
    try:
        yield
    finally:
        _float32_result -= 1


@contextmanager
def tracing() -> Iterator[None]:
    """Inside, QWeight casts are not cached (a traced placeholder must not outlive the trace)."""
    global _tracing
    _tracing += 1
    try:
        yield
    finally:
        _tracing -= 1


# Markers in QWeight._cast (shared by a weight's T()/astype() views): no quantized kernel for
# multi-row inputs / for any input on this MLX build; from how many rows a matmul runs over
# the weight dequantized inside the call (set_dense_rows; absent: never).
_DENSE_ROWS = "_dense_rows"
_DENSE_ALL = "_dense_all"
_DENSE_FROM = "_dense_from"


@dataclass(eq=False)
class QWeight:
    """A logical 2-D weight W: `packed` holds M [R, C] grouped along C; W = M.T if transposed."""

    packed: mx.array  # uint32 [R, C / 8]
    scales: mx.array  # [R, C / group]
    biases: mx.array  # [R, C / group]
    group_size: int
    transposed: bool
    dtype: object = mx.float32  # the dtype DequantizeLinear (+ Cast) would produce
    _cast: dict = field(default_factory=dict, repr=False)
    rows_only: bool = False  # an embedding table read by row gathers, never a matmul weight
    bits: int = 4

    @property
    def shape(self) -> tuple[int, int]:
        r, c = self.packed.shape[0], self.packed.shape[1] * 32 // self.bits
        return (c, r) if self.transposed else (r, c)

    def T(self) -> QWeight:  # noqa: N802 - mirrors array.T
        return QWeight(self.packed, self.scales, self.biases, self.group_size,
                       not self.transposed, self.dtype, self._cast, bits=self.bits)

    def astype(self, dtype: object) -> QWeight:
        return QWeight(self.packed, self.scales, self.biases, self.group_size,
                       self.transposed, dtype, self._cast, bits=self.bits)

    def affine(self, dtype: object) -> tuple[mx.array, mx.array]:
        """Scales and biases in the activation dtype (cast once, cached)."""
        if self.scales.dtype == dtype:
            return self.scales, self.biases
        if dtype not in self._cast:
            pair = (self.scales.astype(dtype), self.biases.astype(dtype))
            if _tracing:
                return pair
            self._cast[dtype] = pair
        return self._cast[dtype]

    def matmul(self, x: mx.array) -> mx.array:
        """x @ W as ONE quantized matmul."""
        s, b = self.affine(x.dtype)
        if self._gemv_fits(x):
            return kernels_q4.q4_gemv(x, self.packed, s, b, self.group_size,
                                      out_dtype=mx.float32 if _float32_result else None,
                                      x_at=_packed_source(x))
        rows = x.size // x.shape[-1]
        if rows >= kernels_q4.MAX_ROWS and 0 < self._cast.get(_DENSE_FROM, 0) <= rows:
            # many rows (a prefill chunk) on MLX-CUDA: dequantize for this call only
            m = mx.dequantize(self.packed, s, b, group_size=self.group_size, bits=self.bits)
            return x @ (m.T if self.transposed else m)
        if self._cast.get(_DENSE_ALL) or (self._cast.get(_DENSE_ROWS) and rows > 1):
            # This MLX build has no quantized kernel for this weight and input (probe_kernels
            # found it): a plain matmul over the dequantized weight, made once and kept.
            key = ("_dense", x.dtype)
            if key not in self._cast:
                m = mx.dequantize(self.packed, s, b, group_size=self.group_size, bits=self.bits)
                m = m.T if self.transposed else m
                if _tracing:
                    return x @ m
                self._cast[key] = mx.contiguous(m)
            return x @ self._cast[key]
        # W = M.T  ->  x @ M.T is MLX's transpose=True form (groups along the reduction axis).
        return mx.quantized_matmul(x, self.packed, s, b, transpose=self.transposed,
                                   group_size=self.group_size, bits=self.bits)

    def matmul_add_norm(self, x: mx.array, residual: object, scale: object, eps: float
                        ) -> tuple[mx.array, mx.array] | None:
        """(h, y) = (x @ W + residual, RMSNorm of that * scale) from the GEMV kernel with its
        add+norm epilogue, or None where it is off or does not fit, an eps the kernel cannot
        take as a template constant included (a negative one: kernels.takes_float_bits).
        h and y are lazy views of the launch's one output (registered in `_packed`): this
        weight's and the next ones' GEMVs read them out of it, x or residual alike."""
        if not (self._gemv_fits(x) and kernels.takes_float_bits(eps)
                and kernels_q4.add_norm_fits(x, self.packed, residual, scale)):
            return None
        assert isinstance(residual, mx.array) and isinstance(scale, mx.array)
        s, b = self.affine(x.dtype)
        x_at, r_at = _packed_source(x), _packed_source(residual)
        return _pack(kernels_q4.q4_gemv_add_norm(x, self.packed, s, b, self.group_size,
                                                 residual, scale, eps, x_at=x_at,
                                                 residual_at=r_at))

    def _gemv_fits(self, x: mx.array, activation: str | None = None) -> bool:
        return bool(_gemv) and kernels_q4.fits(x, self.packed, self.affine(x.dtype)[0],
                                               self.group_size, self.bits, self.transposed,
                                               activation)

    def gated_matmul(self, x: mx.array, activation: str) -> mx.array | None:
        """act(x @ W[:, :N/2]) * (x @ W[:, N/2:]) as one kernel launch (FusedGateUp's form),
        or None where the kernel is off or does not fit (the caller runs the plain path)."""
        if not self._gemv_fits(x, activation):
            return None
        s, b = self.affine(x.dtype)
        return kernels_q4.q4_gemv(x, self.packed, s, b, self.group_size, activation,
                                  x_at=_packed_source(x))

    def take_rows(self, indices: mx.array) -> mx.array:
        """W[indices] for an untransposed W (a quantized embedding): dequantize only those rows;
        a negative index counts from the end (ONNX Gather). Inside gemv_kernel (the decode
        steps on MLX-CUDA): one kernel launch (kernels_embedding.q4_take_rows)."""
        assert not self.transposed
        if _gemv and kernels_embedding.take_fits(indices, self.packed, self.scales,
                                                 self.group_size, self.bits):
            return kernels_embedding.q4_take_rows(indices, self.packed, self.scales,
                                                  self.biases, self.group_size, self.dtype)
        indices = mx.where(indices < 0, indices + self.shape[0], indices)
        rows = mx.dequantize(self.packed[indices], self.scales[indices], self.biases[indices],
                             group_size=self.group_size, bits=self.bits)
        return rows.astype(self.dtype)

    def dense(self) -> mx.array:
        m = mx.dequantize(self.packed, self.scales, self.biases, group_size=self.group_size,
                          bits=self.bits).astype(self.dtype)
        return m.T if self.transposed else m


def _pack_rows(codes: np.ndarray) -> np.ndarray:
    """uint8 codes [R, C] (C % 8 == 0) -> uint32 [R, C/8], element j of a word at bits 4j:
    two codes a byte (low nibble first), four bytes a little-endian word, read as a view."""
    pairs = np.ascontiguousarray(codes[:, 0::2] | (codes[:, 1::2] << np.uint8(4)))
    return pairs.view(np.dtype("<u4")).astype(np.uint32, copy=False)


def _pack_columns(codes: np.ndarray) -> np.ndarray:
    """uint8 codes [R, C] (R % 8 == 0) -> uint32 [C, R/8]: _pack_rows(codes.T), packing first
    (contiguous rows, 4-byte words) and transposing the 8x smaller words after; transposing
    the one-byte codes first was most of a large model's load."""
    pairs = codes[0::2] | (codes[1::2] << np.uint8(4))  # [R/2, C]: codes 2i, 2i+1 of a byte
    words = pairs[0::4].astype(np.uint32)
    for b in range(1, 4):
        words |= pairs[b::4].astype(np.uint32) << np.uint32(8 * b)
    return np.ascontiguousarray(words.T)


def _pack_bytes(codes: np.ndarray, transposed: bool) -> np.ndarray:
    """8-bit codes [R, C] → uint32 words of 4 along the grouped axis (C, or R when
    `transposed`: the words of codes.T), little-endian: element j of a word at bits 8j."""
    q = np.ascontiguousarray(codes.T if transposed else codes, dtype=np.uint8)
    return q.view(np.dtype("<u4")).astype(np.uint32, copy=False)


def _pack_six(codes: np.ndarray, transposed: bool) -> np.ndarray:
    """6-bit codes [R, C] (uint8 < 64) → uint32 words along the grouped axis (C, or R when
    `transposed`): pack_uint6 along that axis, four codes in three bytes, twelve bytes (16
    codes) three little-endian words."""
    q = np.ascontiguousarray(codes, dtype=np.uint8)
    stream = contract.pack_uint6(q if transposed else np.ascontiguousarray(q.T))
    return np.ascontiguousarray(stream.T).view(np.dtype("<u4")).astype(np.uint32, copy=False)


def can_pack(codes: np.ndarray, scales: np.ndarray, axis: int, block_size: int) -> bool:
    """True when the blocked DequantizeLinear (or DequantizeAffine) maps 1:1 onto MLX's
    affine groups: 4-bit codes, or 8-bit unsigned ones."""
    return (
        codes.ndim == 2
        and (codes.dtype in FOUR_BIT or codes.dtype == np.uint8)
        and axis in (0, 1, -1, -2)
        and block_size in MLX_GROUP_SIZES
        and codes.shape[axis % 2] % block_size == 0
        and scales.ndim == 2
    )


def from_dequantize_linear(
    codes: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, axis: int,
    block_size: int, six: bool = False,
) -> QWeight:
    """Repack a constant blocked DequantizeLinear (see can_pack) into a QWeight; `six`: its
    uint8 codes are fuselm.UnpackUInt6's (each < 64), packed again at 6 bits."""
    if codes.dtype == np.uint8:
        z = np.zeros(scales.shape, np.uint8) if zero_points is None else zero_points
        return _repack(codes, scales, None, z, axis, block_size, 6 if six else 8)
    signed = codes.dtype == np.dtype(ml_dtypes.int4)
    # int4 codes c and zero points z: (c - z) = ((c + 8) - (z + 8)), so shift both to uint4.
    # On the codes' bytes (ml_dtypes keeps a 4-bit element in the low nibble): c + 8 of a
    # two's-complement nibble is the nibble with bit 3 flipped. Byte work, no element casts:
    # the casts were most of a large model's load time.
    q = codes.view(np.uint8) & np.uint8(15)
    if signed:
        q ^= np.uint8(8)
    if zero_points is None:
        z = np.full(scales.shape, 8 if signed else 0, np.int16)
    else:
        z = zero_points.astype(np.int16) + (8 if signed else 0)
    return _repack(q, scales, None, z, axis, block_size, 4)


def from_dequantize_affine(codes: np.ndarray, scales: np.ndarray, biases: np.ndarray,
                           axis: int, block_size: int) -> QWeight:
    """Repack a constant fuselm.DequantizeAffine (see can_pack) into a QWeight: its biases
    are MLX's own."""
    bits = 8 if codes.dtype == np.uint8 else 4
    q = codes if bits == 8 else codes.view(np.uint8) & np.uint8(15)
    return _repack(q, scales, biases, None, axis, block_size, bits)


def _repack(q: np.ndarray, scales: np.ndarray, biases: np.ndarray | None,
            z: np.ndarray | None, axis: int, block_size: int, bits: int) -> QWeight:
    """QWeight of uint8 codes q (values < 2**bits), with `biases` or zero points `z`."""
    transposed = axis % 2 == 0
    if transposed:  # blocks along rows: MLX groups along the last axis, so store W.T
        packed = (_pack_columns(q) if bits == 4 else _pack_six(q, True) if bits == 6
                  else _pack_bytes(q, True))
        s = scales.T
        z = None if z is None else z.T
        biases = None if biases is None else biases.T
    else:
        packed = (_pack_rows(np.ascontiguousarray(q)) if bits == 4
                  else _pack_six(q, False) if bits == 6 else _pack_bytes(q, False))
        s = scales
    s32 = np.ascontiguousarray(s).astype(np.float32)
    # C order: numpy may lay out the product of a transposed and a plain array column-major,
    # MLX keeps that layout, and MLX-CUDA's quantized kernels take row-major biases only.
    if biases is None:
        assert z is not None
        bias = np.ascontiguousarray(-(z.astype(np.float32) * s32))
    else:
        bias = np.ascontiguousarray(biases).astype(np.float32)
    out_dtype = to_device(np.zeros((), scales.dtype)).dtype  # type: ignore[union-attr]
    return QWeight(mx.array(packed), to_device(s32), to_device(bias),  # type: ignore[arg-type]
                   block_size, transposed, out_dtype, bits=bits)


def settle_affine(weights: list[QWeight], dtype: object) -> None:
    """Keep each weight's scales and biases in the activation dtype only (the float32 pair made
    at packing is what exactness needs for float32 activations; for half-precision ones the
    matmul casts them anyway, and keeping both would hold the affine terms twice). Arrays
    shared by several QWeights (a tied embedding and its head) are cast once."""
    memo: dict[int, mx.array] = {}
    for w in weights:
        if w.scales.dtype == dtype:
            continue
        for name in ("scales", "biases"):
            old = getattr(w, name)
            if id(old) not in memo:
                memo[id(old)] = old.astype(dtype)
            setattr(w, name, memo[id(old)])
        w._cast.pop(dtype, None)
    mx.eval(list(memo.values()))


def held_bytes(constants: dict[str, object]) -> int:
    """Bytes of the arrays a plan's constants hold, each array once however many QWeights share
    it (a tied embedding and its head), casts kept for other activation dtypes included."""
    arrays: dict[int, int] = {}
    for v in constants.values():
        if isinstance(v, QWeight):
            for a in (v.packed, v.scales, v.biases):
                arrays[id(a)] = a.nbytes
            for cached in v._cast.values():
                for a in cached if isinstance(cached, tuple) else (cached,):
                    if isinstance(a, mx.array):
                        arrays[id(a)] = a.nbytes
        elif isinstance(v, mx.array | np.ndarray):
            arrays[id(v)] = v.nbytes
    return sum(arrays.values())


def probe_kernels(weights: list[QWeight], dtype: object, rows: int = 16) -> int:
    """Mark the weights whose quantized matmul this MLX build cannot run, or runs wrong.

    Some MLX backends dispatch quantized matmul to kernels with conditions on shapes and
    layouts (MLX-CUDA 0.32.4 on an H200 refused our weights with "No implementation for
    problem shape"); each weight is tried once at load with a one-row and a `rows`-row input,
    and what is refused falls back to a plain matmul over the dequantized weight. A result
    that does not match that plain matmul (an 8-bit model on MLX-CUDA gave non-finite logits
    through MLX's own ops) falls back the same way rather than decoding garbage. Returns how
    many weights were marked.
    """
    marked = 0
    for w in weights:
        s, b = w.affine(dtype)
        dense = mx.dequantize(w.packed, s, b, group_size=w.group_size, bits=w.bits)
        dense = dense.T if w.transposed else dense
        for n, marker in ((1, _DENSE_ALL), (rows, _DENSE_ROWS)):
            x = mx.random.normal((1, n, w.shape[0]), key=mx.random.key(n)).astype(dtype)
            try:
                got = mx.quantized_matmul(x, w.packed, s, b, transpose=w.transposed,
                                          group_size=w.group_size, bits=w.bits)
                ok = _close(got, x @ dense)
            except RuntimeError:
                ok = False
            if not ok:
                w._cast[marker] = True
                marked += 1
                break
    return marked


def _close(got: mx.array, want: mx.array) -> bool:
    """The same matmul up to the accumulation order of the activation dtype."""
    got, want = got.astype(mx.float32), want.astype(mx.float32)
    scale = mx.maximum(mx.max(mx.abs(want)), mx.array(1e-6))
    err = mx.max(mx.abs(got - want)) / scale
    return bool(mx.all(mx.isfinite(got)).item()) and float(err.item()) <= 1e-2


def set_dense_rows(weights: list[QWeight], rows: int) -> None:
    """From `rows` rows on (0: never), each weight's matmul dequantizes it inside the call and
    runs a dense matmul instead of MLX's quantized matmul (kernels.dense_prefill_rows: a
    prefill chunk on MLX-CUDA, whose many-row quantized matmul is the slower)."""
    for w in weights:
        w._cast[_DENSE_FROM] = rows


def warm_dense(weights: list[QWeight], dtype: object) -> None:
    """Make and keep the dequantized matrix of every weight probe_kernels marked, for `dtype`
    activations: the compiled program (decode.py) traces its matmuls with caching off, so a
    matrix first made inside a trace would be re-dequantized on every call."""
    for w in weights:
        if w._cast.get(_DENSE_ALL) or w._cast.get(_DENSE_ROWS):
            w.matmul(mx.zeros((1, 2, w.shape[0]), dtype=dtype))
