"""`--calibration FILE`: the calibration text, tokenized with the checkpoint's own tokenizer,
for the activation-aware Q4 pass (passes/q4_calibration.py)."""

from __future__ import annotations

from pathlib import Path

from fuselm.converter.errors import UserError
from fuselm.passes.q4_calibration import Calibration, read_calibration

CONTEXT = 512  # tokens per forward (each chunk from an empty cache)


def load_calibration(model_dir: Path, path: str | Path) -> Calibration:
    """Read and tokenize the text (no special tokens, as `fuselm perplexity` does)."""
    from transformers import AutoTokenizer

    try:
        text = read_calibration(path)
    except ValueError as e:
        raise UserError(str(e)) from None
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ids = tuple(int(i) for i in tok.encode(text, add_special_tokens=False))
    if len(ids) < 64:
        raise UserError(
            f"--calibration {path} has {len(ids)} tokens; pass a text of at least a few hundred "
            "words")
    return Calibration(ids, CONTEXT, gram=True, source=Path(path).name)
