"""GGUF blocks read as given blocks (export/gguf/blocks.py): codes, scales and biases are the
file's own, bit for bit, and dequantize to exactly what gguf's own dequantizer gives."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from fuselm.export.gguf.blocks import EXACT_TYPES, given_blocks
from fuselm.given_blocks import GivenBlocks
from tests.export.gguf_files import RANDOM, random_blocks


def _weights(n: int = 8, k: int = 256) -> np.ndarray:
    return np.random.default_rng(0).standard_normal((n, k)).astype(np.float32) * 0.05


def test_q4_1_round_trips_bit_exactly_into_codes_scales_and_mins() -> None:
    w = _weights()
    raw = quantize(w, GGMLQuantizationType.Q4_1)  # [8, 8 blocks * 20 bytes]
    g = given_blocks("Q4_1", raw.reshape(-1), w.shape)
    assert g is not None and g.bits == 4 and g.block_size == 32 and g.affine
    blocks = raw.reshape(8, 8, 20)
    # d and m are the file's float16 values; codes its nibbles (low nibble = weight i,
    # high nibble = weight i + 16 of the block)
    np.testing.assert_array_equal(g.scales, blocks[..., 0:2].copy().view(np.float16)[..., 0])
    np.testing.assert_array_equal(g.biases, blocks[..., 2:4].copy().view(np.float16)[..., 0])
    qs = blocks[..., 4:]
    codes = g.codes.reshape(8, 8, 32)
    np.testing.assert_array_equal(codes[..., :16], qs & 15)
    np.testing.assert_array_equal(codes[..., 16:], qs >> 4)
    # and packed back the same way, the bytes are the file's
    again = np.concatenate([
        g.scales.astype(np.float16).view(np.uint8).reshape(8, 8, 2),
        g.biases.astype(np.float16).view(np.uint8).reshape(8, 8, 2),
        (codes[..., :16] | (codes[..., 16:] << 4)).astype(np.uint8)], axis=-1)
    np.testing.assert_array_equal(again.reshape(raw.shape), raw)


# type -> (bits, block size) of its stored form
FORMS = {"Q4_0": (4, 32), "Q4_1": (4, 32), "Q8_0": (8, 32), "Q5_0": (8, 32), "Q5_1": (8, 32),
         "IQ4_NL": (8, 32), "Q4_K": (4, 32), "Q5_K": (8, 32), "IQ4_XS": (8, 32),
         "Q6_K": (8, 16), "Q3_K": (4, 16), "Q2_K": (4, 16), "IQ2_XXS": (8, 32),
         "IQ3_XXS": (8, 32), "IQ3_S": (8, 32), "IQ2_XS": (8, 16), "IQ2_S": (8, 16),
         "IQ1_S": (8, 32), "IQ1_M": (8, 16), "TQ1_0": (4, 32), "TQ2_0": (4, 32),
         "MXFP4": (8, 32)}


def test_every_exact_type_is_covered() -> None:
    assert set(FORMS) == set(EXACT_TYPES)


@pytest.mark.parametrize("kind", list(FORMS))
def test_given_blocks_dequantize_to_ggufs_own_values(kind: str) -> None:
    qtype = GGMLQuantizationType[kind]
    w = _weights()
    raw = (random_blocks(*w.shape, kind, np.random.default_rng(1)) if kind in RANDOM
           else quantize(w, qtype))
    g = given_blocks(kind, raw.reshape(-1), w.shape)
    assert g is not None and (g.bits, g.block_size) == FORMS[kind]
    assert g.codes.max() < 2 ** g.bits
    np.testing.assert_array_equal(g.dequantize(), dequantize(raw, qtype))


def test_rows_and_concatenation_keep_blocks() -> None:
    w = _weights()
    raw = quantize(w, GGMLQuantizationType.Q4_1)
    g = given_blocks("Q4_1", raw.reshape(-1), w.shape)
    assert g is not None
    rows = np.array([3, 1, 2, 0, 7, 6, 5, 4])
    np.testing.assert_array_equal(g.take_rows(rows).dequantize(), g.dequantize()[rows])
    both = GivenBlocks.concat([g, g.take_rows(slice(0, 3))])
    assert both is not None and both.shape == (11, 256)
    np.testing.assert_array_equal(both.dequantize()[8:], g.dequantize()[:3])


def _raw(kind: str, w: np.ndarray) -> np.ndarray:
    return (random_blocks(*w.shape, kind, np.random.default_rng(1)) if kind in RANDOM
            else quantize(w, GGMLQuantizationType[kind]))


def _given(kind: str, raw: np.ndarray, shape: tuple[int, int]) -> GivenBlocks:
    g = given_blocks(kind, raw.reshape(-1), shape)
    assert g is not None
    return g


# llama.cpp's mixes give v more bits than q/k: a packed projection's parts in different forms
@pytest.mark.parametrize("kinds", [("Q4_0", "Q5_0"), ("Q5_1", "Q8_0"), ("Q4_K", "Q6_K"),
                                   ("Q3_K", "Q4_1", "IQ4_NL")])
def test_parts_in_different_forms_stack_in_one_that_holds_each(kinds: tuple[str, ...]) -> None:
    """The most bits, the smallest block, float biases when a part has them: zero-point parts
    alone stack exactly (a 4-bit code is an 8-bit one); a zero point turned into a bias gives
    the same weights to float32 rounding."""
    w = _weights()
    raws = [_raw(kind, w) for kind in kinds]
    parts = [_given(kind, raw, w.shape) for kind, raw in zip(kinds, raws, strict=True)]
    both = GivenBlocks.concat(parts)
    assert both is not None and both.shape == (8 * len(kinds), 256)
    assert both.bits == max(p.bits for p in parts)
    assert both.block_size == min(p.block_size for p in parts)
    assert both.source == "+".join(sorted(f"gguf {k}" for k in kinds))
    want = np.concatenate([dequantize(raw, GGMLQuantizationType[k])
                           for k, raw in zip(kinds, raws, strict=True)])
    if not any(p.affine for p in parts):
        np.testing.assert_array_equal(both.dequantize(), want)
    else:
        assert both.affine
        assert np.abs(both.dequantize() - want).max() <= 1e-6 * np.abs(want).max()


# the byte offset of each type's scale, and a value it cannot hold as a step of finite weights:
# float16 inf / NaN (d), an e8m0 exponent whose weights overflow float32
BROKEN = {"TQ2_0": (64, b"\x00\x7c"), "IQ1_S": (0, b"\x00\x7e"), "MXFP4": (0, b"\xfe")}


@pytest.mark.parametrize("kind", list(BROKEN))
def test_blocks_that_do_not_give_ggufs_weights_back_give_none(kind: str) -> None:
    """The read-back types keep a tensor only when every block reproduces gguf's weights bit
    for bit; one block that does not sends the whole tensor to the nearest format (None)."""
    raw = _raw(kind, _weights())
    assert given_blocks(kind, raw.reshape(-1), (8, 256)) is not None
    at, value = BROKEN[kind]
    blocks = raw.reshape(-1, raw.size // (8 * (256 // _per(kind))))
    blocks[3, at:at + len(value)] = np.frombuffer(value, np.uint8)
    assert given_blocks(kind, raw.reshape(-1), (8, 256)) is None


def _per(kind: str) -> int:
    return 32 if kind == "MXFP4" else 256


def test_mxfp4_blocks_of_every_finite_exponent_are_kept() -> None:
    """MXFP4's scale is 2^(e - 128) from its e8m0 byte, subnormal float32 for e < 2: blocks of
    every exponent whose weights stay finite (e <= 250) and random nibbles, bit for bit."""
    rng = np.random.default_rng(2)
    blocks = rng.integers(0, 256, size=(256, 17), dtype=np.uint8)
    blocks[:, 0] = np.arange(256) % 251
    raw = blocks.reshape(8, -1)
    g = _given("MXFP4", raw, (8, 1024))
    np.testing.assert_array_equal(g.dequantize(), dequantize(raw, GGMLQuantizationType.MXFP4))
