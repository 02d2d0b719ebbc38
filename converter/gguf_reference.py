"""A GGUF file as `fuselm validate`'s ground truth: HF transformers in float32 holding the
file's own dequantized weights (export/gguf/source.py reads them, q/k rows in HF order), so a
Q4 artifact imported from a Q4 GGUF is judged against the model it came from, not against an
HF checkpoint the GGUF was itself rounded from.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fuselm.converter import out_dir as out_dir_safety
from fuselm.converter.errors import UserError
from fuselm.export.config import DecoderSpec
from fuselm.export.gguf.source import GGUFCheckpoint, gguf_spec, stage


@dataclass(frozen=True)
class Reference:
    """The staged HF folder (config, tokenizer), the model's spec and the float32 model."""

    folder: Path
    spec: DecoderSpec
    model: Any  # a transformers PreTrainedModel, in eval mode


def reference_model(folder: Path, ckpt: GGUFCheckpoint) -> Any:
    """transformers' model for the staged config, in float32, with every tensor of the file;
    a tied LM head is the embedding table, as in the file."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    config = AutoConfig.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {name: ckpt.get(name) for name in ckpt.tensors}
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise UserError(f"{ckpt.root}: its tensors do not fill transformers' "
                        f"{config.architectures[0]} (missing {sorted(set(missing) - tied)[:3]}, "
                        f"unexpected {sorted(unexpected)[:3]})")
    model.tie_weights()
    return model.eval()


@contextmanager
def gguf_reference(path: str | Path, check: Callable[[DecoderSpec], None] | None = None
                   ) -> Iterator[Reference]:
    """The reference for the GGUF at `path`; its staged folder lives as long as the context.
    `check(spec)` runs before any weight is read (validate's same-model check: a refusal costs
    no dequantizing)."""
    ckpt = GGUFCheckpoint(path)
    with out_dir_safety.scratch("gguf") as folder:
        stage(ckpt, folder)
        spec = gguf_spec(folder, ckpt)
        if check is not None:
            check(spec)
        yield Reference(folder, spec, reference_model(folder, ckpt))
