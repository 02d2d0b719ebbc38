"""The quantized KV cache (kv_cache.KVQuant, `--kv-bits` / `--kv-group-size`): the stored
triples and their bytes per token, attention over them against attention over their
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
from fuselm.runtime_metal.engine import make_engine
from fuselm.runtime_metal.errors import RuntimeUserError
from fuselm.runtime_metal.generate import generate
from fuselm.runtime_metal.kv_cache import (
    KVCache,
    KVQuant,
    dequantized,
    rotate,
    stored_values,
    unrotate,
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
    (-46.9 %); 4 bits: 36 (-71.9 %)."""
    rows = mx.random.normal((1, 3, 300, 64)).astype(mx.float16)
    plain, quant = KVCache(), KVCache(KVQuant(bits))
    for c in (plain, quant):
        c.update_and_fetch(rows, rows)
    per_value = quant.nbytes / plain.nbytes * 2
    assert per_value == KVQuant(bits).bytes_per_value(mx.float16)
    assert 1 - quant.nbytes / plain.nbytes >= saved


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
    row is within the same distance (the rotation keeps lengths)."""
    rng = np.random.default_rng(0)
    first, second = (mx.array(rng.normal(size=(1, 2, n, 32)).astype(np.float32))
                     for n in (5, 1))
    c = KVCache(KVQuant(bits, 32))
    c.update_and_fetch(first, first)
    keys, _ = c.update_and_fetch(second, second)
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
    70-token prefix by reference (a whole block and a copied partial one), give each prompt's
    solo greedy tokens over the single-sequence quantized cache."""
    engine = make_engine(mistral, "mlx", kv_bits=bits, kv_group_size=32)
    base = [int(t) for t in np.random.default_rng(3).integers(4, 384, 70)]
    prompts = [base + [5, 6], base + [7, 8, 9]]
    want = [generate(engine, p, max_new_tokens=N).tokens for p in prompts]
    dec = BatchDecoder(engine, max_batch=2, max_context=160)
    assert dec.mode == "batched" and dec.cache.quant == KVQuant(bits, 32)
    slots = [dec.add(p) for p in prompts]
    assert dec.slots[slots[1]].reused == 70
    got: dict[int, list[int]] = {s: [] for s in slots}
    for _ in range(N):
        for slot, token in dec.step().items():
            got[slot].append(token)
    assert [got[s] for s in slots] == want


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
