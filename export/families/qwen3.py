"""Qwen3 (Qwen3ForCausalLM): per-head RMSNorm of q and k before RoPE (folded into FusedRoPE),
optional `attention_bias` on q/k/v/o."""

from dataclasses import replace
from typing import Any

from fuselm.export.config import DecoderSpec
from fuselm.export.family import Family, register


@register("Qwen3ForCausalLM")
class Qwen3(Family):
    model_type = "qwen3"

    def configure(self, hf: Any, spec: DecoderSpec) -> DecoderSpec:
        bias = bool(getattr(hf, "attention_bias", False))
        return replace(spec, qkv_bias=bias, o_bias=bias, qk_norm=True)
