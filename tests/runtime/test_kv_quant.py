"""The quantized KV cache (kv_cache.KVQuant, `--kv-bits` / `--kv-group-size`): the stored
triples and their bytes per token, a 4-bit cache's keys per channel (kv_cache.write_key_groups:
a group quantized once, when a write completes it, to mx.quantize of its 64 keys, whatever
chunks and trims wrote them; the open group read from the float tail), speculative
greedy decoding over it, attention over them against attention over their
dequantized values, batched rows and shared prompt prefixes against solo runs, the flags on
the CLI, and the refusals (onnxruntime, a group size that does not divide the head dim).

The tiny Mistral (head_dim 32) is the family whose heads split into MLX's groups (32); the
real-model checks (greedy tokens, perplexity) are in test_smollm2.py."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from fuselm.runtime_metal.batch import BatchDecoder
from fuselm.runtime_metal.drafting import PromptLookup
from fuselm.runtime_metal.engine import make_engine
from fuselm.runtime_metal.errors import RuntimeUserError
from fuselm.runtime_metal.generate import generate
from fuselm.runtime_metal.kv_cache import (
    BLOCK,
    KEY_GROUP,
    KEY_TAIL,
    KEY_WORDS,
    BlockCache,
    BlockIndex,
    KVCache,
    KVQuant,
    dequantized,
    key_group_read,
    key_group_values,
    key_groups_zeros,
    read_blocks,
    rotate,
    stored_values,
    unrotate,
    write_rows,
)
from fuselm.runtime_metal.mlx_engine.attention import Attention
from tests.cli_run import cli, one_error, run_cli

N = 8


@pytest.fixture(scope="module")
def mistral(family_models: dict[str, tuple[Path, Path]]) -> Path:
    return family_models["mistral"][1]


@pytest.mark.parametrize(("bits", "saved"), [(8, 0.45), (4, 0.70)])
def test_stored_bytes_per_token(bits: int, saved: float) -> None:
    """A float16 cache of 64-value heads (SmolLM2's) against the same cache quantized, group
    64: 8 bits + a float16 scale and bias per 64 values = 68 bytes a head-row against 128
    (-46.9 %); 4 bits: 36 (-71.9 %; keys per channel: a scale and bias per channel and 64
    positions, the same count), plus, fixed per row and layer, the float tail of the keys'
    newest two groups and the keys' spare group."""
    rows = mx.random.normal((1, 3, 300, 64)).astype(mx.float16)
    plain, quant = KVCache(), KVCache(KVQuant(bits))
    for c in (plain, quant):
        c.update_and_fetch(rows, rows)
    per_value = (quant.nbytes - quant.fixed_nbytes) / plain.nbytes * 2
    assert per_value == KVQuant(bits).bytes_per_value(mx.float16)
    assert 1 - (quant.nbytes - quant.fixed_nbytes) / plain.nbytes >= saved
    fixed = 3 * 64 * (KEY_TAIL * 2 + KEY_GROUP * KVQuant(4).bytes_per_value(mx.float16))
    assert quant.fixed_nbytes == (fixed if bits == 4 else 0)


@pytest.mark.parametrize("dim", [64, 128, 96])
def test_rotation_is_orthogonal(dim: int) -> None:
    """The stored basis (Hadamard blocks: one of the whole head for 64 and 128, three of 32
    for 96): unrotate undoes rotate, and q·kᵀ is the same in either basis."""
    rng = np.random.default_rng(2)
    q, k = (mx.array(rng.normal(size=(2, 5, dim)).astype(np.float32)) for _ in range(2))
    assert float(mx.abs(unrotate(rotate(k)) - k).max()) < 1e-5
    assert float(mx.abs(rotate(q) @ rotate(k).swapaxes(-1, -2) - q @ k.swapaxes(-1, -2)).max()
                 ) < 1e-4


def test_rotation_spreads_an_outlier_channel() -> None:
    """A key whose one channel is 40x the others (RoPE'd keys' shape): stored plainly, 4-bit
    groups of 64 round every other channel to a step of the outlier's size; rotated first,
    the squared error of the rows read back is several times smaller (measured 5.5x)."""
    rng = np.random.default_rng(5)
    x = rng.normal(size=(1, 2, 64, 64)).astype(np.float32)
    x[..., 7] *= 40
    rows = mx.array(x)
    q = KVQuant(4)
    plain = mx.dequantize(*mx.quantize(rows, group_size=64, bits=4), group_size=64, bits=4)
    rotated = dequantized(q.quantize(rows), 64)
    assert float(((rotated - rows) ** 2).mean()) < float(((plain - rows) ** 2).mean()) / 4


@pytest.mark.parametrize("bits", [8, 4])
def test_cache_keeps_its_rows_to_within_a_step(bits: int) -> None:
    """Written in two pieces (a prompt, then one token): the stored values are the rotated rows,
    each within one quantization step of its group (MLX's affine scheme rounds its scale and
    bias too: more than the half step of exact min/max), and read back (rotated back) every
    row is within the same distance (the rotation keeps lengths). Values at both widths; keys
    at 8 bits (4-bit keys are stored per channel: test_keys_per_channel_*)."""
    rng = np.random.default_rng(0)
    first, second = (mx.array(rng.normal(size=(1, 2, n, 32)).astype(np.float32))
                     for n in (5, 1))
    c = KVCache(KVQuant(bits, 32))
    c.update_and_fetch(first, first)
    keys, values = c.update_and_fetch(second, second)
    keys = keys if bits == 8 else values
    want = np.concatenate([np.array(first), np.array(second)], axis=2)
    turned = np.array(rotate(mx.array(want)))
    step = (turned.max(-1, keepdims=True) - turned.min(-1, keepdims=True)) / (2 ** bits - 1)
    assert c.offset == 6 and np.all(np.abs(np.array(stored_values(keys, 32)) - turned)
                                    <= step)
    err = np.linalg.norm(np.array(dequantized(keys, 32)) - want, axis=-1)
    assert np.all(err <= np.sqrt(32) * step[..., 0] + 1e-6)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("mask", [None, "causal", "array"])
def test_attention_over_the_triples_is_attention_over_their_values(mask: str | None,
                                                                   bits: int) -> None:
    """GQA 3:1, a chunk of 4 queries after 3 cached keys: the quantized matmul path (rotated
    queries over the rotated stored rows, its output rotated back) equals MLX's SDPA over the
    dequantized keys and values in their own basis: the unrotated float math."""
    rng = np.random.default_rng(1)
    q = mx.array(rng.normal(size=(1, 6, 4, 64)).astype(np.float32))
    k, v = (KVQuant(bits).quantize(mx.array(rng.normal(size=(1, 2, 7, 64)).astype(np.float32)))
            for _ in range(2))
    m: object = mask
    if mask == "array":
        m = mx.array(rng.random((1, 1, 4, 7)) > 0.3) | mx.eye(4, 7, 3, dtype=mx.bool_)
    attn = Attention(6, 2)
    got = attn.attend(q, k, v, m)  # type: ignore[arg-type]
    want = attn.attend(q, dequantized(k, 64), dequantized(v, 64), m)  # type: ignore[arg-type]
    assert float(mx.abs(got - want).max()) < 1e-5


@pytest.mark.parametrize("bits", [8, 4])
def test_batched_rows_and_shared_prefixes_equal_solo(mistral: Path, bits: int) -> None:
    """A quantized block cache: two rows decoded together, the second sharing the first's
    70-token prefix by reference, give each prompt's solo greedy tokens over the
    single-sequence quantized cache; so does a third prompt in a finished row's slot, which
    reuses the prefix it shares. 8 bits share the 70 tokens (a whole block and a copied
    partial one); 4 bits (keys per channel, a block one key group) whole blocks only: 64."""
    engine = make_engine(mistral, "mlx", kv_bits=bits, kv_group_size=32)
    base = [int(t) for t in np.random.default_rng(3).integers(4, 384, 70)]
    prompts = [base + [5, 6], base + [7, 8, 9], base + [10]]
    want = [generate(engine, p, max_new_tokens=N).tokens for p in prompts]
    dec = BatchDecoder(engine, max_batch=2, max_context=160)
    assert dec.mode == "batched" and dec.cache.quant == KVQuant(bits, 32)
    assert dec.cache.keys_per_channel == (bits == 4)
    shared = 70 if bits == 8 else KEY_GROUP
    slots = [dec.add(p) for p in prompts[:2]]
    assert dec.slots[slots[1]].reused == shared

    def run(slots: list[int]) -> list[list[int]]:
        got: dict[int, list[int]] = {s: [] for s in slots}
        for _ in range(N):
            for slot, token in dec.step().items():
                got[slot].append(token)
        return [got[s] for s in slots]
    assert run(slots) == want[:2]
    for s in slots:
        dec.remove(s)
    third = dec.add(prompts[2])
    assert dec.slots[third].reused == shared and run([third]) == want[2:]


def test_forks_over_4bit_keys_equal_solo(mistral: Path) -> None:
    """Two forks of a 70-token prompt over a 4-bit block cache share its blocks, the partial
    key group among them (each fork's first write copies that block and quantizes the group
    again from its own copy of the prompt's float tail): every row gives the solo tokens,
    with the first row's logprobs."""
    engine = make_engine(mistral, "mlx", kv_bits=4, kv_group_size=32)
    prompt = [int(t) for t in np.random.default_rng(12).integers(4, 384, 70)]
    want = generate(engine, prompt, max_new_tokens=N).tokens
    dec = BatchDecoder(engine, max_batch=3, max_context=96)
    first = dec.add(prompt, top_logprobs=1)
    slots = [first, dec.fork(first, top_logprobs=1), dec.fork(first, top_logprobs=1)]
    got: dict[int, list[int]] = {s: [] for s in slots}
    lps: dict[int, list[float]] = {s: [] for s in slots}
    for _ in range(N):
        for slot, token in dec.step().items():
            got[slot].append(token)
            lp = dec.logprobs(slot)
            assert lp is not None
            lps[slot].append(lp.logprob)
    assert list(got.values()) == [want] * 3
    for s in slots[1:]:
        assert lps[s] == pytest.approx(lps[first], abs=1e-5)


def test_4bit_steps_across_a_key_group_end(mistral: Path) -> None:
    """Decode steps across a key group's last position over a 4-bit cache: the compiled
    program's steps (the step that completes a group quantizes it; the others take the
    program that quantizes nothing, DecodeProgram.step_open) give the executor's tokens and
    stored group (KVCache.update_and_fetch), and two batched rows a position apart (a step
    that completes one row's group while the other's stays open, and steps that quantize
    nothing: DecodeProgram.paged_open) each give its solo tokens and group."""
    fast = make_engine(mistral, "mlx", kv_bits=4, kv_group_size=32)
    plain = make_engine(mistral, "mlx", kv_bits=4, kv_group_size=32, fast=False)
    assert fast.batch_open() is not None
    rng = np.random.default_rng(13)
    prompts = [[int(t) for t in rng.integers(4, 384, n)] for n in (60, 61)]

    def group0(keys: tuple[mx.array, ...]) -> np.ndarray:
        return np.array(key_group_values(keys, KEY_GROUP))

    def close(a: np.ndarray, b: np.ndarray) -> bool:  # 4-bit codes of near-equal floats
        return float(np.abs(a - b).mean()) < 0.02 * float(np.abs(b).mean())
    want, groups = [], []
    for p in prompts:
        want.append(generate(fast, p, max_new_tokens=N).tokens)
        groups.append([group0(c.keys) for c in fast.caches])  # type: ignore[arg-type]
        assert generate(plain, p, max_new_tokens=N).tokens == want[-1]
        assert all(close(g, group0(c.keys))  # type: ignore[arg-type]
                   for g, c in zip(groups[-1], plain.caches, strict=True))
    dec = BatchDecoder(fast, max_batch=2, max_context=96)
    slots = [dec.add(p) for p in prompts]
    got: dict[int, list[int]] = {s: [] for s in slots}
    for _ in range(N):
        for slot, token in dec.step().items():
            got[slot].append(token)
    assert [got[s] for s in slots] == want
    for s, g in zip(slots, groups, strict=True):
        b = dec.slots[s].blocks[0]
        for layer, keys in enumerate(dec.cache.keys):
            assert close(group0(tuple(a[b:b + 1] for a in keys)), g[layer])


def test_close_to_the_float_cache(mistral: Path) -> None:
    """The quantized caches' prompt logits against the float cache's (the tiny random model's
    logits are small: absolute bounds)."""
    prompt = np.array([[int(t) for t in np.random.default_rng(4).integers(4, 384, 40)]])
    ref = make_engine(mistral, "mlx").forward(prompt)
    for bits, bound in ((8, 0.01), (4, 0.1)):
        got = make_engine(mistral, "mlx", kv_bits=bits, kv_group_size=32).forward(prompt)
        assert 0 < np.abs(got - ref).max() < bound * np.abs(ref).max()


def test_refusals(mistral: Path, qwen3_artifact: Path, capsys: pytest.CaptureFixture) -> None:
    """onnxruntime's KV cache stays float: the flag is refused by name (API and CLI); a group
    size that does not divide the head dim (24) and a group size without bits are refused."""
    with pytest.raises(RuntimeUserError, match="--kv-bits: the onnxruntime engine"):
        make_engine(mistral, "onnxruntime", kv_bits=8)
    for command in (["run", "--prompt-ids", "1,2"], ["chat"], ["serve"]):
        line = one_error(*cli(capsys, command[0], str(mistral), *command[1:], "--engine",
                              "onnxruntime", "--kv-bits", "8"))
        assert "--kv-bits: the onnxruntime engine" in line and "--engine mlx" in line
    with pytest.raises(RuntimeUserError, match="head dim 24 is not a multiple of the group"):
        make_engine(qwen3_artifact, "mlx", kv_bits=4)
    line = one_error(*cli(capsys, "bench", str(mistral), "-p", "8", "-n", "2", "--engine", "mlx",
                          "--kv-group-size", "32"))
    assert "give it with --kv-bits" in line


def test_cli_flags_and_api(mistral: Path, capsys: pytest.CaptureFixture) -> None:
    """run and bench take --kv-bits / --kv-group-size and say so in the engine they report;
    run's tokens are `fuselm.load(..., kv_bits=4, kv_group_size=32)`'s."""
    import fuselm

    model = fuselm.load(mistral, engine="mlx", kv_bits=4, kv_group_size=32)
    want = model.generate([1, 2, 3], max_tokens=4).tokens
    assert model.runtime.engine.kv_quant == KVQuant(4, 32)
    code, out, _ = run_cli(capsys, "run", str(mistral), "--prompt-ids", "1,2,3", "-n", "4",
                           "--engine", "mlx", "--kv-bits", "4", "--kv-group-size", "32",
                           "--json")
    got = json.loads(out)
    assert code == 0 and got["tokens"] == want
    assert got["engine"]["kv_cache"] == "in-place (bound), 4-bit (group 32)"
    code, out, _ = run_cli(capsys, "bench", str(mistral), "-p", "8", "-n", "2", "-r", "1",
                           "--engine", "mlx", "--kv-bits", "8", "--kv-group-size", "32",
                           "--json")
    assert code == 0 and json.loads(out)["engine"]["kv_cache"].endswith("8-bit (group 32)")
    ppl = {}
    for kv in ([], ["--kv-bits", "8", "--kv-group-size", "32"]):
        code, out, _ = run_cli(capsys, "perplexity", str(mistral), "--context", "64",
                               "--engine", "mlx", *kv, "--json")
        assert code == 0
        ppl[bool(kv)] = json.loads(out)["ppl"]
    assert ppl[True] != ppl[False] and abs(ppl[True] / ppl[False] - 1) < 0.01


def _key_groups_reference(x: np.ndarray, n: int) -> np.ndarray:
    """Positions 0..n-1 of keys x [b, h, t, d] as a per-channel key buffer holds them
    (KVCache.dense): each complete group of 64 positions mx.quantize'd along positions,
    dequantized; the open group's keys as they are (the float tail)."""
    out = []
    for g in range(0, n, KEY_GROUP):
        blk = x[:, :, g:min(g + KEY_GROUP, n)]
        if blk.shape[2] < KEY_GROUP:
            out.append(blk)
            continue
        d = mx.dequantize(*_one_shot(blk), group_size=KEY_GROUP, bits=4)
        out.append(np.array(d.swapaxes(-1, -2)))
    return np.concatenate(out, axis=2)


def _one_shot(group: np.ndarray) -> list[mx.array]:
    """The codes of 64 float keys [b, h, 64, d] quantized at once per channel: (packed
    [b, h, d, 8], scales and biases [b, h, d, 1])."""
    return mx.quantize(mx.array(group).swapaxes(-1, -2), group_size=KEY_GROUP, bits=4)


def _group_codes(buf: tuple[mx.array, ...], g: int) -> list[np.ndarray]:
    """Group g's stored codes in a per-channel key buffer (packed, scales, biases)."""
    w = KEY_WORDS
    return [np.array(buf[0][..., g * w:(g + 1) * w]), np.array(buf[1][..., g:g + 1]),
            np.array(buf[2][..., g:g + 1])]


def _channel_keys(t: int = 300) -> np.ndarray:
    rng = np.random.default_rng(6)
    x = rng.normal(size=(1, 2, t, 64)).astype(np.float32)
    return x * rng.uniform(0.1, 8, size=64).astype(np.float32)  # channels of unlike ranges


@pytest.mark.parametrize("chunks", [[200], [37, 1, 64, 5, 93], [1] * 70])
def test_keys_per_channel_are_quantized_once_when_full(chunks: list[int]) -> None:
    """A 4-bit cache written in any chunks: a group's stored codes change in the one write
    that completes it, and then are exactly mx.quantize of its 64 float keys at once; the open
    group's are never written (still zeros) and its keys read back are the floats; so written
    one position at a time at a device offset (the compiled program's), whose every step
    quantizes its group but stores it only when the step completes it."""
    x = _channel_keys()
    c = KVCache(KVQuant(4))
    for n in chunks:
        o = c.offset
        before = [_group_codes(c.keys, g) for g in range(4)] if c.keys is not None else None
        c.update_and_fetch(mx.array(x[:, :, o:o + n]), mx.array(x[:, :, o:o + n]))
        assert c.keys is not None
        assert np.array_equal(np.array(c.dense(64, 64)[0]), _key_groups_reference(x, c.offset))
        for g in range(4):
            codes = _group_codes(c.keys, g)
            if o < (g + 1) * KEY_GROUP <= c.offset:  # completed by this write
                want = [np.array(a) for a in _one_shot(x[:, :, g * KEY_GROUP:(g + 1) * KEY_GROUP])]
                assert all(np.array_equal(a, b) for a, b in zip(codes, want, strict=True))
            elif before is not None:  # quantized before, or open: as it was
                assert all(np.array_equal(a, b) for a, b in zip(codes, before[g], strict=True))
            if (g + 1) * KEY_GROUP > c.offset:
                assert not any(a.any() for a in codes)
    buf = key_groups_zeros((1, 2), 256, 64, mx.float32)
    for o in range(70):
        buf = write_rows(buf, mx.array(x[:, :, o:o + 1]), mx.array([o], mx.int32))
        mx.eval(buf)
        open_group = _group_codes(buf, (o + 1) // KEY_GROUP)
        assert not any(a.any() for a in open_group)
    assert all(np.array_equal(a, np.array(b)) for a, b in zip(
        _group_codes(buf, 0), _one_shot(x[:, :, :64]), strict=True))
    assert np.array_equal(np.array(key_group_read(buf, 70)), _key_groups_reference(x, 70))


def test_keys_per_channel_after_trims() -> None:
    """Rejected drafts that completed a group (written 62..66, trimmed back to 63): group 0 is
    open again, read from the tail, and the write that completes it again quantizes it from
    the tail's floats and the new keys, so no rejected key is left in any group. A trim past the
    tail's reach (300 back to 100: the floats of 64..99 are gone) forgets back to the group's
    start (offset 64), and writing on from there gives the keys of the trimmed sequence."""
    x = _channel_keys()
    junk = np.random.default_rng(7).normal(size=(1, 2, 4, 64)).astype(np.float32) * 50
    draft = mx.array(np.concatenate([x[:, :, 62:63], junk], axis=2))  # one accepted, 4 not
    c = KVCache(KVQuant(4))
    c.update_and_fetch(mx.array(x[:, :, :62]), mx.array(x[:, :, :62]))
    c.update_and_fetch(draft, draft)
    c.trim(4)
    assert c.offset == 63
    c.update_and_fetch(mx.array(x[:, :, 63:70]), mx.array(x[:, :, 63:70]))
    assert np.array_equal(np.array(c.dense(64, 64)[0]), _key_groups_reference(x, 70))
    c.update_and_fetch(mx.array(x[:, :, 70:300]), mx.array(x[:, :, 70:300]))
    c.trim(200)
    assert c.offset == KEY_GROUP
    c.update_and_fetch(mx.array(x[:, :, 64:130]), mx.array(x[:, :, 64:130]))
    assert np.array_equal(np.array(c.dense(64, 64)[0]), _key_groups_reference(x, 130))


@pytest.mark.parametrize("mask", [None, "causal", "array"])
def test_attention_over_keys_per_channel(mask: str | None) -> None:
    """GQA 3:1, 4 queries after 66 cached positions (one full key group, one open): the
    quantized matmul over the per-channel keys (queries unrotated), the open group's keys read
    from the float tail (the write's recent keys), and the rotated values equals SDPA over the
    keys and values the cache holds (KVCache.dense), and is within 4-bit tolerance of
    attention over the float keys and values."""
    rng = np.random.default_rng(8)
    x = _channel_keys(70) / 4  # scores of a trained model's size: a softmax not one-hot
    q = mx.array(rng.normal(size=(1, 6, 4, 64)).astype(np.float32))
    vals = mx.array(rng.normal(size=(1, 2, 70, 64)).astype(np.float32))
    c = KVCache(KVQuant(4))
    c.update_and_fetch(mx.array(x[:, :, :66]), vals[:, :, :66])
    k, v = c.update_and_fetch(mx.array(x[:, :, 66:]), vals[:, :, 66:])
    m: object = mask
    if mask == "array":
        m = mx.array(rng.random((1, 1, 4, 70)) > 0.3) | mx.eye(4, 70, 66, dtype=mx.bool_)
    attn = Attention(6, 2)
    got = attn.attend(q, k, v, m, recent=c.recent)  # type: ignore[arg-type]
    kd, vd = c.dense(64, 64)
    want = attn.attend(q, kd, vd, m)  # type: ignore[arg-type]
    assert float(mx.abs(got - want).max()) < 1e-5
    exact = attn.attend(q, mx.array(x), vals, m)  # type: ignore[arg-type]
    assert 0 < float(mx.abs(got - exact).max()) < 0.15


def test_speculative_greedy_equals_plain_with_4bit_keys(mistral: Path) -> None:
    """Greedy decoding with prompt-lookup drafts over a 4-bit cache (drafts checked several
    positions at once across key-group boundaries, the rejected ones trimmed) gives plain
    greedy decoding's tokens over the same cache."""
    engine = make_engine(mistral, "mlx", kv_bits=4, kv_group_size=32)
    base = [int(t) for t in np.random.default_rng(9).integers(4, 384, 20)]
    prompt = base + base[:10] + base  # 50 tokens: the drafts cross position 64
    want = generate(engine, prompt, max_new_tokens=24).tokens
    got = generate(engine, prompt, max_new_tokens=24, drafter=PromptLookup(), num_draft=6)
    assert got.tokens == want


def test_keys_per_channel_chunk_reads_what_steps_read() -> None:
    """A 4-bit cache's chunk of 8 queries crossing a key-group boundary (positions 60..67, as
    a speculative check writes them) gives each query the output it gets written one position
    at a time: a query reads its own unfilled group in float (kv_cache.recent_keys), never
    the group quantized with the keys after it."""
    rng = np.random.default_rng(10)
    q, k, v = (mx.array(rng.normal(size=(1, 6 if i == 0 else 2, 68, 64)).astype(np.float32))
               for i in range(3))
    attn, quant = Attention(6, 2, is_causal=True), KVQuant(4)

    def fresh() -> tuple[tuple[mx.array, ...], tuple[mx.array, ...]]:
        return key_groups_zeros((1, 2), 256, 64, mx.float32), quant.zeros((1, 2, 256), 64,
                                                                          mx.float32)
    keys, values = fresh()
    _, keys, values = attn.over_cache(q[:, :, :60], k[:, :, :60], v[:, :, :60], keys, values,
                                      mx.array(0, mx.int32), "causal")
    chunk, _, _ = attn.over_cache(q[:, :, 60:], k[:, :, 60:], v[:, :, 60:], keys, values,
                                  mx.array(60, mx.int32), "causal", rows=68)
    keys, values = fresh()
    _, keys, values = attn.over_cache(q[:, :, :60], k[:, :, :60], v[:, :, :60], keys, values,
                                      mx.array(0, mx.int32), "causal")
    steps = []
    for p in range(60, 68):
        y, keys, values = attn.over_cache(q[:, :, p:p + 1], k[:, :, p:p + 1], v[:, :, p:p + 1],
                                          keys, values, mx.array(p, mx.int32), "causal",
                                          rows=p + 1)
        steps.append(y)
    assert float(mx.abs(chunk - mx.concatenate(steps, axis=2)).max()) < 1e-5


def test_key_blocks_equal_a_sequence_keys_per_channel() -> None:
    """Two rows written through block tables into a per-channel key pool (a prompt chunk,
    single steps across a group boundary, then a speculative chunk of 5 crossing the next),
    each row's tail its own, and a last chunk through a table that ends at the rows' last
    block): the keys read back through the table are the single-sequence buffer's, and
    attention over the blocks gives the single-sequence outputs. A row's completed blocks hold
    mx.quantize of their 64 keys at once; its open block's codes are never written (the
    writes that do not complete a group store their codes in the pool's sink block)."""
    rng = np.random.default_rng(11)
    x = [_channel_keys(200), _channel_keys(200)[:, :, ::-1].copy()]
    q = [mx.array(rng.normal(size=(1, 6, 200, 64)).astype(np.float32)) for _ in range(2)]
    v = [mx.array(rng.normal(size=(1, 2, 200, 64)).astype(np.float32)) for _ in range(2)]
    attn, quant = Attention(6, 2, is_causal=True), KVQuant(4)
    cache = BlockCache([(2, 64, 64, mx.float32)], 8, quant, rows=3)
    keys, values = cache.keys[0], cache.values[0]
    table = mx.array([[5, 2, 7, 0], [1, 3, 4, 6]], mx.int32)
    tails = mx.array([2, 0], mx.int32)
    solo = [(key_groups_zeros((1, 2), 256, 64, mx.float32), quant.zeros((1, 2, 256), 64,
                                                                         mx.float32))
            for _ in range(2)]
    off = [0, 0]
    # the last write: a table of the rows' two blocks, the group past them not in it
    for s, rows, w in [(7, [1], 4), (57, [0, 1], 4), (1, [0, 1], 4), (1, [0, 1], 4),
                       (1, [0, 1], 4), (1, [0, 1], 4), (1, [0, 1], 4), (1, [0, 1], 4),
                       (5, [0, 1], 4), (40, [0, 1], 4), (5, [0, 1], 4), (4, [0, 1], 2)]:
        t = w * BLOCK
        index = BlockIndex(table[mx.array(rows), :w],
                           mx.array([off[r] for r in rows], mx.int32), s,
                           tails[mx.array(rows)])
        pos = [off[r] + np.arange(s) for r in rows]
        m = mx.array(np.stack([np.arange(t)[None] <= p[:, None] for p in pos]))[:, None]
        y, keys, values = attn.over_cache(
            mx.concatenate([q[r][:, :, off[r]:off[r] + s] for r in rows]),
            mx.concatenate([mx.array(x[r][:, :, off[r]:off[r] + s]) for r in rows]),
            mx.concatenate([v[r][:, :, off[r]:off[r] + s] for r in rows]),
            keys, values, index.offset, m, blocks=index)  # type: ignore[arg-type]
        y = dict(zip(rows, mx.split(y, len(rows)), strict=True))
        for r in rows:
            sk, sv = solo[r]
            want, sk, sv = attn.over_cache(q[r][:, :, off[r]:off[r] + s],
                                           mx.array(x[r][:, :, off[r]:off[r] + s]),
                                           v[r][:, :, off[r]:off[r] + s], sk, sv,
                                           mx.array(off[r], mx.int32), "causal",
                                           rows=off[r] + s)
            solo[r] = (sk, sv)
            assert float(mx.abs(y[r] - want).max()) < 1e-5
            off[r] += s
        got = read_blocks(keys, BlockIndex(table[:, :w], tails=tails[:2]))
        for r in range(2):
            n = off[r]
            assert np.array_equal(np.array(key_group_read(got, n)[r:r + 1]),
                                  np.array(key_group_read(solo[r][0], n)))
            for g in range(-(-n // KEY_GROUP)):
                b = int(table[r, g])
                codes = [np.array(a[b:b + 1]) for a in keys[:3]]
                if (g + 1) * KEY_GROUP <= n:
                    want = _one_shot(x[r][:, :, g * KEY_GROUP:(g + 1) * KEY_GROUP])
                    assert all(np.array_equal(a, np.array(w_)) for a, w_ in zip(
                        codes, want, strict=True))
                else:
                    assert not any(a.any() for a in codes)


@pytest.mark.parametrize("bits", [8, 4])
def test_sliding_window_family_over_a_quantized_cache(tmp_path: Path, bits: int) -> None:
    """Gemma 2 (every other layer a sliding window of 8, attention soft-cap) with head_dim 32
    over a quantized cache: a 50-token prompt prefilled in chunks of 7 (each crossing window
    and group edges mid-chunk), of 16 and whole give the same 40 greedy tokens (decode crosses
    the 4-bit key group ending at position 64), as the batch decoder's row does beside another
    that joins later."""
    from fuselm.converter.models.builtin import build_model
    from tests.families import TEST_CONFIGS
    from tests.runtime.conftest import convert

    hf = build_model(tmp_path / "hf", "gemma2", **{**TEST_CONFIGS["gemma2"], "head_dim": 32})
    engine = make_engine(convert(hf, tmp_path / "out"), "mlx", kv_bits=bits, kv_group_size=32)
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(4, 384, n)] for n in (50, 21)]
    n = 40
    want = generate(engine, prompts[0], max_new_tokens=n, prefill_chunk=16).tokens
    for chunk in (7, 512):
        assert generate(engine, prompts[0], max_new_tokens=n, prefill_chunk=chunk).tokens == want
    other = generate(engine, prompts[1], max_new_tokens=n).tokens
    dec = BatchDecoder(engine, max_batch=2, max_context=128)
    got: dict[int, list[int]] = {}
    for step in range(n + 3):
        if step in (0, 3):
            got[dec.add(prompts[step // 3])] = []
        for slot, token in dec.step().items():
            got[slot].append(token)
    assert [got[s][:n] for s in sorted(got)] == [want, other]
