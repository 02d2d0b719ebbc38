"""Quantized blocks a checkpoint gives: a weight that arrives already quantized (a GGUF tensor
of export/gguf/blocks.py's EXACT_TYPES, an AWQ or GPTQ layer) in the one form fuselm stores, so the
quantize pass (passes/quant/quantize.py) keeps its codes and scales instead of quantizing the
dequantized values a second time.

One weight W [N, K] (a checkpoint's own layout: output rows N, reduction axis K), in blocks of
`block_size` consecutive weights along K:

    integer zero points:  W[n, k] = (codes[n, k] - zero_points[n, k // B]) * scales[n, k // B]
    float biases:         W[n, k] =  codes[n, k] * scales[n, k // B] + biases[n, k // B]

computed in float32 (`dequantize`). The second form is the affine one MLX stores; GGUF's Q4_1
(d, m) and Q4_K (d·sc, -dmin·mn per 32-weight sub-block) are exactly it. Codes are unsigned,
0 .. 2**bits - 1 (a signed format shifts them: Q8_0's int8 q is stored as q + 128 with zero
point 128). Scales and biases are float32 arrays holding the checkpoint's values exactly.

Blocks run along K, so output rows are independent: a row permutation or slice (llama.cpp's
q/k row order, a fused projection cut into parts) and a concatenation along N (pairing q/k/v,
gate/up) keep every block intact (`take_rows`, `concat`). Parts in different forms (llama.cpp's
mixes give v more bits than q and k) are stacked in one form that holds each (`concat`).

A leaf module (NumPy only) so that export/ (which makes them) and passes/ (which stores them)
share it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BITS = (4, 8)


@dataclass(frozen=True)
class GivenBlocks:
    """One weight's quantization as its checkpoint gives it (see the module's formulas)."""

    codes: np.ndarray  # uint8 [N, K], values 0 .. 2**bits - 1
    scales: np.ndarray  # float32 [N, K // block_size]
    bits: int  # 4 or 8
    block_size: int  # K % block_size == 0
    source: str  # what the blocks were in the checkpoint, e.g. "gguf Q4_1", "awq"
    zero_points: np.ndarray | None = None  # uint8 [N, K // block_size]; or
    biases: np.ndarray | None = None  # float32 [N, K // block_size]; exactly one of the two

    def __post_init__(self) -> None:
        n, k = self.codes.shape
        if self.bits not in BITS:
            raise ValueError(f"given blocks of {self.bits} bits; fuselm stores {BITS}")
        if self.block_size <= 0 or k % self.block_size:
            raise ValueError(f"K = {k} is not a whole number of blocks of {self.block_size}")
        if (self.zero_points is None) == (self.biases is None):
            raise ValueError("given blocks need exactly one of zero_points and biases")
        want = (n, k // self.block_size)
        for name in ("scales", "zero_points", "biases"):
            a = getattr(self, name)
            if a is not None and a.shape != want:
                raise ValueError(f"given {name} of shape {a.shape}; expected {want}")
        if self.codes.dtype != np.uint8 or (self.zero_points is not None
                                            and self.zero_points.dtype != np.uint8):
            raise ValueError("given codes and zero points are uint8 arrays")

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.codes.shape[0]), int(self.codes.shape[1]))

    @property
    def affine(self) -> bool:
        """True for the float-bias form (w = q·s + b), False for integer zero points."""
        return self.biases is not None

    def dequantize(self) -> np.ndarray:
        """W [N, K] in float32, by the module's formula."""
        b = self.block_size
        s = np.repeat(self.scales.astype(np.float32), b, axis=1)
        q = self.codes.astype(np.float32)
        if self.biases is not None:
            return q * s + np.repeat(self.biases.astype(np.float32), b, axis=1)
        assert self.zero_points is not None
        return (q - np.repeat(self.zero_points.astype(np.float32), b, axis=1)) * s

    def take_rows(self, rows: np.ndarray | slice) -> GivenBlocks:
        """The blocks of output rows `rows` (an index array or a slice), in that order."""
        def pick(a: np.ndarray | None) -> np.ndarray | None:
            return None if a is None else np.ascontiguousarray(a[rows])

        return GivenBlocks(pick(self.codes), pick(self.scales), self.bits,  # type: ignore[arg-type]
                           self.block_size, self.source, pick(self.zero_points),
                           pick(self.biases))

    def widened(self, bits: int, block_size: int, affine: bool) -> GivenBlocks:
        """The same weights in a form of at least as many bits, a block size dividing this one
        and, when `affine`, float biases: codes stay as they are (a 4-bit code is an 8-bit
        one), a block's scale (zero point, bias) repeats over its sub-blocks, and a zero point
        z becomes the bias -z·s (exact for a power-of-two z, as every GGUF type's; the weights
        q·s + b then round once more than (q - z)·s: equal to float32 rounding of q·s)."""
        if bits < self.bits or self.block_size % block_size or (self.affine and not affine):
            raise ValueError(f"{self.bits}-bit blocks of {self.block_size} cannot be held as "
                             f"{bits}-bit blocks of {block_size}")
        r = self.block_size // block_size

        def fine(a: np.ndarray | None) -> np.ndarray | None:
            return None if a is None else np.repeat(a, r, axis=1)

        scales, zero_points, biases = fine(self.scales), fine(self.zero_points), fine(self.biases)
        if affine and zero_points is not None:
            assert scales is not None
            biases = -(zero_points.astype(np.float32) * scales.astype(np.float32))
            zero_points = None
        return GivenBlocks(self.codes, scales, bits, block_size,  # type: ignore[arg-type]
                           self.source, zero_points, biases)

    @staticmethod
    def concat(parts: list[GivenBlocks]) -> GivenBlocks | None:
        """The parts stacked along N (one packed projection), in the form that holds each
        (`widened`: the most bits, the smallest block, float biases when any part has them);
        None when one part's block size does not divide another's."""
        bits = max(p.bits for p in parts)
        block = min(p.block_size for p in parts)
        affine = any(p.affine for p in parts)
        if any(p.block_size % block for p in parts):
            return None
        parts = [p if (p.bits, p.block_size, p.affine) == (bits, block, affine)
                 else p.widened(bits, block, affine) for p in parts]

        def cat(name: str) -> np.ndarray | None:
            arrays = [getattr(p, name) for p in parts]
            return None if arrays[0] is None else np.concatenate(arrays, axis=0)

        sources = sorted({p.source for p in parts})
        return GivenBlocks(cat("codes"), cat("scales"), bits,  # type: ignore[arg-type]
                           block, "+".join(sources), cat("zero_points"), cat("biases"))
