"""Session-cached tiny checkpoints and their exports: ours and foreign (torch.onnx of HF)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import onnx
import pytest

sys.path.insert(0, str(Path(__file__).parent))  # passes_support, passes_foreign
sys.path.insert(0, str(Path(__file__).parents[2]))  # tests.families, however pytest is run

from tests.families import TEST_CONFIGS  # noqa: E402

# Every case: perturbed norms/biases, head_dim 24 != hidden 64 / 4 heads, GQA 4:2 (TINY).
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3": ("qwen3", {}),  # q/k norms, tied LM head
    "qwen2": ("qwen2", {}),  # q/k/v biases
    "llama": ("llama", {"mlp_bias": True, "num_key_value_heads": 1}),  # gate/up bias, MQA
    "mistral": ("mistral", {"num_key_value_heads": 4}),  # MHA
}

# The families added after the move, as their foreign exports meet the passes: each with its
# suite-wide test config (TINY shapes: GQA 4:2; Gemma's head_dim 24 != 64 / 4 heads).
FAMILY_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "gemma2": ("gemma2", TEST_CONFIGS["gemma2"]),  # soft-capping, sliding layer, GeGLU
    "gemma3": ("gemma3_text", TEST_CONFIGS["gemma3_text"]),  # q/k-norm, local RoPE base
    # head_dim 16 = 64 / 4: Phi-3 validates LongRoPE's factors against hidden / heads
    "phi3-longrope": ("phi3", TEST_CONFIGS["phi3"]),  # qkv_proj, gate_up_proj, partial rotary
}

# (dynamo, opset, with_cache)
FOREIGN_FORMS: dict[str, tuple[bool, int, bool]] = {
    "dynamo18-cache": (True, 18, True),
    "dynamo18-nocache": (True, 18, False),
    "dynamo20-cache": (True, 20, True),
    "dynamo20-nocache": (True, 20, False),
    "dynamo23-cache": (True, 23, True),
    "dynamo23-nocache": (True, 23, False),
    "torchscript-cache": (False, 17, True),
    "torchscript-nocache": (False, 17, False),
}


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    from fuselm.converter.models.builtin import build_model

    cache: dict[str, Path] = {}

    def get(case: str) -> Path:
        if case not in cache:
            family, kw = {**CASES, **FAMILY_CASES}[case]
            cache[case] = build_model(tmp_path_factory.mktemp(case), family, tokenizer=False, **kw)
        return cache[case]

    return get


@pytest.fixture(scope="session")
def ours(model_dir, tmp_path_factory) -> Callable[[str], onnx.ModelProto]:  # noqa: ANN001
    from fuselm.export.onnx_export import export_model

    cache: dict[str, Path] = {}

    def get(case: str) -> onnx.ModelProto:
        if case not in cache:
            path = tmp_path_factory.mktemp(f"ours-{case}") / "raw.onnx"
            export_model(model_dir(case), path)
            cache[case] = path
        return onnx.load(str(cache[case]))

    return get


@pytest.fixture(scope="session")
def foreign(model_dir, tmp_path_factory) -> Callable[[str, str], onnx.ModelProto]:  # noqa: ANN001
    from passes_foreign import export_foreign

    cache: dict[tuple[str, str], Path] = {}

    def get(case: str, form: str) -> onnx.ModelProto:
        if (case, form) not in cache:
            dynamo, opset, with_cache = FOREIGN_FORMS[form]
            path = tmp_path_factory.mktemp(f"foreign-{case}-{form}") / "model.onnx"
            export_foreign(model_dir(case), path, dynamo=dynamo, opset=opset,
                           with_cache=with_cache)
            cache[(case, form)] = path
        return onnx.load(str(cache[(case, form)]))

    return get
