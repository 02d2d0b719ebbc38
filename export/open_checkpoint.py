"""The weights of an HF model folder as the exporters read them: the safetensors checkpoint;
an AWQ / GPTQ one with its packed layers read as blocks (export/quantized/); with a PEFT LoRA
adapter merged in when one is given (export/lora.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fuselm.export.config import DecoderSpec, read_raw_config
from fuselm.export.errors import ExportError
from fuselm.export.lora import AdaptedCheckpoint, LoraAdapter
from fuselm.export.quantized.checkpoint import QuantizedCheckpoint
from fuselm.export.quantized.scheme import read_scheme
from fuselm.export.safetensors.checkpoint import Checkpoint

HFCheckpoint = Checkpoint | QuantizedCheckpoint | AdaptedCheckpoint


def open_checkpoint(model_dir: str | Path, adapter: str | Path | None = None,
                    requantize: bool = False) -> HFCheckpoint:
    """The checkpoint in `model_dir`; with `adapter`, that adapter checked against it and
    merged into the weights it targets as they are read. `requantize`: the conversion asked
    for float or re-quantized weights, so a GPTQ act-order layer may be read dequantized."""
    root = Path(model_dir)
    base = Checkpoint(root)
    scheme = read_scheme(root, read_raw_config(root))
    if scheme is not None:
        if adapter is not None:
            raise ExportError(
                f"--adapter merges into float weights and {root} holds {scheme.method.upper()} "
                "4-bit weights; convert the adapter's float base model with --adapter (and "
                "--quant q4), or merge the adapter before quantizing")
        return QuantizedCheckpoint(base, scheme, dequantize_act_order=requantize)
    if adapter is None:
        return base
    return AdaptedCheckpoint(base, LoraAdapter(adapter, base))


def source_record(ckpt: HFCheckpoint, spec: DecoderSpec) -> dict[str, Any]:
    """fuselm.json's `source` facts about the checkpoint (an adapter, a quantization scheme),
    once the spec is known; an adapter that changes a tied table is refused here."""
    if isinstance(ckpt, AdaptedCheckpoint):
        ckpt.adapter.check_untied(spec.tie_word_embeddings)
        return {"adapter": ckpt.adapter.record()}
    if isinstance(ckpt, QuantizedCheckpoint):
        return {"quantized": {**ckpt.scheme.record(), "act_order_layers": len(ckpt.act_order)}}
    return {}
