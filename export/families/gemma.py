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
    gguf_architecture = "gemma2"
    # llama.cpp's names of the sandwich norms: its ffn_norm is Gemma's pre-feedforward norm
    gguf_layer_names = {
        "post_attention_layernorm.weight": "post_attention_norm.weight",
        "pre_feedforward_layernorm.weight": "ffn_norm.weight",
        "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    }

    def gguf_config(self, config: dict[str, Any], tensors: Any, window: int | None,
                    keys: Any) -> None:
        """Gemma 2 as llama.cpp reads its file (llama-model.cpp, LLM_ARCH_GEMMA2): every other
        layer slides, layer 0 first, over the file's window (4096 when it states none); the
        softmax scale as for Gemma 3 (the 27B model has 46 layers here); attention and final
        logits always soft-capped, by the file's caps or llama.cpp's defaults 50 and 30."""
        _gguf_gemma(config, big_layers=46)
        config["sliding_window"] = window or 4096
        config["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention"
                                 for i in range(int(config["num_hidden_layers"]))]
        config["attn_logit_softcapping"] = keys.number("attn_logit_softcapping", 50.0)
        config["final_logit_softcapping"] = keys.number("final_logit_softcapping", 30.0)

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
    gguf_architecture = "gemma3"

    def gguf_config(self, config: dict[str, Any], tensors: Any, window: int | None,
                    keys: Any) -> None:
        """Gemma 3 as llama.cpp reads its file (src/models/gemma3.cpp), which states less than
        the HF config: with a window, layer i slides unless `attention.sliding_window_pattern`
        (a period, default 6, or one flag per layer) makes it global; sliding layers rotate
        with base `rope.freq_base_swa` (default 10000), global ones with `rope.freq_base` and
        the file's scaling; the softmax scale is head_dim ** -0.5 except on the 62-layer
        (27B) model (`_gguf_gemma`); final logits are soft-capped when the file sets
        `final_logit_softcapping`."""
        layers = int(config["num_hidden_layers"])
        _gguf_gemma(config, big_layers=62)
        config["sliding_window"] = window
        config["layer_types"] = (_gguf_layer_types(keys, layers) if window
                                 else ["full_attention"] * layers)
        local = keys.number("rope.freq_base_swa", 10000.0)
        config["rope_parameters"] = {  # per layer type, as transformers 5.x writes Gemma 3's
            "full_attention": config["rope_parameters"],
            "sliding_attention": {"rope_type": "default", "rope_theta": local}}
        config["rope_local_base_freq"] = local  # transformers 4.x
        config["final_logit_softcapping"] = keys.number("final_logit_softcapping")
        config["attn_logit_softcapping"] = None  # llama.cpp's Gemma 3 has none

    def configure(self, hf: Any, spec: DecoderSpec) -> DecoderSpec:
        return replace(super().configure(hf, spec), qk_norm=True)

    def ropes(self, hf: Any, head_dim: int, layers: int) -> list[RopeSpec | None]:
        params = getattr(hf, "rope_parameters", None) or {}
        types = getattr(hf, "layer_types", None) or ["full_attention"] * layers
        if not all(t in params for t in set(types)):  # one RoPE for every layer
            return super().ropes(hf, head_dim, layers)
        per_type = {t: rope_spec(hf, head_dim, t) for t in set(types)}
        return [per_type[t] for t in types]


def _gguf_gemma(config: dict[str, Any], big_layers: int) -> None:
    """What llama.cpp fixes for every Gemma file: tanh GELU, and the softmax scale head_dim **
    -0.5 except on the 27B model, which it tells by its layer count (`big_layers`): hidden /
    heads there (gemma_pytorch's query_pre_attn_scalar)."""
    del config["hidden_act"]
    config["hidden_activation"] = "gelu_pytorch_tanh"
    config["query_pre_attn_scalar"] = (config["hidden_size"] // config["num_attention_heads"]
                                       if config["num_hidden_layers"] == big_layers
                                       else config["head_dim"])


def _gguf_layer_types(keys: Any, layers: int) -> list[str]:
    """llama.cpp's `load_swa_pattern(ml, 6)` / `set_swa_pattern`: a flag per layer, or a
    period n where layer i slides when i % n < n - 1 (n = 0: every layer slides)."""
    key = "attention.sliding_window_pattern"
    pattern = keys.value(key)
    if pattern is None:
        pattern = 6
    if isinstance(pattern, list):
        if len(pattern) != layers or any(v not in (0, 1) or isinstance(v, float)
                                         for v in pattern):
            raise keys.wrong(key, pattern, f"a period or {layers} flags (one per layer)")
        sliding = [bool(v) for v in pattern]
    elif isinstance(pattern, int) and not isinstance(pattern, bool) and pattern >= 0:
        sliding = [pattern == 0 or i % pattern < pattern - 1 for i in range(layers)]
    else:
        raise keys.wrong(key, pattern, f"a period >= 0 or {layers} flags (one per layer)")
    return ["sliding_attention" if s else "full_attention" for s in sliding]
