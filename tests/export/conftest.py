"""Session-cached tiny checkpoints and their exports (each export traces in a few seconds)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fuselm.converter.models.builtin import build_model
from fuselm.export.onnx_export import export_model
from tests.families import TEST_CONFIGS, longrope

# id -> (family, build kwargs). Every case has perturbed norms/biases; TINY has
# head_dim 24 != hidden 64 / 4 heads. GQA ratios: kv heads 4 (1:1), 2 (2:1), 1 (4:1, MQA).
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3": ("qwen3", {}),
    "qwen3-bias-untied": ("qwen3", {"attention_bias": True, "tie_word_embeddings": False}),
    "qwen2-mqa": ("qwen2", {"num_key_value_heads": 1}),
    "llama-bias-mha": (
        "llama",
        {"attention_bias": True, "mlp_bias": True, "num_key_value_heads": 4},
    ),
    "mistral-window": ("mistral", {"sliding_window": 8}),
    "llama-linear": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "llama-dynamic": (
        "llama",
        {"max_position_embeddings": 16, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
    ),
    "llama-llama3": (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            }
        },
    ),
    "qwen3-yarn": (
        "qwen3",
        {
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 16,
            }
        },
    ),
    "llama-bf16-sharded": ("llama", {"dtype": "bfloat16", "shard_size": "100KB"}),
    "phi3": (
        "phi3",
        {**TEST_CONFIGS["phi3"], "head_dim": 24, "original_max_position_embeddings": 512,
         "rope_scaling": {"rope_type": "default", "partial_rotary_factor": 0.5}},
    ),
    # LongRoPE: the 12-token prefill uses the short factors, decoding crosses position 16
    "phi3-longrope": (
        "phi3",
        {**TEST_CONFIGS["phi3"], "original_max_position_embeddings": 16,
         "rope_scaling": longrope(16)},
    ),
}


def to_transformers4_config(model_dir: Path) -> None:
    """Rewrite config.json the way transformers 4.x wrote it (rope_theta / rope_scaling)."""
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    params = cfg.pop("rope_parameters")
    cfg["rope_theta"] = params.pop("rope_theta")
    kind = params.pop("rope_type")
    cfg["rope_scaling"] = None if kind == "default" else {"type": kind, **params}
    cfg["transformers_version"] = "4.51.0"
    path.write_text(json.dumps(cfg, indent=2))


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    cache: dict[str, Path] = {}

    def get(case: str) -> Path:
        if case not in cache:
            family, kwargs = CASES[case]
            cache[case] = build_model(tmp_path_factory.mktemp(case), family, seed=7, **kwargs)
        return cache[case]

    return get


@pytest.fixture(scope="session")
def exported(
    checkpoint: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[..., Path]:
    cache: dict[tuple[str, str | None], Path] = {}

    def get(case: str, dtype: str | None = "float32") -> Path:
        key = (case, dtype)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"onnx-{case}") / "model.onnx"
            export_model(checkpoint(case), out, dtype)
            cache[key] = out
        return cache[key]

    return get
