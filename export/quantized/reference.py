"""The float32 reference of an AWQ / GPTQ folder: HF transformers' model of its config with the
checkpoint's own weights dequantized ((q - z)·s in float32) — what fuselm's import computes,
and what `fuselm validate` measures it against. (transformers itself runs such a folder only
through gptqmodel / autoawq kernels, which fuselm does not need.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fuselm.export.errors import ExportError
from fuselm.export.quantized.checkpoint import QuantizedCheckpoint


def dequantized_model(ckpt: QuantizedCheckpoint) -> Any:
    """The transformers model (float32, eval mode) holding `ckpt`'s dequantized weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(Path(ckpt.root)))
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights below are floats
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {name: torch.from_numpy(ckpt.array(name)).float() for name in ckpt.tensors
             if not name.endswith("rotary_emb.inv_freq")}
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    missing = [m for m in missing if not (tied and m == "lm_head.weight")]
    if missing or unexpected:
        raise ExportError(f"{ckpt.root}: its tensors do not fit its config (missing "
                          f"{missing[:3]}, unexpected {unexpected[:3]})")
    return model.eval()
