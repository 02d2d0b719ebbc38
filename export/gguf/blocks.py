"""GGUF block formats read as fuselm's given blocks (fuselm/given_blocks.py), bit for bit.

The types whose blocks fuselm's stored formats hold exactly (ggml's layouts, ggml-common.h):

    Q4_0  32 weights: d (f16), 16 bytes of nibbles      w = d·(q - 8)     → 4 bits, zero point 8
    Q4_1  32 weights: d, m (f16), 16 bytes of nibbles   w = d·q + m       → 4 bits, bias m
    Q8_0  32 weights: d (f16), 32 int8                  w = d·q           → 8 bits, q + 128,
                                                                              zero point 128
    Q5_0  32 weights: d (f16), 4 bytes of high bits,    w = d·(q - 16)    → 8 bits, q + 112,
          16 bytes of low nibbles (q: 5 bits)                                 zero point 128
    Q4_K  256 weights: d, dmin (f16), 12 bytes of 6-bit scales and mins, 128 bytes of nibbles;
          per 32-weight sub-block j: w = (d·sc_j)·q - dmin·mn_j            → 4 bits, block 32,
                                                                              scale d·sc_j, bias
                                                                              -(dmin·mn_j)
    Q6_K  256 weights: 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 int8 scales, d
          (f16); per 16-weight sub-block j: w = (d·sc_j)·(q - 32)          → 8 bits, block 16,
                                                                              zero point 32,
                                                                              scale d·sc_j

Nibbles: within a 32-weight group, byte i holds weight i in its low nibble and weight i + 16
in its high one (Q4_K: byte i of a 64-weight chunk holds weight i of its first sub-block low
and of its second high; Q5_0: bit i of its little-endian 32-bit word is weight i's fifth
bit; Q6_K: as gguf's dequantizer unpacks it). Scales and biases are computed in float32 as
gguf's own dequantize computes them, so `GivenBlocks.dequantize()` equals
`gguf.quants.dequantize` exactly. Other types (Q5_K, ...) have no exact form here:
`given_blocks` answers None for them. Q6_K's 16-weight blocks are narrower than MLX's packed
groups (32 and up): that engine multiplies them as a dense matrix dequantized once at load,
which is exact too.
"""

from __future__ import annotations

import numpy as np

from fuselm.given_blocks import GivenBlocks

EXACT_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q4_K", "Q6_K")
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "Q5_0": 22, "Q4_K": 144, "Q6_K": 210}
_BLOCK_WEIGHTS = {"Q4_0": 32, "Q4_1": 32, "Q8_0": 32, "Q5_0": 32, "Q4_K": 256, "Q6_K": 256}


def _f16(raw: np.ndarray) -> np.ndarray:
    """[..., 2] bytes → float32 [...] (the stored float16 values)."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes → [..., 32] codes: low nibbles first, then high ones."""
    return np.concatenate([qs & np.uint8(15), qs >> np.uint8(4)], axis=-1)


def given_blocks(type_name: str, raw: np.ndarray, shape: tuple[int, int]) -> GivenBlocks | None:
    """The blocks of one tensor of `shape` [N, K] from its raw bytes (uint8, the tensor's
    whole data), or None when `type_name` has no exact form."""
    if type_name not in EXACT_TYPES or len(shape) != 2:
        return None
    n, k = shape
    per = _BLOCK_WEIGHTS[type_name]
    if k % per:
        return None
    b = raw.reshape(n, k // per, _BLOCK_BYTES[type_name])
    src = f"gguf {type_name}"
    if type_name == "Q4_0":
        codes = _nibbles(b[..., 2:]).reshape(n, k)
        return GivenBlocks(codes, _f16(b[..., 0:2]), 4, 32, src,
                           zero_points=np.full((n, k // 32), 8, np.uint8))
    if type_name == "Q4_1":
        codes = _nibbles(b[..., 4:]).reshape(n, k)
        return GivenBlocks(codes, _f16(b[..., 0:2]), 4, 32, src, biases=_f16(b[..., 2:4]))
    if type_name == "Q8_0":
        q = np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(n, k)
        codes = (q.astype(np.int16) + 128).astype(np.uint8)
        return GivenBlocks(codes, _f16(b[..., 0:2]), 8, 32, src,
                           zero_points=np.full((n, k // 32), 128, np.uint8))
    if type_name == "Q5_0":  # 5-bit codes held as 8-bit ones: q - 16 + 128 (exact)
        high = np.ascontiguousarray(b[..., 2:6]).view("<u4")  # [n, k // 32, 1]
        fifth = ((high >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
        codes = (_nibbles(b[..., 6:]) | (fifth << np.uint8(4))) + np.uint8(112)
        return GivenBlocks(codes.reshape(n, k), _f16(b[..., 0:2]), 8, 32, src,
                           zero_points=np.full((n, k // 32), 128, np.uint8))
    if type_name == "Q6_K":
        return _q6_k(b, n, k, src)
    return _q4_k(b, n, k, src)


def _q4_k(b: np.ndarray, n: int, k: int, src: str) -> GivenBlocks:
    """Q4_K: 8 sub-blocks of 32 per super-block, each with its own float32 scale and bias."""
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])  # [n, S]
    s = b[..., 4:16]
    lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([lo & 63, (hi & 15) | ((lo >> 6) << 4)], axis=-1)  # [n, S, 8]
    mn = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=-1)
    scales = d[..., None] * sc.astype(np.float32)
    biases = -(dmin[..., None] * mn.astype(np.float32))
    qs = b[..., 16:].reshape(n, -1, 4, 32)  # 4 chunks of 64 weights: 32 bytes each
    codes = np.stack([qs & np.uint8(15), qs >> np.uint8(4)], axis=3)  # [n, S, 4, 2, 32]
    return GivenBlocks(codes.reshape(n, k), scales.reshape(n, -1), 4, 32, src,
                       biases=biases.reshape(n, -1))


def _q6_k(b: np.ndarray, n: int, k: int, src: str) -> GivenBlocks:
    """Q6_K: 16 sub-blocks of 16 per super-block, 6-bit codes with zero point 32 held in 8
    bits, scale d·sc_j in float32 (gguf's `Q6_K.dequantize_blocks`, its unpacking order)."""
    ql, qh = b[..., 0:128], b[..., 128:192]
    sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8).astype(np.float32)
    d = _f16(b[..., 208:210])
    low = (ql.reshape(n, -1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(2, 1)) & 15
    high = (qh.reshape(n, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 3
    codes = low.reshape(n, -1, 8, 32) | (high.reshape(n, -1, 8, 32) << np.uint8(4))
    return GivenBlocks(codes.reshape(n, k).astype(np.uint8), (d[..., None] * sc).reshape(n, -1),
                       8, 16, src, zero_points=np.full((n, k // 16), 32, np.uint8))
