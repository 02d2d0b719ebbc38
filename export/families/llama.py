"""Llama (LlamaForCausalLM): the base decoder, with optional biases on attention
(`attention_bias`) and on the MLP (`mlp_bias`)."""

from dataclasses import replace
from typing import Any

from fuselm.export.config import DecoderSpec
from fuselm.export.family import Family, register


@register("LlamaForCausalLM")
class Llama(Family):
    model_type = "llama"
    gguf_architecture = "llama"
    gguf_permuted_qk = True

    def gguf_config(self, config: dict[str, Any], tensors: Any, window: int | None,
                    keys: Any) -> None:
        config["attention_bias"] = "blk.0.attn_q.bias" in tensors
        config["mlp_bias"] = "blk.0.ffn_up.bias" in tensors
        super().gguf_config(config, tensors, window, keys)

    def configure(self, hf: Any, spec: DecoderSpec) -> DecoderSpec:
        bias = bool(getattr(hf, "attention_bias", False))
        mlp_bias = bool(getattr(hf, "mlp_bias", False))
        return replace(spec, qkv_bias=bias, o_bias=bias, mlp_bias=mlp_bias)
