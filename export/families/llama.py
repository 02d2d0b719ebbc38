"""Llama (LlamaForCausalLM): optional biases on attention (`attention_bias`) and on the MLP
(`mlp_bias`)."""

from typing import Any

from fuselm.export.registry import Features, register


@register("LlamaForCausalLM")
def llama(hf: Any) -> Features:
    attention_bias = bool(getattr(hf, "attention_bias", False))
    return Features(
        family="llama",
        qkv_bias=attention_bias,
        o_bias=attention_bias,
        mlp_bias=bool(getattr(hf, "mlp_bias", False)),
    )
