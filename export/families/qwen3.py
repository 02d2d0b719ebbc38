"""Qwen3 (Qwen3ForCausalLM): per-head RMSNorm of q and k before RoPE (folded into FusedRoPE),
optional `attention_bias` on q/k/v/o."""

from dataclasses import replace
from typing import Any

from fuselm.export.config import DecoderSpec
from fuselm.export.family import Family, register


@register("Qwen3ForCausalLM")
class Qwen3(Family):
    model_type = "qwen3"
    test_defaults = {"tie_word_embeddings": True}  # as Qwen3-0.6B
    demo = True
    gguf_architecture = "qwen3"

    def gguf_config(self, config: dict[str, Any], tensors: Any, window: int | None,
                    keys: Any) -> None:
        config["attention_bias"] = "blk.0.attn_output.bias" in tensors
        # a window the file declares is not applied: llama.cpp's qwen3 graph reads none, and
        # transformers' GGUF loader none either (both attend in full)
        config["sliding_window"] = None
        config["use_sliding_window"] = False

    def configure(self, hf: Any, spec: DecoderSpec) -> DecoderSpec:
        bias = bool(getattr(hf, "attention_bias", False))
        return replace(spec, qkv_bias=bias, o_bias=bias, qk_norm=True)
