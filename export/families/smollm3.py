"""SmolLM3 (SmolLM3ForCausalLM): Llama's decoder where some layers have no RoPE (NoPE):
`no_rope_layers[i]` is 1 where layer i rotates q and k, 0 where it does not."""

from dataclasses import replace
from typing import Any

from fuselm.export.config import DecoderSpec, RopeSpec
from fuselm.export.family import Family, register


@register("SmolLM3ForCausalLM")
class SmolLM3(Family):
    model_type = "smollm3"

    def configure(self, hf: Any, spec: DecoderSpec) -> DecoderSpec:
        bias = bool(getattr(hf, "attention_bias", False))
        mlp_bias = bool(getattr(hf, "mlp_bias", False))
        return replace(spec, qkv_bias=bias, o_bias=bias, mlp_bias=mlp_bias)

    def ropes(self, hf: Any, head_dim: int, layers: int) -> list[RopeSpec | None]:
        use = list(getattr(hf, "no_rope_layers", None) or [1] * layers)
        ropes = super().ropes(hf, head_dim, layers)
        return [r if use[i] else None for i, r in enumerate(ropes)]
