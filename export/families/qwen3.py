"""Qwen3 (Qwen3ForCausalLM): per-head RMSNorm of q and k before RoPE (folded into FusedRoPE),
optional `attention_bias` on q/k/v/o."""

from typing import Any

from fuselm.export.registry import Features, register


@register("Qwen3ForCausalLM")
def qwen3(hf: Any) -> Features:
    attention_bias = bool(getattr(hf, "attention_bias", False))
    return Features(family="qwen3", qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=True)
