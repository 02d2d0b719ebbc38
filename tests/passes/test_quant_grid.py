"""Weights already on a grid come back exactly (passes/quant/grid_steps.py through the 4-bit
search and the 8-bit blocks), and `--quant mixed`'s 4/8-bit choice under a bits budget
(passes/quant/q4_allocate.choose_bits)."""

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
    stretches its 4-bit step: the largest relative error, the most to gain from 8 bits). A
    budget with room for one tensor at 8 bits puts that one there; the mean bits never exceed
    the budget; the largest budget puts every tensor in 8-bit blocks of 32."""
    rng = np.random.default_rng(3)
    ws = {f"g{i}": rng.standard_normal((128, 64)).astype(np.float32) for i in range(3)}
    ws["heavy"] = rng.standard_normal((128, 64)).astype(np.float32)
    ws["heavy"][::32] = 8.0
    four, eight128 = mixed_bits_per_weight(4, 32), mixed_bits_per_weight(8, 128)

    def mean_bits(plan: dict[str, tuple[int, int]]) -> float:
        return sum(mixed_bits_per_weight(*plan[n]) for n in ws) / len(ws)

    assert set(choose_bits(_items(ws), four, 32).values()) == {(4, 32)}
    one = four + (eight128 - four) / 4  # exactly one tensor's upgrade to 8-bit blocks of 128
    plan = choose_bits(_items(ws), one + 1e-9, 32)
    assert plan["heavy"] == (8, 128) and all(plan[f"g{i}"] == (4, 32) for i in range(3))
    for budget in (4.9, 5.5, 6.4, 7.3, 8.0, 8.6):
        plan = choose_bits(_items(ws), budget, 32)
        assert mean_bits(plan) <= budget
        assert plan["heavy"][0] == 8 or budget < one
    assert set(choose_bits(_items(ws), mixed_bits_per_weight(8, 32), 32).values()) == {(8, 32)}
    assert choose_bits(_items(ws), 6.0, 32) == choose_bits(_items(ws), 6.0, 32)  # deterministic


def test_mixed_choice_counts_each_tensor_not_each_weight() -> None:
    """Of two tensors, a big one with the larger relative error drop and one 16x smaller: the
    small one's upgrade gains more per bit of the model, so under a budget that holds either
    upgrade alone but not both, the small one takes 8 bits."""
    rng = np.random.default_rng(4)
    ws = {"small": rng.standard_normal((64, 32)).astype(np.float32),
          "big": rng.standard_normal((64, 512)).astype(np.float32)}
    ws["big"][::32] = 8.0  # outliers: the big tensor's 4-bit relative error is the larger
    size = {n: w.size for n, w in ws.items()}
    four = mixed_bits_per_weight(4, 32)
    up = {n: size[n] * (mixed_bits_per_weight(8, 64) - four) for n in ws}  # 8-bit blocks of 64
    budget = (four * sum(size.values()) + up["big"] + 1) / sum(size.values())
    plan = choose_bits(_items(ws), budget, 32)
    assert plan["small"][0] == 8 and plan["big"] == (4, 32)
