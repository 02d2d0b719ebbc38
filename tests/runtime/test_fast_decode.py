"""The compiled program (mlx_engine/decode.py: chunked prefill and the decode step) against
the node-by-node executor and onnxruntime: every prefill chunk's last logits and every step's
within rel 1e-5, 64 greedy tokens identical, for the tiny families (Qwen3: head_dim !=
hidden/heads + GQA + q/k-norm; Llama; Qwen2: GQA 4:1 + biases; Granite: multipliers; SmolLM3: a
NoPE layer; Gemma 2/3 and Phi-3: sliding windows crossed, soft-capping, sandwich norms,
LongRoPE (also across its switch, below)) and a Q4 artifact, with prompt
chunks and decode crossing the 256-position cache-capacity boundary."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from fuselm.runtime_metal.engine import make_engine
from fuselm.runtime_metal.generate import generate
from fuselm.runtime_metal.validate import rel

N_STEPS = 64


def _decode(engine, prompt: list[int], steps: int, chunk: int = 16) -> tuple[list[int], list]:  # noqa: ANN001
    """Greedy: chunked prefill (the compiled prefill program when the engine has it), then
    `steps` tokens through decode_step (the fast path) or forward (executor / onnxruntime).
    Returns tokens and the logits of each prefill chunk and each step."""
    engine.reset()
    ids = np.asarray(prompt, np.int64)
    all_logits = []  # every prefill chunk's last-position logits, then every step's
    for s in range(0, ids.size, chunk):
        logits = engine.forward(ids[None, s:s + chunk])
        all_logits.append(logits)
    tokens = [int(np.argmax(logits))]
    for _ in range(steps - 1):
        if getattr(engine, "fast", None) is not None:
            logits = np.array(engine.decode_step(mx.array(tokens[-1], mx.int32)))
        else:
            logits = engine.forward(np.array([[tokens[-1]]], np.int64))
        tokens.append(int(np.argmax(logits)))
        all_logits.append(logits)
    return tokens, all_logits


def _prompt(n: int, vocab: int = 384, seed: int = 11) -> list[int]:
    return [int(i) for i in np.random.default_rng(seed).integers(4, vocab, size=n)]


def _compare(out_dir, prompt, ort_tol: float, chunk: int = 16, **ort_options) -> None:  # noqa: ANN001
    fast = make_engine(out_dir, "mlx")
    assert fast.fast is not None and fast.describe()["decode"] == "compiled"
    assert fast.describe()["prefill"] == "compiled"
    program = make_engine(out_dir, "mlx", compiled=False)
    assert program.fast is not None and not program.fast.compiled and program.fast_prefill
    plain = make_engine(out_dir, "mlx", fast=False)
    assert plain.fast is None and str(plain.describe()["prefill"]).startswith("executor")
    ort = make_engine(out_dir, "onnxruntime", **ort_options)
    runs = {name: _decode(e, prompt, N_STEPS, chunk)
            for name, e in (("fast", fast), ("program", program), ("plain", plain), ("ort", ort))}
    want_tokens, want_logits = runs["plain"]
    for name, tol in (("fast", 1e-5), ("program", 1e-5), ("ort", ort_tol)):
        tokens, logits = runs[name]
        assert tokens == want_tokens, name
        worst = max(rel(a, b) for a, b in zip(logits, want_logits, strict=True))
        assert worst <= tol, (name, worst)
    assert fast.offset == plain.offset == len(prompt) + N_STEPS - 1


@pytest.mark.parametrize(
    "family", ["qwen3", "llama", "qwen2", "granite", "smollm3", "gemma2", "gemma3_text", "phi3"])
def test_compiled_decode_matches_executor_and_onnxruntime(family: str, family_models) -> None:  # noqa: ANN001
    _compare(family_models[family][1], _prompt(40), 1e-5)


def test_compiled_decode_q4_across_capacity_boundary(q4_artifact) -> None:  # noqa: ANN001
    # 230 + 64 positions: the cache grows past 256 during decode (a second compiled shape)
    _compare(q4_artifact, _prompt(230, seed=4), 1e-5, accuracy_level=0)


def test_compiled_prefill_q4_chunk_crosses_capacity_boundary(q4_artifact) -> None:  # noqa: ANN001
    # chunks of 24 over 270 tokens: offset 0 (the fresh "causal" variant), the chunk 240..264
    # crosses 256 (capacity 256 -> 512 inside prefill), then a 6-token tail
    _compare(q4_artifact, _prompt(270, seed=5), 1e-5, chunk=24, accuracy_level=0)


def test_pipelined_generate_equals_host_loop_and_trims_on_stop(qwen3_artifact) -> None:  # noqa: ANN001
    engine = make_engine(qwen3_artifact, "mlx")
    prompt = _prompt(20)
    device = generate(engine, prompt, max_new_tokens=24, prefill_chunk=8)
    host = generate(engine, prompt, max_new_tokens=24, prefill_chunk=8, device_sampling=False)
    ort = generate(make_engine(qwen3_artifact, "onnxruntime"), prompt, max_new_tokens=24,
                   prefill_chunk=8)
    assert device.tokens == host.tokens == ort.tokens
    assert engine.offset == len(prompt) + 23  # the last token is never fed
    stopped = generate(engine, prompt, max_new_tokens=24, eos_ids=[device.tokens[5]])
    assert stopped.tokens == device.tokens[:device.tokens.index(device.tokens[5])]
    # the token fed ahead of the stop was forgotten: the cache holds what the caller saw
    assert engine.offset == len(prompt) + len(stopped.tokens)
    cont = generate(engine, [device.tokens[len(stopped.tokens)]], max_new_tokens=4, reset=False)
    assert cont.tokens == device.tokens[len(stopped.tokens) + 1:len(stopped.tokens) + 5]


def test_device_sampling_is_seeded(qwen3_artifact) -> None:  # noqa: ANN001
    from fuselm.runtime_metal.sampling import SamplingOptions

    engine = make_engine(qwen3_artifact, "mlx")
    opts = SamplingOptions(temperature=0.9, top_k=40, top_p=0.9, seed=3)
    a = generate(engine, [5, 6, 7], max_new_tokens=16, sampling=opts, device_sampling=True)
    b = generate(engine, [5, 6, 7], max_new_tokens=16, sampling=opts, device_sampling=True)
    greedy = generate(engine, [5, 6, 7], max_new_tokens=16)
    assert a.tokens == b.tokens != greedy.tokens


def test_profiling_keeps_the_executor(qwen3_artifact) -> None:  # noqa: ANN001
    from fuselm.runtime_metal.mlx_engine.profile import Profiler

    engine = make_engine(qwen3_artifact, "mlx", profiler=Profiler())
    assert engine.fast is None and "profil" in str(engine.describe()["decode"])
    assert not engine.fast_prefill and "profil" in str(engine.describe()["prefill"])


def test_prefill_switch_and_mixed_paths(qwen3_artifact) -> None:  # noqa: ANN001
    """fast_prefill=False keeps the executor for prompts only; executor-written and
    program-written chunks share the cache buffers, so the paths mix freely."""
    prompt = _prompt(40, seed=2)
    plain = make_engine(qwen3_artifact, "mlx", fast=False)
    want_tokens, want_logits = _decode(plain, prompt, 8)
    off = make_engine(qwen3_artifact, "mlx", fast_prefill=False)
    assert off.fast is not None and not off.fast_prefill
    assert off.describe()["prefill"] == "executor (fast_prefill=False)"
    assert _decode(off, prompt, 8)[0] == want_tokens
    mixed = make_engine(qwen3_artifact, "mlx")
    mixed.reset()
    ids = np.asarray(prompt, np.int64)[None]
    mixed.forward(ids[:, :16], all_logits=True)  # all positions: the executor
    mixed.forward(ids[:, 16:32])  # the program, at offset 16
    logits = mixed.forward(ids[:, 32:], all_logits=True)[-1]  # the executor again
    assert rel(logits, want_logits[2]) <= 1e-5


def test_generation_runs_at_one_capacity_and_repeats_without_tracing(qwen3_artifact) -> None:  # noqa: ANN001
    """generate reserves prompt + new tokens before prefill: the compiled program sees one cache
    capacity for the whole generation (no growth mid-decode), so a second generation after a
    reset calls it only with shapes already traced (a benchmark's warm-up covers every run)."""
    engine = make_engine(qwen3_artifact, "mlx")
    fast = engine.fast
    assert fast is not None
    seen: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []

    def spy(fn, kind: str):  # noqa: ANN001, ANN202
        def call(tokens, offset, *kv):  # noqa: ANN001, ANN202
            seen.append((kind, tuple(tokens.shape), tuple(kv[0].shape)))
            return fn(tokens, offset, *kv)
        return call

    fast._fn, fast._fresh = spy(fast._fn, "any"), spy(fast._fresh, "fresh")
    prompt = _prompt(240, seed=6)
    first = generate(engine, prompt, max_new_tokens=40)  # 240 + 40 crosses 256
    assert {kv[2] for _, _, kv in seen} == {512}
    traced = set(seen)
    seen.clear()
    again = generate(engine, prompt, max_new_tokens=40)
    assert again.tokens == first.tokens
    assert seen and set(seen) <= traced


def test_longrope_switch_in_the_compiled_program(tmp_path) -> None:  # noqa: ANN001
    """Phi-3's LongRoPE switches to its long factors once a position reaches the original
    context (16 here): the compiled program selects them on the device; decoding across the
    switch matches the executor and onnxruntime step by step."""
    from fuselm.converter.models.builtin import build_model
    from tests.families import TEST_CONFIGS, longrope
    from tests.runtime.conftest import convert

    kw = {**TEST_CONFIGS["phi3"], "sliding_window": None,
          "original_max_position_embeddings": 16, "rope_scaling": longrope(16)}
    out = convert(build_model(tmp_path / "hf", "phi3", seed=3, tokenizer=False, **kw),
                  tmp_path / "out")
    _compare(out, _prompt(12), 1e-5, chunk=12)
