"""Qwen2 (Qwen2ForCausalLM): biases on q/k/v (never on o_proj or the MLP)."""

from typing import Any

from fuselm.export.registry import Features, register


@register("Qwen2ForCausalLM")
def qwen2(hf: Any) -> Features:
    return Features(family="qwen2", qkv_bias=True)
