"""GGUF blocks read as given blocks (export/gguf/blocks.py): codes, scales and biases are the
file's own, bit for bit, and dequantize to exactly what gguf's own dequantizer gives."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from fuselm.export.gguf.blocks import given_blocks
from fuselm.given_blocks import GivenBlocks
from tests.export.gguf_files import k_quant_bytes


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


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_given_blocks_dequantize_to_ggufs_own_values(kind: str) -> None:
    qtype = GGMLQuantizationType[kind]
    w = _weights()
    raw = (k_quant_bytes(*w.shape, kind, np.random.default_rng(1)) if kind.endswith("_K")
           else quantize(w, qtype))
    g = given_blocks(kind, raw.reshape(-1), w.shape)
    assert g is not None and g.bits == (8 if kind in ("Q8_0", "Q6_K") else 4)
    assert g.block_size == (16 if kind == "Q6_K" else 32)
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
    q8 = given_blocks("Q8_0", quantize(w, GGMLQuantizationType.Q8_0).reshape(-1), w.shape)
    assert GivenBlocks.concat([g, q8]) is None  # 4 and 8 bits cannot share one tensor


def test_types_without_an_exact_form_give_none() -> None:
    raw = k_quant_bytes(8, 256, "Q5_K", np.random.default_rng(0))
    assert given_blocks("Q5_K", raw.reshape(-1), (8, 256)) is None
