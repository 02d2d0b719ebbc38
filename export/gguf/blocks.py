"""GGUF block formats read as fuselm's given blocks (fuselm/given_blocks.py), bit for bit.

The types whose blocks fuselm's stored formats hold exactly (ggml's layouts, ggml-common.h).
Per block: the formula of the file's weight w from its code q, and the stored form.

    Q4_0   32: d (f16), 16 bytes of nibbles         w = d·(q - 8)      4 bits, zero point 8
    Q4_1   32: d, m (f16), 16 bytes of nibbles      w = d·q + m        4 bits, bias m
    Q8_0   32: d (f16), 32 int8                     w = d·q            8 bits, q + 128, zp 128
    Q5_0   32: d, 4 bytes of fifth bits, nibbles    w = d·(q - 16)     8 bits, q + 112, zp 128
    Q5_1   32: d, m, 4 bytes of fifth bits, nibbles w = d·q + m        8 bits (q: 0..31), bias m
    IQ4_NL 32: d, 16 bytes of nibbles               w = d·kv[q]        8 bits, kv[q] + 128,
           (kv: 16 fixed int8 levels, -127 .. 113)                      zp 128
    Q4_K  256: d, dmin, 12 bytes of 6-bit scales and mins, nibbles; per 32-weight sub-block j:
               w = (d·sc_j)·q - dmin·mn_j                              4 bits, block 32, scale
                                                                       d·sc_j, bias -(dmin·mn_j)
    Q5_K  256: as Q4_K plus 32 bytes of fifth bits  (q: 0..31)         8 bits, as Q4_K
    IQ4_XS 256: d, 8 6-bit scales ls_j, nibbles; per 32-weight sub-block j:
               w = (d·(ls_j - 32))·kv[q]                               8 bits, block 32,
                                                                       kv[q] + 128, zp 128
    Q6_K  256: low nibbles, 2-bit highs, 16 int8 scales, d; per 16-weight sub-block j:
               w = (d·sc_j)·(q - 32)                                   8 bits, block 16, zp 32
    Q3_K  256: 2-bit lows, a high-bit mask, 16 6-bit scales, d; per 16-weight sub-block j:
               w = (d·(sc_j - 32))·q, q = low - 4·(1 - high) in -4..3  4 bits, block 16, q + 4,
                                                                       zp 4
    Q2_K  256: 16 bytes of 4-bit scale and min, 2-bit codes, d, dmin; per 16 weights j:
               w = (d·sc_j)·q - dmin·mn_j                              4 bits, block 16, bias
    IQ2_XXS, IQ3_XXS, IQ3_S 256: d, grid indices, signs, 4-bit scales; per 32 weights j:
               w = db_j·(±g), g a grid value (integers up to 62)       8 bits, g + 128, zp 128
    IQ2_XS, IQ2_S 256: the same per 16 weights (g: 8, 25, 43)          8 bits, block 16, as above
    IQ1_S  256: d, grid indices, 3-bit scales, delta signs; per 32 weights j:
               w = dl_j·(g ± 1/8), g in -1..1                          8 bits, 8g ± 1 + 128, zp
                                                                       128, scale dl_j / 8
    IQ1_M  256: the same per 16 weights, d in four nibbles             8 bits, block 16, as above
    TQ1_0, TQ2_0 256: base-3 or 2-bit ternary codes, d; w = d·t, t in -1..1 (TQ2_0's code 3
               gives 2)                                                4 bits, t + 1, zp 1,
                                                                       block 32, scale d
    MXFP4   32: e8m0 exponent e, 16 bytes of nibbles: w = 2^(e-128)·v, v in -12..12 (E2M1
               values doubled)                                         8 bits, v + 128, zp 128

Nibbles: within a 32-weight group, byte i holds weight i in its low nibble and weight i + 16
in its high one (Q4_K/Q5_K: byte i of a 64-weight chunk holds weight i of its first sub-block
low and of its second high; Q5_0/Q5_1: bit i of the little-endian 32-bit word is weight i's
fifth bit; Q5_K: bit j of byte i is sub-block j's weight i's; Q6_K, Q3_K, Q2_K, IQ4_XS: as
gguf's dequantizers unpack them). Scales and biases are computed in float32 as gguf's own
dequantize computes them, and each product is the same float32 product, so
`GivenBlocks.dequantize()` equals `gguf.quants.dequantize` exactly (the grid, ternary and
MXFP4 types' codes are read back from gguf's own weights and kept only when they give them
exactly: `given_blocks` answers None otherwise, and the tensor goes to the nearest format).
Blocks of 16 are narrower than MLX's packed groups (32 and up): that engine multiplies them as
a dense matrix dequantized once at load, which is exact too.
"""

from __future__ import annotations

import numpy as np

from fuselm.given_blocks import GivenBlocks

EXACT_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "IQ4_NL", "Q4_K", "Q5_K", "IQ4_XS",
               "Q6_K", "Q3_K", "Q2_K", "IQ2_XXS", "IQ3_XXS", "IQ3_S", "IQ2_XS", "IQ2_S",
               "IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0", "MXFP4")
# (weights, bytes) per block
_BLOCKS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34), "Q5_0": (32, 22),
           "Q5_1": (32, 24), "IQ4_NL": (32, 18), "Q4_K": (256, 144), "Q5_K": (256, 176),
           "IQ4_XS": (256, 136), "Q6_K": (256, 210), "Q3_K": (256, 110), "Q2_K": (256, 84),
           "IQ2_XXS": (256, 66), "IQ3_XXS": (256, 98), "IQ3_S": (256, 110),
           "IQ2_XS": (256, 74), "IQ2_S": (256, 82), "IQ1_S": (256, 50), "IQ1_M": (256, 56),
           "TQ1_0": (256, 54), "TQ2_0": (256, 66), "MXFP4": (32, 17)}
# IQ4_NL's and IQ4_XS's 16 levels (ggml-common.h kvalues_iq4nl), held as 8-bit codes + 128
_IQ4_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89,
                        113], np.int16)


def _f16(raw: np.ndarray) -> np.ndarray:
    """[..., 2] bytes → float32 [...] (the stored float16 values)."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes → [..., 32] codes: low nibbles first, then high ones."""
    return np.concatenate([qs & np.uint8(15), qs >> np.uint8(4)], axis=-1)


def _fifth_bits(raw: np.ndarray) -> np.ndarray:
    """[..., 4] bytes (a little-endian 32-bit word) → [..., 32] bits, bit i = weight i's."""
    high = np.ascontiguousarray(raw).view("<u4")  # [..., 1]
    return ((high >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _iq4(nibbles: np.ndarray) -> np.ndarray:
    """IQ4 level indices → 8-bit codes: the level + 128 (zero point 128)."""
    return (_IQ4_LEVELS[nibbles] + 128).astype(np.uint8)


def _zp(n: int, blocks: int, value: int) -> np.ndarray:
    return np.full((n, blocks), value, np.uint8)


def given_blocks(type_name: str, raw: np.ndarray, shape: tuple[int, int]) -> GivenBlocks | None:
    """The blocks of one tensor of `shape` [N, K] from its raw bytes (uint8, the tensor's
    whole data), or None when `type_name` has no exact form."""
    if type_name not in EXACT_TYPES or len(shape) != 2:
        return None
    n, k = shape
    per, size = _BLOCKS[type_name]
    if k % per:
        return None
    b = raw.reshape(n, k // per, size)
    src = f"gguf {type_name}"
    if type_name == "Q4_0":
        codes = _nibbles(b[..., 2:]).reshape(n, k)
        return GivenBlocks(codes, _f16(b[..., 0:2]), 4, 32, src, zero_points=_zp(n, k // 32, 8))
    if type_name == "Q4_1":
        codes = _nibbles(b[..., 4:]).reshape(n, k)
        return GivenBlocks(codes, _f16(b[..., 0:2]), 4, 32, src, biases=_f16(b[..., 2:4]))
    if type_name == "Q8_0":
        q = np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(n, k)
        codes = (q.astype(np.int16) + 128).astype(np.uint8)
        return GivenBlocks(codes, _f16(b[..., 0:2]), 8, 32, src,
                           zero_points=_zp(n, k // 32, 128))
    if type_name == "Q5_0":  # 5-bit codes held as 8-bit ones: q - 16 + 128 (exact)
        codes = (_nibbles(b[..., 6:]) | (_fifth_bits(b[..., 2:6]) << np.uint8(4))) + np.uint8(112)
        return GivenBlocks(codes.reshape(n, k), _f16(b[..., 0:2]), 8, 32, src,
                           zero_points=_zp(n, k // 32, 128))
    if type_name == "Q5_1":  # 5-bit codes 0..31 held as 8-bit ones, d·q + m (exact)
        codes = _nibbles(b[..., 8:]) | (_fifth_bits(b[..., 4:8]) << np.uint8(4))
        return GivenBlocks(codes.reshape(n, k), _f16(b[..., 0:2]), 8, 32, src,
                           biases=_f16(b[..., 2:4]))
    if type_name == "IQ4_NL":
        return GivenBlocks(_iq4(_nibbles(b[..., 2:])).reshape(n, k), _f16(b[..., 0:2]), 8, 32,
                           src, zero_points=_zp(n, k // 32, 128))
    if type_name in _SUPER:
        return _SUPER[type_name](b, n, k, src)
    return _read_back(type_name, raw, b, n, k, src)


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes → 8 6-bit scales and 8 6-bit mins (gguf's `get_scale_min`)."""
    lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([lo & 63, (hi & 15) | ((lo >> 6) << 4)], axis=-1)  # [n, S, 8]
    mn = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _q4_k(b: np.ndarray, n: int, k: int, src: str) -> GivenBlocks:
    """Q4_K: 8 sub-blocks of 32 per super-block, each with its own float32 scale and bias."""
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])  # [n, S]
    sc, mn = _k_scales(b[..., 4:16])
    scales, biases = d[..., None] * sc, -(dmin[..., None] * mn)
    qs = b[..., 16:].reshape(n, -1, 4, 32)  # 4 chunks of 64 weights: 32 bytes each
    codes = np.stack([qs & np.uint8(15), qs >> np.uint8(4)], axis=3)  # [n, S, 4, 2, 32]
    return GivenBlocks(codes.reshape(n, k), scales.reshape(n, -1), 4, 32, src,
                       biases=biases.reshape(n, -1))


def _q5_k(b: np.ndarray, n: int, k: int, src: str) -> GivenBlocks:
    """Q5_K: Q4_K's sub-blocks and scales, a fifth bit per weight; 8-bit codes 0..31."""
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, mn = _k_scales(b[..., 4:16])
    scales, biases = d[..., None] * sc, -(dmin[..., None] * mn)
    qh, qs = b[..., 16:48], b[..., 48:].reshape(n, -1, 4, 32)
    low = np.stack([qs & np.uint8(15), qs >> np.uint8(4)], axis=3).reshape(n, -1, 8, 32)
    fifth = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & np.uint8(1)
    codes = low | (fifth << np.uint8(4))  # [n, S, 8, 32]
    return GivenBlocks(codes.reshape(n, k), scales.reshape(n, -1), 8, 32, src,
                       biases=biases.reshape(n, -1))


def _iq4_xs(b: np.ndarray, n: int, k: int, src: str) -> GivenBlocks:
    """IQ4_XS: 8 sub-blocks of 32, each scaled by d·(ls - 32), codes IQ4 levels + 128."""
    d = _f16(b[..., 0:2])
    high = np.ascontiguousarray(b[..., 2:4]).view("<u2")  # [n, S, 1]
    ls_high = (high >> (2 * np.arange(8, dtype=np.uint16))) & 3  # [n, S, 8]
    low = b[..., 4:8]
    ls_low = np.stack([low & np.uint8(15), low >> np.uint8(4)], axis=-1).reshape(n, -1, 8)
    ls = (ls_low | (ls_high.astype(np.uint8) << np.uint8(4))).astype(np.float32) - 32
    qs = b[..., 8:].reshape(n, -1, 8, 16)
    codes = _iq4(_nibbles(qs))  # [n, S, 8, 32]
    return GivenBlocks(codes.reshape(n, k), (d[..., None] * ls).reshape(n, -1), 8, 32, src,
                       zero_points=_zp(n, k // 32, 128))


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
                       8, 16, src, zero_points=_zp(n, k // 16, 32))


def _q3_k(b: np.ndarray, n: int, k: int, src: str) -> GivenBlocks:
    """Q3_K: 16 sub-blocks of 16, scale d·(sc - 32), codes low + 4·high (q + 4) in 4 bits
    with zero point 4 (gguf's `Q3_K.dequantize_blocks`, its unpacking order)."""
    hmask, qs, s = b[..., 0:32], b[..., 32:96], b[..., 96:108]
    d = _f16(b[..., 108:110])
    lsc = (s[..., None, 0:8] >> np.array([0, 4], np.uint8)[:, None]).reshape(n, -1, 16)
    hsc = (s[..., None, 8:12] >> np.array([0, 2, 4, 6], np.uint8)[:, None]).reshape(n, -1, 16)
    sc = ((lsc & np.uint8(15)) | ((hsc & np.uint8(3)) << np.uint8(4))).astype(np.float32) - 32
    low = (qs.reshape(n, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3
    high = (hmask.reshape(n, -1, 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]) & 1
    codes = low.reshape(n, -1, 16, 16) | (high.reshape(n, -1, 16, 16) << np.uint8(2))
    return GivenBlocks(codes.reshape(n, k).astype(np.uint8), (d[..., None] * sc).reshape(n, -1),
                       4, 16, src, zero_points=_zp(n, k // 16, 4))


def _q2_k(b: np.ndarray, n: int, k: int, src: str) -> GivenBlocks:
    """Q2_K: 16 sub-blocks of 16, scale d·sc and bias -(dmin·mn) (4 bits each per sub-block),
    2-bit codes held in 4 bits (gguf's `Q2_K.dequantize_blocks`, its unpacking order)."""
    s, qs = b[..., 0:16], b[..., 16:80]
    d, dmin = _f16(b[..., 80:82]), _f16(b[..., 82:84])
    scales = d[..., None] * (s & np.uint8(15)).astype(np.float32)
    biases = -(dmin[..., None] * (s >> np.uint8(4)).astype(np.float32))
    codes = (qs.reshape(n, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3
    return GivenBlocks(codes.reshape(n, k).astype(np.uint8), scales.reshape(n, -1), 4, 16, src,
                       biases=biases.reshape(n, -1))


def _f32(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float32)


def _iq2_step(d: np.ndarray, s: np.ndarray, n: int) -> np.ndarray:
    """IQ2_XS / IQ2_S: 16 4-bit scales (low nibble first), db = d·(0.5 + s)·0.25 per 16."""
    sc = np.stack([s & np.uint8(15), s >> np.uint8(4)], axis=-1).reshape(n, -1, 16)
    return d * (np.float32(0.5) + _f32(sc)) * np.float32(0.25)


def _steps(type_name: str, b: np.ndarray, n: int) -> np.ndarray:
    """The step of each sub-block [n, S, sub-blocks per block]: the float32 number gguf's
    dequantizer multiplies the type's integer levels by, computed as it computes it."""
    if type_name == "MXFP4":  # e8m0 exponent e: 2^(e - 127) / 2 (ggml_e8m0_to_fp32_half)
        e = b[..., 0:1].astype(np.uint32)
        bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - np.uint32(1)) << np.uint32(23))
        return bits.astype(np.uint32).view(np.float32)
    if type_name in ("TQ1_0", "TQ2_0"):  # one float16 d (the block's last two bytes) per 256
        return np.repeat(_f16(b[..., -2:])[..., None], 8, axis=-1)
    if type_name in ("IQ1_S", "IQ1_M"):  # dl = d·(2s + 1) per 32 (IQ1_M: per 16); the levels
        if type_name == "IQ1_S":  # g ± 1/8 are eighths, so the step is dl/8 (exact)
            d = _f16(b[..., 0:2])[..., None]
            s = np.ascontiguousarray(b[..., 34:50]).view("<u2") >> 12  # [n, S, 8]
        else:  # d's four nibbles are the tops of four 16-bit words; each holds 4 3-bit scales
            w = np.ascontiguousarray(b[..., 48:56]).view("<u2")  # [n, S, 4]
            top = (w & np.uint16(0xF000)) >> np.array([12, 8, 4, 0], np.uint16)
            d = (top[..., 0] | top[..., 1] | top[..., 2] | top[..., 3])[..., None]
            d = d.view(np.float16).astype(np.float32)
            s = (w[..., None] >> np.array([0, 3, 6, 9], np.uint16)).reshape(n, -1, 16)
        return d * _f32(2 * (s & 7) + 1) * np.float32(0.125)
    d = _f16(b[..., 0:2])[..., None]  # [n, S, 1]
    if type_name == "IQ2_XXS":  # the top 4 bits of every second 32-bit word
        ls = np.ascontiguousarray(b[..., 2:66]).view("<u4").reshape(n, -1, 8, 2)[..., 1] >> 28
        return d * (np.float32(0.5) + _f32(ls)) * np.float32(0.25)
    if type_name == "IQ2_XS":
        return _iq2_step(d, b[..., 66:74], n)
    if type_name == "IQ2_S":
        return _iq2_step(d, b[..., 74:82], n)
    if type_name == "IQ3_XXS":  # the top 4 bits of the 8 words after the grid indices
        ls = np.ascontiguousarray(b[..., 66:98]).view("<u4").reshape(n, -1, 8) >> 28
        return d * (np.float32(0.5) + _f32(ls)) * np.float32(0.5)
    # IQ3_S: 8 nibbles, low first
    s = b[..., 106:110]
    sc = np.stack([s & np.uint8(15), s >> np.uint8(4)], axis=-1).reshape(n, -1, 8)
    return d * _f32(1 + 2 * sc)


def _read_back(type_name: str, raw: np.ndarray, b: np.ndarray, n: int, k: int,
               src: str) -> GivenBlocks | None:
    """The grid, ternary and microscaled types: each sub-block is one step times small
    integers (grid values with signs, g ± 1/8 in eighths, -1..1, doubled E2M1 values), and
    gguf's dequantizer computes each weight as one float32 product of the step and the value.
    So the codes are the file's weights over the step (gguf's own step, `_steps`), + the
    zero point, taken only when they give the weights back bit for bit (None otherwise: the
    nearest format then)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    step = _steps(type_name, b, n)  # [n, S, m]
    bits, zp = _READ_BACK[type_name]
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):  # inf / NaN: None
        w = dequantize(raw.reshape(n, -1), GGMLQuantizationType[type_name])
        w = w.reshape(*step.shape, -1)
        q = np.where(step[..., None] == 0, 0, np.rint(w / step[..., None]))
    if not np.isfinite(q).all() or q.min(initial=0) < -zp or q.max(initial=0) >= 2 ** bits - zp:
        return None
    block = k // (step.shape[1] * step.shape[2])
    given = GivenBlocks((q + zp).astype(np.uint8).reshape(n, k), step.reshape(n, -1), bits,
                        block, src, zero_points=_zp(n, k // block, zp))
    return given if np.array_equal(given.dequantize(), w.reshape(n, k)) else None


# the read-back types' stored form: bits per code, zero point
_READ_BACK = {"IQ2_XXS": (8, 128), "IQ3_XXS": (8, 128), "IQ3_S": (8, 128), "IQ2_XS": (8, 128),
              "IQ2_S": (8, 128), "IQ1_S": (8, 128), "IQ1_M": (8, 128), "TQ1_0": (4, 1),
              "TQ2_0": (4, 1), "MXFP4": (8, 128)}


_SUPER = {"Q4_K": _q4_k, "Q5_K": _q5_k, "IQ4_XS": _iq4_xs, "Q6_K": _q6_k, "Q3_K": _q3_k,
          "Q2_K": _q2_k}
