"""Qwen2 (Qwen2ForCausalLM): biases on q/k/v (never on o_proj or the MLP)."""

from dataclasses import replace
from typing import Any

from fuselm.export.config import DecoderSpec
from fuselm.export.family import Family, register


@register("Qwen2ForCausalLM")
class Qwen2(Family):
    model_type = "qwen2"

    def configure(self, hf: Any, spec: DecoderSpec) -> DecoderSpec:
        return replace(spec, qkv_bias=True)
