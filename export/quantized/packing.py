"""AWQ's and GPTQ's packed 4-bit tensors read into fuselm's given blocks (fuselm/given_blocks.py).

Both store, per linear layer with weight W [N, K] (N outputs, K inputs) in groups of G inputs,

    W[n, k] = (q[k, n] - z[k // G, n]) * s[k // G, n]        s: float16 `scales` [K/G, N]

with 4-bit codes q and 4-bit zero points z packed eight to an int32, lowest nibble first:

    AWQ (AutoAWQ GEMM)  qweight [K, N/8]: packed along N, nibble i of word j holding column
                        8j + [0, 2, 4, 6, 1, 3, 5, 7][i]; qzeros [K/G, N/8] the same way
    GPTQ                qweight [K/8, N]: packed along K, nibble i of word r holding row 8r + i;
                        qzeros [K/G, N/8]: packed along N, nibble i holding column 8j + i; in
                        the v1 format (AutoGPTQ's `checkpoint_format: gptq`) each stored zero
                        point is z - 1, kept to 4 bits: z = (stored + 1) & 15
                        g_idx [K]: the group of each input channel

This is fuselm's own stored form (integer zero points, scales exactly as given), so the
codes, scales and zero points are only re-laid out — transposed to [N, K] — never rounded.
GPTQ's act-order (`desc_act`) can store a g_idx other than k // G, grouping input channels
that are not adjacent; fuselm's blocks are runs of adjacent channels, so such a layer has no
blocks here (keeping its groups would need the activations permuted in the graph): the
checkpoint (export/quantized/checkpoint.py) refuses it or reads it dequantized.
"""

from __future__ import annotations

import numpy as np

from fuselm.given_blocks import GivenBlocks

AWQ_ORDER = np.array([0, 2, 4, 6, 1, 3, 5, 7])  # column (within 8) of nibble i


def nibbles(packed: np.ndarray) -> np.ndarray:
    """int32 [..., M] → uint8 [..., 8M]: nibble i of word m at 8m + i. Read through the words'
    little-endian bytes (the safetensors byte order): byte j holds nibbles 2j (low) and
    2j + 1 (high), so no wider intermediate is made."""
    by = np.ascontiguousarray(packed).view(np.uint8)  # [..., 4M]
    out = np.empty((*by.shape, 2), np.uint8)
    out[..., 0] = by & np.uint8(15)
    out[..., 1] = by >> np.uint8(4)
    return out.reshape(*by.shape[:-1], -1)


def along_n_transposed(packed: np.ndarray, order: np.ndarray | None = None) -> np.ndarray:
    """int32 [R, N/8] packed along N → uint8 [N, R] (the values of column n in row n);
    `order`: the column (within 8) of each nibble. The words are transposed (4 bytes each),
    not the codes: a uint8 transpose of a large layer costs several times more."""
    words = np.ascontiguousarray(np.ascontiguousarray(packed).view(np.uint32).T)  # [N/8, R]
    out = np.empty((words.shape[0], 8, words.shape[1]), np.uint8)
    for i, c in enumerate(range(8) if order is None else order):
        out[:, c, :] = (words >> np.uint32(4 * i)) & np.uint32(15)
    return out.reshape(-1, words.shape[1])


def trivial_groups(g_idx: np.ndarray, group: int) -> bool:
    """Whether g_idx puts input channel k in group k // G (no act-order reordering)."""
    return bool(np.array_equal(g_idx, np.arange(len(g_idx)) // group))


def awq_blocks(qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray,
               group: int) -> GivenBlocks:
    return GivenBlocks(along_n_transposed(qweight, AWQ_ORDER), np.ascontiguousarray(
        scales.astype(np.float32).T), 4, group, "awq",
        zero_points=along_n_transposed(qzeros, AWQ_ORDER))


def gptq_blocks(qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray, group: int,
                zeros_minus_one: bool) -> GivenBlocks:
    codes = nibbles(qweight.T)  # [N, K]: row 8r + i in nibble i (4-byte words transposed)
    zeros = along_n_transposed(qzeros)  # [N, K/G]
    if zeros_minus_one:
        zeros = (zeros + np.uint8(1)) & np.uint8(15)
    return GivenBlocks(codes, np.ascontiguousarray(scales.astype(np.float32).T), 4, group,
                       "gptq", zero_points=zeros)
