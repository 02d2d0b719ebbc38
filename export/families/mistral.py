"""Mistral (MistralForCausalLM): Llama's decoder, no biases, optional sliding-window attention
(honoured through the attention mask, see export/config.py `layer_windows`)."""

from typing import Any

from fuselm.export.registry import Features, register


@register("MistralForCausalLM")
def mistral(hf: Any) -> Features:
    return Features(family="mistral")
