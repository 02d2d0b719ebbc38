"""The onnxruntime engine's CPU lowering (ort_engine/lowering.py): contrib ops, float32
activations, a KV buffer shared by past and present. Ground truth: HF float32 and the same
artifact's plain graph (`lower=False`). Lowerable models need head_dim % 16 == 0 (onnxruntime's
CPU GroupQueryAttention): Qwen3 with head_dim 32 != 64 / 4 heads (GQA 4:2, q/k-norm, tied
embeddings), Granite (attention / residual / logit multipliers), SmolLM3 (a NoPE layer) and
Gemma 3 (a sliding window of 8 on its local layer, per-layer rotary bases) at head_dim 32, the
suite's Llama (head_dim 16 == hidden / heads). Everything else falls back to
the plain graph and says why."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from fuselm.converter.models.builtin import build_model
from fuselm.runtime_metal.engine import make_engine
from fuselm.runtime_metal.generate import generate
from fuselm.runtime_metal.validate import engine_logits, hf_logits, hf_model, rel
from tests.families import TEST_CONFIGS
from tests.runtime.conftest import convert

CHUNK = 16
LOWERED = "onnxruntime contrib ops"
H32 = {"qwen3": {"head_dim": 32}, "granite": {**TEST_CONFIGS["granite"], "head_dim": 32},
       "smollm3": {**TEST_CONFIGS["smollm3"], "head_dim": 32},
       "gemma3_text": {**TEST_CONFIGS["gemma3_text"], "head_dim": 32}}


@pytest.fixture(scope="session")
def h32_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """family -> (HF dir, float32 artifact), head_dim 32; plus "qwen3-q4": the Qwen3 one
    converted by default (`--quant q4`, float16 graph)."""
    root = tmp_path_factory.mktemp("lowering")
    out = {}
    for family, overrides in H32.items():
        hf = build_model(root / f"{family}_hf", family, seed=5, **overrides)
        out[family] = (hf, convert(hf, root / f"{family}_out"))
    hf = out["qwen3"][0]
    out["qwen3-q4"] = (hf, convert(hf, root / "qwen3_q4", dtype="float16", quant="q4"))
    return out


def _prompt(n: int = 40, vocab: int = 384) -> list[int]:
    return [int(i) for i in np.random.default_rng(11).integers(4, vocab, size=n)]


def _both(out: Path, **options: object) -> tuple[object, object]:
    lowered = make_engine(out, "onnxruntime", **options)
    plain = make_engine(out, "onnxruntime", lower=False, **options)
    assert str(lowered.describe()["lowering"]).startswith(LOWERED)
    assert plain.describe()["lowering"] == "off"
    return lowered, plain


@pytest.mark.parametrize("family", ["qwen3", "granite", "smollm3", "gemma3_text", "llama"])
def test_lowered_matches_hf_and_the_plain_graph(family: str, h32_models, family_models) -> None:  # noqa: ANN001
    hf_dir, out = (h32_models if family in H32 else family_models)[family]
    lowered, plain = _both(out)
    prompt = _prompt()
    want = hf_logits(hf_model(hf_dir), prompt)
    got = engine_logits(lowered, prompt, CHUNK)  # three chunks: prefill onto a shared cache
    assert rel(got, want) <= 1e-4
    assert rel(got, engine_logits(plain, prompt, CHUNK)) <= 1e-4
    runs = [generate(e, prompt, max_new_tokens=64, prefill_chunk=CHUNK).tokens
            for e in (lowered, plain)]
    assert runs[0] == runs[1]


def test_q4_default_convert_lowered_matches_plain(h32_models, tmp_path: Path) -> None:  # noqa: ANN001
    """The default Q4 artifact (float16 graph): lowered (float32 activations) against the plain
    float16 graph at float compute within float16's tolerance, 64 greedy tokens identical; at
    the engine's default accuracy level (int8 activations) it still decodes."""
    out = h32_models["qwen3-q4"][1]
    lowered, plain = _both(out, accuracy_level=0)
    prompt = _prompt()
    assert rel(engine_logits(lowered, prompt, CHUNK), engine_logits(plain, prompt, CHUNK)) <= 2e-2
    runs = [generate(e, prompt, max_new_tokens=64, prefill_chunk=CHUNK).tokens
            for e in (lowered, plain)]
    assert runs[0] == runs[1]
    fast = make_engine(out, "onnxruntime")
    assert fast.describe()["accuracy_level"] == 4
    assert str(fast.describe()["lowering"]).startswith(LOWERED)
    assert len(generate(fast, prompt, max_new_tokens=8).tokens) == 8
    # The tied table's rows come from its packed codes (GatherBlockQuantized, no unpacked copy)
    # while the LM head on the same codes is still one MatMulNBits, like every projection.
    model = onnx.load(str(out / "model.onnx"), load_external_data=False)
    quantized = sum(t.data_type == onnx.TensorProto.UINT4 for t in model.graph.initializer) // 2
    ops = _executed_ops(make_engine(out, "onnxruntime", profile_dir=str(tmp_path)), prompt[:8])
    assert ops["GatherBlockQuantized"] == 1 and ops["MatMulNBits"] == quantized
    assert "MatMul" not in ops and "DequantizeLinear" not in ops


def test_shared_cache_grows_trims_and_swaps_like_the_plain_one(h32_models) -> None:  # noqa: ANN001
    """Growing the buffer mid-sequence keeps what is cached; trim and swap_cache (how chat
    sessions and batch.py use the engine) mean the same as on the plain graph."""
    lowered, plain = _both(h32_models["qwen3"][1])
    ids = np.asarray(_prompt(30))[None]
    for e in (lowered, plain):
        e.reset()
        e.reserve(8)
    for s in range(0, 30, 7):  # crosses the 8-position buffer, then its growth
        assert rel(lowered.forward(ids[:, s:s + 7]), plain.forward(ids[:, s:s + 7])) <= 1e-4
    for e in (lowered, plain):
        e.trim(5)
    assert lowered.offset == plain.offset == 25
    saved = [e.swap_cache(None) for e in (lowered, plain)]
    assert lowered.offset == 0
    assert rel(lowered.forward(ids[:, :4], True), plain.forward(ids[:, :4], True)) <= 1e-4
    for e, state in zip((lowered, plain), saved, strict=True):
        e.swap_cache(state)
    assert lowered.offset == 25
    assert rel(lowered.forward(ids[:, 25:]), plain.forward(ids[:, 25:])) <= 1e-4


@pytest.mark.parametrize(("family", "reason"), [
    ("qwen3", "head_dim 24"), ("qwen2", "head_dim 24"), ("gemma2", "head_dim 24"),
    ("phi3", "LongRoPE")])
def test_what_the_lowering_does_not_cover_runs_the_plain_graph(family: str, reason: str,
                                                               family_models) -> None:  # noqa: ANN001
    out = family_models[family][1]
    engine = make_engine(out, "onnxruntime")
    assert reason in str(engine.describe()["lowering"])
    plain = make_engine(out, "onnxruntime", lower=False)
    prompt = _prompt(12)
    assert rel(engine_logits(engine, prompt, 5), engine_logits(plain, prompt, 5)) == 0.0


def test_a_lowered_graph_onnxruntime_refuses_runs_the_plain_graph(
        h32_models, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """A lowered graph the installed onnxruntime refuses at load (as 1.30 refuses Qwen3's after
    GroupQueryAttention) leaves the plain graph running, with the reason in `lowering`; asked
    for by name, exact rows (which need the lowered graph) are refused."""
    from onnx import helper, numpy_helper

    from fuselm.runtime_metal.errors import RuntimeUserError
    from fuselm.runtime_metal.ort_engine import engine as ort_engine
    from fuselm.runtime_metal.ort_engine.lowering import lower_for_cpu

    def refused(*args: object) -> object:  # the real lowering, plus a MatMul of 3x4 by 5x6
        lowered = lower_for_cpu(*args)  # type: ignore[arg-type]
        g = lowered.model.graph
        for name, shape in (("bad/a", (3, 4)), ("bad/b", (5, 6))):
            g.initializer.append(numpy_helper.from_array(np.ones(shape, np.float32), name))
        g.node.append(helper.make_node("MatMul", ["bad/a", "bad/b"], ["bad/y"]))
        g.output.append(helper.make_tensor_value_info("bad/y", onnx.TensorProto.FLOAT, None))
        return lowered

    out = h32_models["qwen3"][1]
    plain = make_engine(out, "onnxruntime", lower=False)
    monkeypatch.setattr(ort_engine, "lower_for_cpu", refused)
    engine = make_engine(out, "onnxruntime")
    assert "cannot load the lowered graph" in str(engine.describe()["lowering"])
    prompt = _prompt(12)
    assert rel(engine_logits(engine, prompt, 5), engine_logits(plain, prompt, 5)) == 0.0
    with pytest.raises(RuntimeUserError, match="exact_rows needs the lowered graph"):
        make_engine(out, "onnxruntime", exact_rows=True)


@pytest.mark.parametrize("exact_rows", [False, True])
def test_sliding_window_prefill_then_decode_past_it(exact_rows: bool, h32_models) -> None:  # noqa: ANN001
    """Gemma 3's local layer (window 8) is GroupQueryAttention with local_window_size 8, its
    global layer -1: a 20-token prefill, then 16 one-token decode steps, every position's
    logits equal transformers float32 (the window counts the query's own key, as HF's does)."""
    from fuselm.runtime_metal.artifact import read_manifest
    from fuselm.runtime_metal.ort_engine.lowering import Lowered, lower_for_cpu

    hf_dir, out = h32_models["gemma3_text"]
    lowered = lower_for_cpu(out / "model.onnx", read_manifest(out), exact_rows)
    assert isinstance(lowered, Lowered)
    windows = [next(a.i for a in n.attribute if a.name == "local_window_size")
               for n in lowered.model.graph.node if n.op_type == "GroupQueryAttention"]
    assert windows == [8, -1]
    engine = make_engine(out, "onnxruntime", exact_rows=exact_rows)
    assert str(engine.describe()["lowering"]).startswith(LOWERED)
    prompt = _prompt(36)
    want = hf_logits(hf_model(hf_dir), prompt)
    got = [engine.forward(np.asarray(prompt[:20])[None], all_logits=True)]
    got += [engine.forward(np.asarray([[t]]))[None] for t in prompt[20:]]
    assert rel(np.concatenate(got), want) <= 1e-4


def test_rope_variants_without_a_lowering_are_refused(h32_models, tmp_path) -> None:  # noqa: ANN001
    """Dynamic-NTK frequencies and partial rotary: the plain graph, with the reason."""
    from fuselm.runtime_metal.artifact import read_manifest
    from fuselm.runtime_metal.ort_engine.lowering import Lowered, lower_for_cpu

    out = h32_models["qwen3"][1]
    manifest = read_manifest(out)
    assert isinstance(lower_for_cpu(out / "model.onnx", manifest), Lowered)
    for attr, value, reason in (("dynamic_factor", 2.0, "dynamic-NTK"),
                                ("rotary_dim", 16, "partial rotary")):
        model = onnx.load(str(out / "model.onnx"), load_external_data=False)
        rope = next(n for n in model.graph.node if n.op_type == "FusedRoPE")
        next(a for a in rope.attribute if a.name == attr).CopyFrom(
            onnx.helper.make_attribute(attr, value))
        onnx.save(model, str(tmp_path / "model.onnx"))
        assert reason in str(lower_for_cpu(tmp_path / "model.onnx", manifest))


def test_default_threads_are_explicit_one_per_physical_core(h32_models) -> None:  # noqa: ANN001
    """Unless asked, a session runs one intra-op thread per physical core among the usable CPUs
    (at least one), set explicitly (onnxruntime's own default pins one thread per core); a count
    asked for is kept; the thread count does not change the logits beyond summation order."""
    import os

    from fuselm.runtime_metal.ort_engine.session import default_threads

    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    if cpus is None:
        expected = max(1, (os.cpu_count() or 1) // 2)
    else:  # the kernel's own topology: cores are (package, core id) pairs
        topo = [Path(f"/sys/devices/system/cpu/cpu{c}/topology") for c in cpus]
        if all((t / "core_id").exists() for t in topo):
            expected = len({((t / "physical_package_id").read_text(), (t / "core_id").read_text())
                            for t in topo})
        else:
            expected = max(1, len(cpus) // 2)
    assert default_threads() == expected
    assert 1 <= default_threads() <= len(cpus or [0]) or cpus is None
    out = h32_models["qwen3"][1]
    default = make_engine(out, "onnxruntime")
    two = make_engine(out, "onnxruntime", threads=2)
    assert default.describe()["threads"] == default_threads()
    assert two.describe()["threads"] == 2
    prompt = _prompt()
    assert rel(engine_logits(default, prompt, CHUNK), engine_logits(two, prompt, CHUNK)) <= 1e-5


def _executed_ops(engine: object, prompt: list[int]) -> dict[str, int]:
    """op type -> kernels run in one forward pass (onnxruntime's profile of the session)."""
    import json
    from collections import Counter

    engine.forward(np.asarray(prompt)[None])  # type: ignore[attr-defined]
    events = json.loads(Path(engine.end_profiling()).read_text())  # type: ignore[attr-defined]
    return Counter(e["args"]["op_name"] for e in events
                   if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"))


def test_symmetric_q4_runs_as_int4_without_zero_points(h32_models, tmp_path: Path) -> None:  # noqa: ANN001
    """`--sym` weights (zero points all 8) lowered to int4 codes without zero points
    (ort_int4.py): the same logits as the plain graph at float compute, the same 64 greedy
    tokens, and every projection and the tied LM head still one MatMulNBits (inlined fused
    projections included), so onnxruntime's zero-point-free kernel runs them."""
    from tests.runtime.conftest import quantized_copy

    out = quantized_copy(h32_models["qwen3"][1], tmp_path / "sym", symmetric=True)
    # codes and zero points are the uint4 initializers: two per quantized tensor
    model = onnx.load(str(out / "model.onnx"), load_external_data=False)
    quantized = sum(t.data_type == onnx.TensorProto.UINT4 for t in model.graph.initializer) // 2
    lowered, plain = _both(out, accuracy_level=0)
    assert f"{quantized} symmetric Q4 tensors as int4" in str(lowered.describe()["lowering"])
    prompt = _prompt()
    assert rel(engine_logits(lowered, prompt, CHUNK), engine_logits(plain, prompt, CHUNK)) <= 1e-4
    runs = [generate(e, prompt, max_new_tokens=64, prefill_chunk=CHUNK).tokens
            for e in (lowered, plain)]
    assert runs[0] == runs[1]
    ops = _executed_ops(make_engine(out, "onnxruntime", profile_dir=str(tmp_path)), prompt[:8])
    assert ops["MatMulNBits"] == quantized and ops["GatherBlockQuantized"] == 1
    assert "MatMul" not in ops and "DequantizeLinear" not in ops

