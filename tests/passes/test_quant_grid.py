"""Weights already on a grid come back exactly (passes/quant/grid_steps.py through the 4-bit
search and the 6- and 8-bit blocks), 6-bit blocks against their written-out formula, and
`--quant mixed`'s 4/6/8-bit choice under a bits budget (passes/quant/q4_allocate.choose_bits)."""

from __future__ import annotations

import numpy as np
import pytest

from fuselm.passes.quant.q4_allocate import choose_bits, mixed_bits_per_weight
from fuselm.passes.quant.q4_math import quantize_array
from fuselm.passes.quant.q8_math import quantize_wide


def _grid(codes: np.ndarray, rng: np.random.Generator, block: int = 32) -> np.ndarray:
    """codes * d with one float16 step d per block of `block` rows and column."""
    k, n = codes.shape
    d = rng.uniform(2e-4, 4e-3, (k // block, n)).astype(np.float16).astype(np.float32)
    return (codes * np.repeat(d, block, axis=0)).astype(np.float32)


@pytest.mark.parametrize("symmetric", [False, True])
def test_a_block_on_a_reduced_4_bit_grid_comes_back_exactly(symmetric: bool) -> None:
    """Codes -3..7 (11 levels, 0 among them): min/max's step (hi - lo) / 15 rounds them off the
    grid; the search finds the grid's own step."""
    rng = np.random.default_rng(0)
    codes = rng.integers(-3, 8, (96, 24))
    codes[0::32], codes[1::32] = -3, 7  # both ends in every block
    if symmetric:
        codes = np.clip(codes, -7, 5)
    w = _grid(codes, rng)
    q = quantize_array(w, 32, symmetric)
    assert np.array_equal(q.dequantize(np.float32), w)
    assert q.rel_rms_error == 0
    assert quantize_array(w, 32, symmetric, grid=False).rel_rms_error > 0.01
    assert quantize_array(w, 32, symmetric, method="minmax").rel_rms_error > 0.01


def test_8_bit_blocks_recover_q5_0_and_q8_0_grids() -> None:
    """llama.cpp's Q5_0 (d * (q - 16), q in 0..31, d = max / -16) and Q8_0 (d * q, |q| <= 127)
    dequantized: 8-bit blocks store them exactly, where min/max's 255 steps do not."""
    rng = np.random.default_rng(1)
    q5 = rng.integers(0, 32, (128, 40))
    q5[::32] = 0  # the -16 end, as Q5_0's d = max / -16 puts the largest weight there
    q8 = rng.integers(-127, 128, (128, 40))
    q8[::32] = 127
    for w in (_grid(q5 - 16, rng), _grid(q8, rng)):
        q = quantize_wide(w, 32)
        assert np.array_equal(q.dequantize(np.float32), w)
        assert quantize_wide(w, 32, grid=False).rel_rms_error > 1e-4


def test_8_bit_grid_search_is_never_worse_than_min_max_on_any_block() -> None:
    rng = np.random.default_rng(2)
    w = (rng.standard_t(3, (160, 48)) * 0.02).astype(np.float32)
    w[:, :8] = _grid(rng.integers(-20, 9, (160, 8)), rng)  # some on a grid, the rest not
    w[:32, 8] = 0.0  # an all-zero block

    def sse(q: object) -> np.ndarray:
        d = (q.dequantize(np.float32).astype(np.float64) - w) ** 2  # type: ignore[attr-defined]
        return d.reshape(-1, 32, w.shape[1]).sum(axis=1)

    grid, plain = sse(quantize_wide(w, 32)), sse(quantize_wide(w, 32, grid=False))
    assert (grid <= plain * (1 + 1e-6) + 1e-30).all()
    assert grid[:, :8].max() == 0 and grid[0, 8] == 0


def _items(ws: dict[str, np.ndarray]) -> list:
    return [(n, lambda w=w: w, None) for n, w in ws.items()]


def test_mixed_choice_respects_the_budget_and_prefers_the_most_sensitive() -> None:
    """Four tensors of equal size: three Gaussian, one with an outlier in every block (which
    stretches its 4-bit step: the largest relative error, the most to gain from more bits). A
    budget with room for one tensor's first upgrade (to 6-bit blocks of 128) puts that one
    there; the mean bits never exceed the budget; the largest budget puts every tensor in
    8-bit blocks of 32."""
    rng = np.random.default_rng(3)
    ws = {f"g{i}": rng.standard_normal((128, 64)).astype(np.float32) for i in range(3)}
    ws["heavy"] = rng.standard_normal((128, 64)).astype(np.float32)
    ws["heavy"][::32] = 8.0
    four, six128 = mixed_bits_per_weight(4, 32), mixed_bits_per_weight(6, 128)

    def mean_bits(plan: dict[str, tuple[int, int]]) -> float:
        return sum(mixed_bits_per_weight(*plan[n]) for n in ws) / len(ws)

    assert set(choose_bits(_items(ws), four, 32).values()) == {(4, 32)}
    one = four + (six128 - four) / 4  # exactly one tensor's upgrade to 6-bit blocks of 128
    plan = choose_bits(_items(ws), one + 1e-9, 32)
    assert plan["heavy"] == (6, 128) and all(plan[f"g{i}"] == (4, 32) for i in range(3))
    for budget in (4.9, 5.5, 6.4, 7.3, 8.0, 8.6):
        plan = choose_bits(_items(ws), budget, 32)
        assert mean_bits(plan) <= budget
        assert plan["heavy"][0] > 4 or budget < one
    assert set(choose_bits(_items(ws), mixed_bits_per_weight(8, 32), 32).values()) == {(8, 32)}
    assert choose_bits(_items(ws), 6.0, 32) == choose_bits(_items(ws), 6.0, 32)  # deterministic


def test_mixed_choice_counts_each_tensor_not_each_weight() -> None:
    """Of two tensors, a big one with the larger relative error drop and one 16x smaller: the
    small one's upgrade gains more per bit of the model, so under a budget that holds the big
    one's first upgrade alone but not with the small one's, the small one takes more bits."""
    rng = np.random.default_rng(4)
    ws = {"small": rng.standard_normal((64, 32)).astype(np.float32),
          "big": rng.standard_normal((64, 512)).astype(np.float32)}
    ws["big"][::32] = 8.0  # outliers: the big tensor's 4-bit relative error is the larger
    size = {n: w.size for n, w in ws.items()}
    four = mixed_bits_per_weight(4, 32)
    up = {n: size[n] * (mixed_bits_per_weight(6, 128) - four) for n in ws}  # its first upgrade
    budget = (four * sum(size.values()) + up["big"] + 1) / sum(size.values())
    plan = choose_bits(_items(ws), budget, 32)
    assert plan["small"][0] > 4 and plan["big"] == (4, 32)


def _minmax_6bit(w: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The asymmetric min/max formula with 63 steps, written out block by block and column by
    column: (codes, float16 scales, zero points)."""
    k, n = w.shape
    codes = np.empty((k, n), np.uint8)
    scales = np.empty((k // block, n), np.float16)
    zps = np.empty((k // block, n), np.uint8)
    for b in range(k // block):
        for j in range(n):
            x = w[b * block:(b + 1) * block, j]
            lo, hi = min(float(x.min()), 0.0), max(float(x.max()), 0.0)
            s = np.float16(np.float32(hi - lo) / np.float32(63))
            s32 = np.float32(s)
            zp = 0 if s32 == 0 else int(np.clip(np.rint(np.float32(-lo) / s32), 0, 63))
            q = np.full(block, zp) if s32 == 0 else np.clip(np.rint(x / s32) + zp, 0, 63)
            codes[b * block:(b + 1) * block, j], scales[b, j], zps[b, j] = q, s, zp
    return codes, scales, zps


def test_6_bit_blocks_round_trip_against_the_written_out_formula() -> None:
    """6-bit blocks (`--quant mixed`'s middle width): min/max's codes, scales and zero points
    are the formula's with 63 steps, every code below 64; dequantized, each weight is within
    half a step of its value; the error is ~1/4 of 4-bit's and ~4x 8-bit's; the packed form
    (passes/ops.py, four codes in three bytes) unpacks to the same codes."""
    from fuselm.passes.ops import pack_uint6, unpack_uint6_reference

    rng = np.random.default_rng(6)
    w = (rng.standard_normal((128, 40)) * 0.05).astype(np.float32)
    w[:32, 0] = 0.0  # an all-zero block: scale 0, exact zeros
    q = quantize_wide(w, 32, grid=False, bits=6)
    codes, scales, zps = _minmax_6bit(w, 32)
    assert np.array_equal(q.codes, codes) and np.array_equal(q.scales, scales)
    assert np.array_equal(q.zero_points, zps) and int(q.codes.max()) < 64
    back = q.dequantize(np.float32)
    step = np.repeat(scales.astype(np.float32), 32, axis=0)
    assert np.array_equal(back, (codes.astype(np.float32) - np.repeat(zps, 32, axis=0)) * step)
    assert (np.abs(back - w) <= step / 2 * (1 + 1e-6)).all() and not back[:32, 0].any()
    e4 = quantize_array(w, 32, method="minmax").rel_rms_error
    e8 = quantize_wide(w, 32, grid=False).rel_rms_error
    assert e4 is not None and e8 is not None and q.rel_rms_error is not None
    assert 2.5 < e4 / q.rel_rms_error < 6 and 2.5 < q.rel_rms_error / e8 < 6
    packed = pack_uint6(q.codes)
    assert packed.shape == (96, 40) and packed.dtype == np.uint8
    assert np.array_equal(unpack_uint6_reference(packed), q.codes)


def test_6_bit_blocks_recover_q5_0_grids() -> None:
    """llama.cpp's Q5_0 dequantized (32 levels, d * (q - 16)): 6-bit blocks store it exactly
    with the grid steps, where min/max's 63 steps round it off; symmetric too (zero point 32)."""
    rng = np.random.default_rng(7)
    q5 = rng.integers(0, 32, (128, 40))
    q5[::32] = 0
    w = _grid(q5 - 16, rng)
    for symmetric in (False, True):
        q = quantize_wide(w, 32, symmetric, bits=6)
        assert np.array_equal(q.dequantize(np.float32), w) and q.rel_rms_error == 0
        assert quantize_wide(w, 32, symmetric, grid=False, bits=6).rel_rms_error > 1e-3
    assert set(np.unique(quantize_wide(w, 32, True, bits=6).zero_points)) == {32}


def test_mixed_choice_takes_6_bits_where_they_are_the_best_error_per_bit() -> None:
    """Gaussian tensors gain most per bit from 4 to 6 bits (1/16 of the squared error for 2.2
    bits): a budget of every tensor in 6-bit blocks of 128 puts each there. A tensor on a Q5_0
    grid is exact at 6 bits, so 8 bits gain it nothing: even the largest budget leaves it at 6
    while the others go to 8-bit blocks of 32. A tensor named in `no_six` (an untied table)
    goes from 4 bits straight to 8. Every plan's mean stays within its budget."""
    rng = np.random.default_rng(8)
    ws = {f"g{i}": rng.standard_normal((128, 64)).astype(np.float32) for i in range(3)}
    q5 = rng.integers(0, 32, (128, 64))
    q5[::32] = 0
    ws["q5"] = _grid(q5 - 16, rng)
    six128 = mixed_bits_per_weight(6, 128)
    assert six128 == 6 + 24 / 128 and mixed_bits_per_weight(4, 32) == 4 + 20 / 32

    def mean_bits(plan: dict[str, tuple[int, int]]) -> float:
        return sum(mixed_bits_per_weight(*plan[n]) for n in ws) / len(ws)

    assert set(choose_bits(_items(ws), six128 + 1e-9, 32).values()) == {(6, 128)}
    top = choose_bits(_items(ws), mixed_bits_per_weight(8, 32), 32)
    assert top["q5"][0] == 6 and all(top[f"g{i}"] == (8, 32) for i in range(3))
    for budget in (5.1, 5.9, 6.4, 7.0, 7.8):
        plan = choose_bits(_items(ws), budget, 32)
        assert mean_bits(plan) <= budget
        assert 6 in {b for b, _ in plan.values()}
        held = choose_bits(_items(ws), budget, 32, no_six=frozenset({"g0"}))
        assert held["g0"][0] in (4, 8) and mean_bits(held) <= budget
