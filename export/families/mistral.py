"""Mistral (MistralForCausalLM): Llama's decoder, no biases; `sliding_window` (when set)
applies to every layer."""

from typing import Any

from fuselm.export.family import Family, register


@register("MistralForCausalLM")
class Mistral(Family):
    model_type = "mistral"

    def windows(self, hf: Any, layers: int) -> list[int | None]:
        if getattr(hf, "layer_types", None):
            return super().windows(hf, layers)
        window = getattr(hf, "sliding_window", None)
        return [int(window) if window else None] * layers
