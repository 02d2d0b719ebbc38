"""The weights of an HF model folder as the exporters read them: the safetensors checkpoint,
with a PEFT LoRA adapter merged in when one is given (export/lora.py)."""

from __future__ import annotations

from pathlib import Path

from fuselm.export.lora import AdaptedCheckpoint, LoraAdapter
from fuselm.export.safetensors.checkpoint import Checkpoint


def open_checkpoint(model_dir: str | Path,
                    adapter: str | Path | None = None) -> Checkpoint | AdaptedCheckpoint:
    """The checkpoint in `model_dir`; with `adapter`, that adapter checked against it and
    merged into the weights it targets as they are read."""
    base = Checkpoint(model_dir)
    if adapter is None:
        return base
    return AdaptedCheckpoint(base, LoraAdapter(adapter, base))
