"""The fused CUDA decode attention over an 8-bit KV cache (cuda_kernels/sources.py's `_Q8_CACHE`
form of the split kernel) against the plain path it replaces: attention.Attention.over_cache
over the same quantized buffers (the new rows rotated and quantized by mx.quantize, the cache
read dequantized), and the decode program's choice of it.

The kernel tests need MLX's CUDA backend (test_kernels.py's `cuda` mark: reported as skipped
elsewhere); the choice of the kernel (which launches a decode step makes, with what inputs) is
tested everywhere through the recorded launches."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from fuselm.config import RuntimeConfig
from fuselm.passes.ops import fused_rope_reference
from fuselm.runtime_metal.cuda_kernels import selection as kernels
from fuselm.runtime_metal.kv_cache import (
    BLOCK,
    KEY_GROUP,
    KEY_TAIL,
    BlockIndex,
    KVQuant,
    key_blocks_zeros,
    key_groups_zeros,
    write_key_groups,
)
from fuselm.runtime_metal.validate import rel
from tests.runtime.conftest import convert, joined_rows_equal_generate
from tests.runtime.test_kernels import TOL, cuda, rounded

# ---- everywhere: which caches the kernel takes, and that the decode step launches it ----------


def _q8(lead: tuple[int, ...], d: int, group: int, dtype: mx.Dtype) -> tuple[mx.array, ...]:
    return KVQuant(8, group).zeros(lead, d, dtype)


@pytest.fixture
def kv_attn_on() -> Iterator[None]:
    """FUSELM_KV_ATTN=on for the test (the quantized forms are off by default), then the
    process's setting as it was."""
    was = kernels.kv_attn()
    kernels.use_kv_attn("on")
    yield
    kernels.use_kv_attn("on" if was else "off")


def test_quantized_caches_take_the_kernel_only_when_asked() -> None:
    """By default (FUSELM_KV_ATTN=auto) the fused attention takes float caches only: an 8-bit
    or 4-bit cache that its forms would fit runs MLX's ops until they are measured on a GPU
    (selection.QUANT_KV_ATTN); `on` takes them, `off` refuses them."""
    f16, d, hq, hk = mx.float16, 64, 4, 2
    q, kv = mx.zeros((2, 1, hq * d), f16), mx.zeros((2, 1, hk * d), f16)
    c8 = _q8((2, hk, 256), d, 32, f16)
    keys4 = key_groups_zeros((2, hk), 256, d, f16)
    values4 = KVQuant(4, 32).zeros((2, hk, 256), d, f16)
    plain = mx.zeros((2, hk, 256, d), f16)
    was = kernels.kv_attn()
    try:
        for setting, quantized in (("auto", kernels.QUANT_KV_ATTN), ("on", True), ("off", False)):
            kernels.configure(RuntimeConfig(kv_attn=setting))
            for keys, values in ((c8, c8), (keys4, values4)):
                assert kernels.rope_attend_fits(q, kv, kv, (None, None), keys, values, hq, hk,
                                                d, d) == quantized
            assert kernels.rope_attend_fits(q, kv, kv, (None, None), plain, plain, hq, hk, d, d)
        assert not kernels.QUANT_KV_ATTN  # off until the GPU tests below have run on a GPU
    finally:
        kernels.use_kv_attn("on" if was else "off")


def test_fits_takes_eight_and_four_bit_caches(kv_attn_on: None) -> None:
    """With FUSELM_KV_ATTN=on: 8-bit triples (every group size, contiguous or block pools)
    fit, and 4-bit caches (per-channel keys with 4-bit values, contiguous, or block pools
    with the rows' tail slots);
    4-bit keys per token, a pool without tail slots, a float/8-bit mix, scales of another
    dtype than the activations and a head whose lanes' values straddle groups or code words
    (D 96: 3 a lane) do not."""
    f16 = mx.float16
    d, hq, hk = 128, 8, 2
    q, kv = mx.zeros((2, 1, hq * d), f16), mx.zeros((2, 1, hk * d), f16)

    def fits(keys: object, values: object, table: mx.array | None = None, dim: int = d,
             qq: mx.array = q, kk: mx.array = kv) -> bool:
        return kernels.rope_attend_fits(qq, kk, kk, (None, None), keys, values, hq, hk,  # type: ignore[arg-type]
                                        dim, dim, table)

    for group in (32, 64, 128):
        c = _q8((2, hk, 256), d, group, f16)
        assert fits(c, c)
        pool = _q8((9, hk, BLOCK), d, group, f16)
        assert fits(pool, pool, mx.zeros((2, 4), mx.int32))
    c = _q8((2, hk, 256), d, 64, f16)
    four = KVQuant(4, 32)
    assert not fits(four.zeros((2, hk, 256), d, f16), four.zeros((2, hk, 256), d, f16))
    keys4 = key_groups_zeros((2, hk), 256, d, f16)
    for group in (32, 64, 128):
        assert fits(keys4, KVQuant(4, group).zeros((2, hk, 256), d, f16))
    table, tails = mx.zeros((2, 4), mx.int32), mx.zeros((2,), mx.int32)
    pool4 = key_blocks_zeros(9, 3, hk, d, f16)
    values4 = four.zeros((9, hk, BLOCK), d, f16)

    def fits4(keys: object, values: object, table: mx.array | None,
              tails: mx.array | None) -> bool:
        return kernels.rope_attend_fits(q, kv, kv, (None, None), keys, values, hq, hk,  # type: ignore[arg-type]
                                        d, d, table, tails)
    assert fits4(pool4, values4, table, tails)
    assert not fits4(pool4, values4, table, None)
    assert not fits4(pool4, values4, None, None)
    assert not fits4(keys4, four.zeros((2, hk, 256), d, mx.bfloat16), None, None)
    assert not fits4(keys4, c, None, None)  # 8-bit values
    assert not fits4(key_groups_zeros((2, hk), 512, d, f16), four.zeros((2, hk, 256), d, f16),
                     None, None)  # keys of another capacity
    odd4 = key_groups_zeros((2, hk), 256, 96, f16)
    assert not kernels.rope_attend_fits(
        mx.zeros((2, 1, hq * 96), f16), mx.zeros((2, 1, hk * 96), f16),
        mx.zeros((2, 1, hk * 96), f16), (None, None), odd4, four.zeros((2, hk, 256), 96, f16),
        hq, hk, 96, 96)
    assert not fits(c, mx.zeros((2, hk, 256, d), f16))
    assert not fits(c, _q8((2, hk, 256), d, 32, f16))  # keys and values of other groups
    b16 = _q8((2, hk, 256), d, 64, mx.bfloat16)
    assert not fits(b16, b16)
    odd = _q8((2, hk, 256), 96, 32, f16)
    assert not fits(odd, odd, dim=96, qq=mx.zeros((2, 1, hq * 96), f16),
                    kk=mx.zeros((2, 1, hk * 96), f16))


def _small_qwen3(tmp_path: Path) -> Path:
    from fuselm.converter.models.builtin import build_model

    hf = build_model(tmp_path / "hf", "qwen3", seed=5, hidden_size=96, head_dim=64,
                     num_attention_heads=4, num_key_value_heads=2)
    return convert(hf, tmp_path / "out")


def test_decode_step_launches_the_quantized_kernels(tmp_path: Path, launches: list,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Everywhere (launches recorded, none run): with the kernels and FUSELM_KV_ATTN on,
    generate's decode steps and the batch decoder's over an 8-bit cache launch the 8-bit
    attention kernel, one a layer,
    taking each layer's codes, scales and biases (the block table too in the batch); over a
    4-bit cache, the steps that complete no key group launch the 4-bit form, taking the
    per-channel keys' four arrays and the values' triple (the block table and the rows' tail
    slots in the batch), and a step that seals a key group launches none (the plain path
    quantizes the group); FUSELM_KERNELS=off launches nothing."""
    from fuselm.runtime_metal.batch import BatchDecoder
    from fuselm.runtime_metal.engine import make_engine
    from fuselm.runtime_metal.generate import generate

    # the program's kernel path on this machine: MLX's CUDA device claimed (the CUDA setting
    # the engine then exports is restored after the test), launches recorded
    monkeypatch.setattr(kernels, "cuda_device", lambda: True)
    monkeypatch.setenv("MLX_MAX_OPS_PER_BUFFER", "")
    monkeypatch.delenv("MLX_MAX_OPS_PER_BUFFER")
    out = _small_qwen3(tmp_path)
    d, hk = 64, 2
    for bits in (8, 4):
        engine = make_engine(out, "mlx", RuntimeConfig(kernels="on", kv_attn="on"), kv_bits=bits,
                             kv_group_size=32)
        layers = engine.fast.program.num_layers
        launches.clear()
        generate(engine, [3, 1, 4, 1, 5], max_new_tokens=3)
        dec = BatchDecoder(engine, max_batch=2, max_context=128)
        assert dec.mode == "batched"
        dec.add([2, 7, 1, 8])
        dec.add([9])
        dec.step()
        dec.step()
        attend = [r for r in launches if "rope_attend" in str(r["name"])]
        single = [r for r in attend if "_bt" not in str(r["name"])]
        paged = [r for r in attend if "_bt" in str(r["name"])]
        # a layer's launch at each trace of a compiled step (replays launch what it recorded)
        assert single and paged and len(single) % layers == 0 == len(paged) % layers
        if bits == 4:
            for r in attend:
                _check_q4_launch(r, d, hk)
            # a prompt of 62: decode steps at position 62 (the open program's one trace: a
            # launch a layer) and 63, a key group's last (the sealing program: none)
            engine = make_engine(out, "mlx", RuntimeConfig(kernels="on", kv_attn="on"), kv_bits=4,
                                 kv_group_size=32)
            launches.clear()
            assert len(generate(engine, list(range(3, 65)), max_new_tokens=3).tokens) == 3
            assert engine.fast.caches[0].offset == 64
            assert len([r for r in launches if "rope_attend" in str(r["name"])]) == layers
            continue
        for r in attend:
            assert str(r["name"]).endswith("_q8")
            names = list(r["input_names"])  # type: ignore[call-overload]
            at = names.index("kc")
            assert names[at:at + 6] == ["kc", "kcs", "kcb", "vc", "vcs", "vcb"]
            assert names[at + 6:] == (["bt"] if "_bt" in str(r["name"]) else [])
            arrays = dict(zip(names, r["arrays"], strict=True))  # type: ignore[call-overload]
            for c in ("kc", "vc"):
                assert arrays[c].dtype == mx.uint32 and arrays[c].shape[1:2] == (hk,)
                assert arrays[c].shape[-1] == d // 4
                assert arrays[c + "s"].dtype == arrays[c + "b"].dtype == arrays["q"].dtype
                assert arrays[c + "s"].shape == (*arrays[c].shape[:3], d // 32)
            t = r["template"]
            assert t["GS"] == 32 and t["D"] == d  # type: ignore[index]
            assert t["PR"] == kernels.float_bits(1 / np.sqrt(d))  # type: ignore[index]
    launches.clear()
    engine = make_engine(out, "mlx", RuntimeConfig(kernels="off"), kv_bits=8)
    generate(engine, [3, 1, 4], max_new_tokens=2)
    assert launches == []


def _check_q4_launch(r: dict, d: int, hk: int) -> None:
    """A recorded launch of the 4-bit form: its cache inputs and constants."""
    name = str(r["name"])
    assert name.endswith("_q4")
    names = list(r["input_names"])
    at = names.index("kc")
    assert names[at:at + 7] == ["kc", "kcs", "kcb", "kct", "vc", "vcs", "vcb"]
    assert names[at + 7:] == (["bt", "tr"] if "_bt" in name else [])
    arrays = dict(zip(names, r["arrays"], strict=True))
    kc, vc = arrays["kc"], arrays["vc"]
    assert kc.dtype == vc.dtype == mx.uint32 and kc.shape[1:3] == (hk, d)
    assert arrays["kcs"].shape == arrays["kcb"].shape == (*kc.shape[:3], kc.shape[3] // 8)
    assert arrays["kct"].shape[1:] == (hk, KEY_TAIL, d) and vc.shape[-1] == d // 8
    assert arrays["vcs"].shape == (*vc.shape[:3], d // 32)
    for a in ("kcs", "kcb", "kct", "vcs", "vcb"):
        assert arrays[a].dtype == arrays["q"].dtype
    if "_bt" in name:
        assert arrays["tr"].dtype == mx.int32 and arrays["tr"].shape == arrays["bt"].shape[:1]
    t = r["template"]
    assert (t["GS"], t["D"], t["KGP"], t["KT"]) == (32, d, KEY_GROUP, KEY_TAIL)
    assert t["KG"] == (1 if "_bt" in name else kc.shape[3] // 8)
    # a warp step of whole code words (8 keys each) of one key group (_Q4_KEYS' static_assert)
    assert t["KB"] % 8 == 0 and KEY_GROUP % t["KB"] == 0


def test_q4_form_refuses_a_step_of_part_words(kv_attn_on: None) -> None:
    """The 4-bit form reads its keys in steps of whole code words of one key group: a
    split_keys of 8, 16 or 32; any other is refused by name before a launch."""
    from fuselm.runtime_metal.cuda_kernels import sources as kernels_cuda

    f16, d, hq, hk = mx.float16, 64, 4, 2
    q, kv = mx.zeros((1, 1, hq * d), f16), mx.zeros((1, 1, hk * d), f16)
    keys = key_groups_zeros((1, hk), 256, d, f16)
    values = KVQuant(4, 32).zeros((1, hk, 256), d, f16)
    for bad in (4, 12, 64):
        with pytest.raises(ValueError, match="split_keys"):
            kernels_cuda.rope_attend(q, kv, kv, None, None, mx.ones((d // 2,)),
                                     (1e-6, 0.125, 1.0), mx.array([5], mx.int32), keys, values,
                                     hq=hq, hk=hk, rotary_dim=d, interleaved=False, splits=2,
                                     split_keys=bad)


# ---- MLX-CUDA: the kernel against the plain path ----------------------------------------------

Q8_CASES = [  # d, hq, hk, q/k-norm, group sizes
    (128, 16, 8, True, (64, 128)),  # Qwen3-0.6B's attention
    (64, 8, 2, False, (32, 64)),  # Llama-like, GQA 4:1
]


def _ordered(x: mx.array) -> np.ndarray:
    """16-bit float values as integers in their order (adjacent values 1 apart), float32 ones
    as their float32 order: so 'within one ulp' is |a - b| <= 1."""
    bits = np.array(x.view(mx.uint16 if x.dtype.size == 2 else mx.uint32)).astype(np.int64)
    top = 1 << (8 * x.dtype.size - 1)
    return np.where(bits & top, -(bits & (top - 1)), bits)


def _step_inputs(dtype: mx.Dtype, d: int, hq: int, hk: int, norms: bool,
                 positions: list[int], seed: int):  # noqa: ANN202
    """What both cache forms' cases share: the generator (seeded, drawn from after these),
    the capacity, the step's inputs q, k, v, q/k-norm scales (or None) and inv_freq, the
    RoPE'd q/k rows (fused_rope_reference on the dtype-rounded inputs), and float K/V rows
    [2, b, hk, cap, d] for the cache, large past each row's position (never read)."""
    rng = np.random.default_rng(seed)
    b, cap = len(positions), 512
    inv_freq = (1.0 / 10000 ** (np.arange(0, d, 2) / d)).astype(np.float32)
    q, qf = rounded(rng.normal(size=(b, 1, hq * d)), dtype)
    k, kf = rounded(rng.normal(size=(b, 1, hk * d)), dtype)
    v, _ = rounded(rng.normal(size=(b, 1, hk * d)), dtype)
    qn = kn = qnf = knf = None
    if norms:
        qn, qnf = rounded(rng.uniform(0.5, 1.5, d), dtype)
        kn, knf = rounded(rng.uniform(0.5, 1.5, d), dtype)
    attrs = dict(head_dim=d, rotary_dim=d, inv_freq=inv_freq.tolist(), attention_scale=1.0,
                 interleaved=0, norm_eps=1e-6)
    qr, kr = fused_rope_reference(qf, kf, np.array(positions).reshape(b, 1), qnf, knf, **attrs)
    rows = rng.normal(size=(2, b, hk, cap, d)) * np.array([2.0, 1.0]).reshape(2, 1, 1, 1, 1)
    for i, p in enumerate(positions):
        rows[:, i, :, p:] = 50.0
    return rng, cap, (q, k, v, qn, kn, inv_freq, qr, kr), rows


def _q8_case(dtype: mx.Dtype, d: int, hq: int, hk: int, norms: bool, group: int,
             positions: list[int], paged: bool, seed: int):  # noqa: ANN202
    """The step's inputs, the RoPE'd q/k rows (fused_rope_reference, rounded to dtype: the
    plain path's inputs) and a factory of fresh cache buffers (the kernel writes in place):
    random rows quantized at every position, rows past a row's position large (never read)."""
    rng, cap, (q, k, v, qn, kn, inv_freq, qr, kr), rows = _step_inputs(
        dtype, d, hq, hk, norms, positions, seed)
    b = len(positions)
    quant = KVQuant(8, group)
    table = None
    if paged:  # row r's block j at table[r, j], out of order in a pool with spare blocks
        w = cap // BLOCK
        table = rng.permutation(b * w + 3)[:b * w].reshape(b, w).astype(np.int32)
        pool = np.full((2, b * w + 3, hk, BLOCK, d), 7.0)
        blocks = rows.reshape(2, b, hk, w, BLOCK, d).transpose(0, 1, 3, 2, 4, 5)
        pool[:, table.reshape(-1)] = blocks.reshape(2, b * w, hk, BLOCK, d)
        rows = pool

    def caches() -> tuple[tuple[mx.array, ...], tuple[mx.array, ...]]:
        ks, vs = (quant.quantize(mx.array(r.astype(np.float32)).astype(dtype)) for r in rows)
        mx.eval(ks, vs)
        return ks, vs

    return (q, k, v, qn, kn, mx.array(inv_freq), rounded(qr, dtype)[0],
            rounded(kr, dtype)[0], caches, None if table is None else mx.array(table))


@cuda
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("positions", [[300], [3, 300, 0, 130]])
@pytest.mark.parametrize("splits", [0, 1, 8])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize("case", range(len(Q8_CASES)))
@pytest.mark.parametrize("group_at", [0, 1])
def test_q8_rope_attend_matches_plain_path(dtype: mx.Dtype, case: int, group_at: int,
                                           splits: int, positions: list[int],
                                           paged: bool) -> None:
    """The 8-bit kernel (splits 0 runs its one-split form) against Attention.over_cache over
    the same buffers, RoPE'd q/k given: outputs within the float kernel's tolerance against
    its float64 reference (both sides round the rotated rows, the dequantized cache and the
    output to the dtype, so they differ by a few units in its last place); the new rows'
    codes those of mx.quantize (at most 1 apart, where the rotated value rounds the other
    way: the rotation's float32 sums run in another order; 99 % equal), their scales and
    biases within one unit in the dtype's last place; every other position untouched.
    Batch rows at their own positions (0: nothing cached), contiguous or through a block
    table (positions past one block)."""
    from fuselm.runtime_metal.cuda_kernels import sources as kernels_cuda
    from fuselm.runtime_metal.mlx_engine.attention import Attention

    d, hq, hk, norms, groups = Q8_CASES[case]
    group = groups[group_at]
    b = len(positions)
    q, k, v, qn, kn, inv, qr, kr, caches, table = _q8_case(
        dtype, d, hq, hk, norms, group, positions, paged, seed=d + group + b)
    prm = (1e-6, 1 / np.sqrt(d), 1.0)
    offset = mx.array(positions, mx.int32)
    before = caches()
    y, kc, vc = kernels_cuda.rope_attend(
        q, k, v, qn, kn, inv, prm, offset, *caches(), hq=hq, hk=hk, rotary_dim=d,
        interleaved=False, splits=splits, table=table)
    mx.eval(y, kc, vc)
    width = (table.shape[1] * BLOCK) if table is not None else kc[0].shape[2]
    mask = (mx.arange(width).reshape(1, 1, 1, -1) <= offset.reshape(-1, 1, 1, 1))
    blocks = None if table is None else BlockIndex(table, offset, 1)
    y_ref, k_ref, v_ref = Attention(hq, hk).over_cache(qr, kr, v, *caches(), offset, mask,
                                                       blocks=blocks)
    mx.eval(y_ref, k_ref, v_ref)
    assert rel(np.array(y.astype(mx.float32)), np.array(y_ref.astype(mx.float32))) \
        <= TOL[dtype] * 2
    # where each row's new position lies: (block or row, position in it)
    tb = None if table is None else np.array(table)
    at = [(int(tb[i, p // BLOCK]), p % BLOCK) if tb is not None else (i, p)
          for i, p in enumerate(positions)]
    new = np.zeros(kc[0].shape[0:1] + kc[0].shape[2:3], bool)
    for r, p in at:
        new[r, p] = True
    for got, want, old in ((kc, k_ref, before[0]), (vc, v_ref, before[1])):
        codes = [np.array(a).view(np.uint8).astype(np.int32) for a in (got[0], want[0])]
        diff = np.abs(codes[0] - codes[1]).transpose(0, 2, 1, 3)[new]
        assert diff.max() <= 1 and (diff == 0).mean() >= 0.99
        for i in (1, 2):  # scales, biases
            ulps = np.abs(_ordered(got[i]) - _ordered(want[i])).transpose(0, 2, 1, 3)[new]
            assert ulps.max() <= 1
        for a, o in zip(got, old, strict=True):  # nothing else written
            a_, o_ = (np.array(x if x.dtype == mx.uint32 else x.astype(mx.float32))
                      .transpose(0, 2, 1, 3)[~new] for x in (a, o))
            assert np.array_equal(a_, o_)


@cuda
def test_eight_bit_kv_program_with_kernels_matches_plain_path(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A Qwen3 (head_dim 64, GQA 2:1, float32) over an 8-bit cache: generate's greedy tokens
    with the kernels on (the 8-bit attention kernel) equal those with them off (the plain
    path), the decode step without MLX's softmax; and the batch decoder's (block pools through
    the table) equal generate's, three sequences joined at different steps."""
    import collections
    import re

    from fuselm.runtime_metal.engine import make_engine
    from fuselm.runtime_metal.generate import generate

    monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "0")
    out = _small_qwen3(tmp_path)
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, 384, 300)]
    tokens, graphs = {}, {}
    for mode in ("off", "on"):
        engine = make_engine(out, "mlx", RuntimeConfig(kernels=mode, kv_attn="on"), kv_bits=8,
                             kv_group_size=32)
        tokens[mode] = generate(engine, prompt, max_new_tokens=24, prefill_chunk=128).tokens
        dot = tmp_path / f"{mode}.dot"
        mx.export_to_dot(str(dot), engine.decode_step(mx.array(tokens[mode][-1], mx.int32)))
        graphs[mode] = collections.Counter(
            re.findall(r'\[label\s*=\s*"?([A-Za-z]+)', dot.read_text()))
    assert tokens["on"] == tokens["off"]
    assert graphs["on"]["Softmax"] == 0 and graphs["off"]["Softmax"] > 0

    engine = make_engine(out, "mlx", RuntimeConfig(kernels="on", kv_attn="on"), kv_bits=8,
                         kv_group_size=32)
    joined_rows_equal_generate(engine)


# ---- MLX-CUDA: the 4-bit form against the plain path ------------------------------------------

# positions: inside a group, the first of a group (the one before just sealed), nothing cached,
# a group's next-to-last (the last open step before it seals); never a group's last (a sealing
# step: not the kernel's)
Q4_POSITIONS = [[300], [3, 256, 0, 130, 190]]


def _nibbles(a: mx.array) -> np.ndarray:
    """4-bit codes [.., words] -> [.., words * 8], low nibble first."""
    w = np.array(a).astype(np.int64)
    return ((w[..., None] >> (4 * np.arange(8))) & 15).reshape(*w.shape[:-1], -1)


def _q4_case(dtype: mx.Dtype, d: int, hq: int, hk: int, norms: bool, group: int,
             positions: list[int], paged: bool, seed: int):  # noqa: ANN202
    """_q8_case's inputs over a 4-bit cache: each row's keys written from position 0 by the
    plain path's write (kv_cache.write_key_groups: its complete groups sealed, its newest
    KEY_TAIL keys in the float tail), values quantized at every position (large past the row's
    position: never read); paged: the groups in the blocks of a shuffled table, the tails in
    shuffled slots (`tails`)."""
    rng, cap, (q, k, v, qn, kn, inv_freq, qr, kr), rows = _step_inputs(
        dtype, d, hq, hk, norms, positions, seed)
    b = len(positions)
    quant = KVQuant(4, group)
    w = cap // BLOCK
    table = tails = None
    vrows = rows[1]
    if paged:
        table = rng.permutation(b * w + 3)[:b * w].reshape(b, w).astype(np.int32)
        tails = rng.permutation(b + 1)[:b].astype(np.int32)
        pool = np.full((b * w + 3, hk, BLOCK, d), 7.0)
        pool[table.reshape(-1)] = rows[1].reshape(b, hk, w, BLOCK, d).transpose(
            0, 2, 1, 3, 4).reshape(b * w, hk, BLOCK, d)
        vrows = pool

    def caches() -> tuple[tuple[mx.array, ...], tuple[mx.array, ...]]:
        seqs = []
        for i, p in enumerate(positions):
            buf = key_groups_zeros((1, hk), cap, d, dtype)
            if p:
                buf = write_key_groups(buf, mx.array(rows[0, i:i + 1, :, :p].astype(np.float32))
                                       .astype(dtype), 0)
            seqs.append(buf)
        keys = tuple(mx.concatenate([s_[j] for s_ in seqs]) for j in range(4))
        if paged:
            assert table is not None and tails is not None
            pk = list(key_blocks_zeros(b * w + 3, b + 1, hk, d, dtype))
            at = mx.array(table.reshape(-1))
            for j, width in ((0, 8), (1, 1), (2, 1)):  # a group's words, scale, bias
                per = keys[j].reshape(b, hk, d, w + 1, width)[:, :, :, :w]
                pk[j][at] = per.transpose(0, 3, 1, 2, 4).reshape(b * w, hk, d, width)
            pk[3][mx.array(tails)] = keys[3]
            keys = tuple(pk)
        values = quant.quantize(mx.array(vrows.astype(np.float32)).astype(dtype))
        mx.eval(keys, values)
        return keys, values

    return (q, k, v, qn, kn, mx.array(inv_freq), rounded(qr, dtype)[0],
            rounded(kr, dtype)[0], caches, None if table is None else mx.array(table),
            None if tails is None else mx.array(tails))


@cuda
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("positions", Q4_POSITIONS)
@pytest.mark.parametrize("splits", [0, 1, 8])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize("case", range(len(Q8_CASES)))
@pytest.mark.parametrize("group_at", [0, 1])
def test_q4_rope_attend_matches_plain_path(dtype: mx.Dtype, case: int, group_at: int,
                                           splits: int, positions: list[int],
                                           paged: bool) -> None:
    """The 4-bit form (splits 0 runs its one-split form) against Attention.over_cache with
    seal=False (a step that completes no key group) over the same buffers, RoPE'd q/k given:
    outputs within the 8-bit form's tolerance; the new value rows' codes those of mx.quantize
    (at most 1 apart, 99 % equal), their scales and biases within one unit in the dtype's last
    place; the new key in the row's tail slot within one unit of the plain path's; every other
    position of the values and tails, and every key code, scale and bias, untouched."""
    from fuselm.runtime_metal.cuda_kernels import sources as kernels_cuda
    from fuselm.runtime_metal.mlx_engine.attention import Attention

    d, hq, hk, norms, groups = Q8_CASES[case]
    group = groups[group_at]
    b = len(positions)
    q, k, v, qn, kn, inv, qr, kr, caches, table, tails = _q4_case(
        dtype, d, hq, hk, norms, group, positions, paged, seed=d + group + b)
    prm = (1e-6, 1 / np.sqrt(d), 1.0)
    offset = mx.array(positions, mx.int32)
    before = caches()
    y, kc, vc = kernels_cuda.rope_attend(
        q, k, v, qn, kn, inv, prm, offset, *caches(), hq=hq, hk=hk, rotary_dim=d,
        interleaved=False, splits=splits, table=table, tails=tails)
    mx.eval(y, kc, vc)
    width = (table.shape[1] * BLOCK) if table is not None else vc[0].shape[2]
    mask = (mx.arange(width).reshape(1, 1, 1, -1) <= offset.reshape(-1, 1, 1, 1))
    blocks = None if table is None else BlockIndex(table, offset, 1, tails)
    y_ref, k_ref, v_ref = Attention(hq, hk).over_cache(qr, kr, v, *caches(), offset, mask,
                                                       blocks=blocks, seal=False)
    mx.eval(y_ref, k_ref, v_ref)
    assert rel(np.array(y.astype(mx.float32)), np.array(y_ref.astype(mx.float32))) \
        <= TOL[dtype] * 2
    tb = None if table is None else np.array(table)
    at = [(int(tb[i, p // BLOCK]), p % BLOCK) if tb is not None else (i, p)
          for i, p in enumerate(positions)]
    new = np.zeros(vc[0].shape[0:1] + vc[0].shape[2:3], bool)
    for r, p in at:
        new[r, p] = True
    codes = [_nibbles(a) for a in (vc[0], v_ref[0])]
    diff = np.abs(codes[0] - codes[1]).transpose(0, 2, 1, 3)[new]
    assert diff.max() <= 1 and (diff == 0).mean() >= 0.99
    for i in (1, 2):  # scales, biases
        ulps = np.abs(_ordered(vc[i]) - _ordered(v_ref[i])).transpose(0, 2, 1, 3)[new]
        assert ulps.max() <= 1
    for a, o in zip(vc, before[1], strict=True):  # no other value row written
        a_, o_ = (np.array(x if x.dtype == mx.uint32 else x.astype(mx.float32))
                  .transpose(0, 2, 1, 3)[~new] for x in (a, o))
        assert np.array_equal(a_, o_)
    for a, o in zip(kc[:3], before[0][:3], strict=True):  # no key group written
        assert np.array_equal(np.array(a if a.dtype == mx.uint32 else a.astype(mx.float32)),
                              np.array(o if o.dtype == mx.uint32 else o.astype(mx.float32)))
    slots = np.zeros(kc[3].shape[0:1] + kc[3].shape[2:3], bool)
    trows = np.arange(b) if tails is None else np.array(tails)
    for i, p in enumerate(positions):
        slots[trows[i], p % KEY_TAIL] = True
    ulps = np.abs(_ordered(kc[3]) - _ordered(k_ref[3])).transpose(0, 2, 1, 3)[slots]
    assert ulps.max() <= 1
    got, old = (np.array(x.astype(mx.float32)).transpose(0, 2, 1, 3)[~slots]
                for x in (kc[3], before[0][3]))
    assert np.array_equal(got, old)


@cuda
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("step", [8, 32])
def test_q4_rope_attend_other_steps_match_plain_path(step: int, paged: bool) -> None:
    """The 4-bit form's other warp steps (split_keys 8: a code word a channel, 32: four)
    against Attention.over_cache as the default step's above: Qwen3-0.6B's heads, bfloat16,
    8 splits, rows in and at the start of key groups."""
    from fuselm.runtime_metal.cuda_kernels import sources as kernels_cuda
    from fuselm.runtime_metal.mlx_engine.attention import Attention

    dtype, (d, hq, hk, norms, groups) = mx.bfloat16, Q8_CASES[0]
    positions = [300, 3, 256, 0, 130, 190]
    q, k, v, qn, kn, inv, qr, kr, caches, table, tails = _q4_case(
        dtype, d, hq, hk, norms, groups[0], positions, paged, seed=step)
    offset = mx.array(positions, mx.int32)
    y, _, _ = kernels_cuda.rope_attend(
        q, k, v, qn, kn, inv, (1e-6, 1 / np.sqrt(d), 1.0), offset, *caches(), hq=hq, hk=hk,
        rotary_dim=d, interleaved=False, splits=8, table=table, tails=tails, split_keys=step)
    width = table.shape[1] * BLOCK if table is not None else 512
    mask = (mx.arange(width).reshape(1, 1, 1, -1) <= offset.reshape(-1, 1, 1, 1))
    blocks = None if table is None else BlockIndex(table, offset, 1, tails)
    y_ref, _, _ = Attention(hq, hk).over_cache(qr, kr, v, *caches(), offset, mask,
                                               blocks=blocks, seal=False)
    assert rel(np.array(y.astype(mx.float32)), np.array(y_ref.astype(mx.float32))) \
        <= TOL[dtype] * 2


@cuda
def test_four_bit_kv_program_with_kernels_matches_plain_path(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A Qwen3 (head_dim 64, GQA 2:1, float32) over a 4-bit cache, 160 tokens past a 100-token
    prompt (key groups sealed by the plain path at 127, 191 and 255, the steps between through
    the 4-bit kernel): generate's greedy tokens with the kernels on equal those with them off,
    the open decode step without MLX's softmax; and the batch decoder's (block pools, tail
    slots) equal generate's, three sequences joined at different steps."""
    import collections
    import re

    from fuselm.runtime_metal.engine import make_engine
    from fuselm.runtime_metal.generate import generate

    monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "0")
    out = _small_qwen3(tmp_path)
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, 384, 100)]
    tokens, graphs = {}, {}
    for mode in ("off", "on"):
        engine = make_engine(out, "mlx", RuntimeConfig(kernels=mode, kv_attn="on"), kv_bits=4,
                             kv_group_size=32)
        tokens[mode] = generate(engine, prompt, max_new_tokens=160, prefill_chunk=64).tokens
        assert (engine.fast.caches[0].offset + 1) % KEY_GROUP  # the next step is an open one
        dot = tmp_path / f"{mode}.dot"
        mx.export_to_dot(str(dot), engine.decode_step(mx.array(tokens[mode][-1], mx.int32)))
        graphs[mode] = collections.Counter(
            re.findall(r'\[label\s*=\s*"?([A-Za-z]+)', dot.read_text()))
    assert tokens["on"] == tokens["off"]
    assert graphs["on"]["Softmax"] == 0 and graphs["off"]["Softmax"] > 0

    engine = make_engine(out, "mlx", RuntimeConfig(kernels="on", kv_attn="on"), kv_bits=4,
                         kv_group_size=32)
    joined_rows_equal_generate(engine, (7, 70, 130), new_tokens=150)
