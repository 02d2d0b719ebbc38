"""Granite (GraniteForCausalLM): Llama's decoder with four multipliers: embeddings
(`embedding_multiplier`), each sublayer's output before its residual add
(`residual_multiplier`), the softmax scale (`attention_multiplier`), and the logits
(divided by `logits_scaling`)."""

from dataclasses import replace
from typing import Any

from fuselm.export.config import DecoderSpec
from fuselm.export.family import Family, register


@register("GraniteForCausalLM")
class Granite(Family):
    model_type = "granite"

    def configure(self, hf: Any, spec: DecoderSpec) -> DecoderSpec:
        bias = bool(getattr(hf, "attention_bias", False))
        return replace(
            spec,
            qkv_bias=bias,
            o_bias=bias,
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            embed_scale=float(hf.embedding_multiplier),
            residual_scale=float(hf.residual_multiplier),
            attention_scale=float(hf.attention_multiplier),
            logit_scale=1.0 / float(hf.logits_scaling),
        )
