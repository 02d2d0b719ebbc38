"""Gemma 2 (Gemma2ForCausalLM) and Gemma 3 text (Gemma3ForCausalLM).

- RMSNorm applied as (1 + w): folded into every norm weight at export (`norm_offset`), so the
  graph holds plain RMSNormalization.
- Sandwich norms: each sublayer's output is normalized before its residual add
  (`post_attention_layernorm`, `post_feedforward_layernorm`); `pre_feedforward_layernorm` is
  the MLP's input norm.
- GeGLU with tanh GELU (`hidden_activation`), embeddings scaled by √hidden, softmax scale
  `query_pre_attn_scalar ** -0.5`, optional attention and final-logit soft-capping.
- Sliding-window and global layers alternate (`layer_types`); Gemma 3 gives each layer type
  its own RoPE (a local base for sliding layers) and normalizes q and k per head.
"""

from dataclasses import replace
from typing import Any

from fuselm.export.config import DecoderSpec, RopeSpec, rope_spec
from fuselm.export.errors import ExportError
from fuselm.export.family import LLAMA_LAYER_NAMES, Family, register


@register("Gemma2ForCausalLM")
class Gemma2(Family):
    model_type = "gemma2"
    norm_offset = 1.0
    layer_names = {
        **LLAMA_LAYER_NAMES,
        "attn_out_norm": "post_attention_layernorm",
        "post_norm": "pre_feedforward_layernorm",
        "mlp_out_norm": "post_feedforward_layernorm",
    }

    def activation(self, hf: Any) -> str:
        act = getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", None)
        if act != "gelu_pytorch_tanh":
            raise ExportError(f"hidden_activation {act!r} is not supported (gelu_pytorch_tanh is)")
        return "gelu_tanh"

    def configure(self, hf: Any, spec: DecoderSpec) -> DecoderSpec:
        if getattr(hf, "use_bidirectional_attention", False):
            raise ExportError("use_bidirectional_attention is not supported (decoders are causal)")
        bias = bool(getattr(hf, "attention_bias", False))
        return replace(
            spec,
            qkv_bias=bias,
            o_bias=bias,
            sandwich_norms=True,
            embed_scale=float(spec.hidden_size**0.5),
            attention_scale=float(hf.query_pre_attn_scalar) ** -0.5,
            attn_softcap=float(getattr(hf, "attn_logit_softcapping", None) or 0.0),
            logit_softcap=float(getattr(hf, "final_logit_softcapping", None) or 0.0),
        )


@register("Gemma3ForCausalLM")
class Gemma3(Gemma2):
    model_type = "gemma3_text"

    def configure(self, hf: Any, spec: DecoderSpec) -> DecoderSpec:
        return replace(super().configure(hf, spec), qk_norm=True)

    def ropes(self, hf: Any, head_dim: int, layers: int) -> list[RopeSpec | None]:
        params = getattr(hf, "rope_parameters", None) or {}
        types = getattr(hf, "layer_types", None) or ["full_attention"] * layers
        if not all(t in params for t in set(types)):  # one RoPE for every layer
            return super().ropes(hf, head_dim, layers)
        per_type = {t: rope_spec(hf, head_dim, t) for t in set(types)}
        return [per_type[t] for t in types]
