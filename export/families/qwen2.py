"""Qwen2 (Qwen2ForCausalLM): biases on q/k/v (never on o_proj or the MLP)."""

from dataclasses import replace
from typing import Any

from fuselm.export.config import DecoderSpec
from fuselm.export.family import Family, register


@register("Qwen2ForCausalLM")
class Qwen2(Family):
    model_type = "qwen2"
    gguf_architecture = "qwen2"

    def gguf_config(self, config: dict[str, Any], tensors: Any, window: int | None,
                    keys: Any) -> None:
        # a window the file declares is not applied: llama.cpp's qwen2 graph reads none, and
        # transformers' GGUF loader none either (both attend in full)
        config["sliding_window"] = None
        config["use_sliding_window"] = False

    def configure(self, hf: Any, spec: DecoderSpec) -> DecoderSpec:
        return replace(spec, qkv_bias=True)
