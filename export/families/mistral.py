"""Mistral (MistralForCausalLM): Llama's decoder, no biases; `sliding_window` (when set)
applies to every layer."""

from typing import Any

from fuselm.export.family import Family, register


@register("MistralForCausalLM")
class Mistral(Family):
    model_type = "mistral"
    test_defaults = {"sliding_window": None}  # transformers' default window is 4096
    # llama.cpp writes Mistral as `llama` (permuted q/k); the file's name says Mistral, as
    # transformers' own GGUF loader reads it
    gguf_architecture = "llama"
    gguf_name_marker = "mistral"
    gguf_permuted_qk = True

    def gguf_config(self, config: dict[str, Any], tensors: Any, window: int | None,
                    keys: Any) -> None:
        config["sliding_window"] = int(window) if window else None

    def windows(self, hf: Any, layers: int) -> list[int | None]:
        if getattr(hf, "layer_types", None):
            return super().windows(hf, layers)
        window = getattr(hf, "sliding_window", None)
        return [int(window) if window else None] * layers
