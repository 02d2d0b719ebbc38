"""The calibration text of the activation-aware Q4 pass (passes/quant/q4_calibration.py), tokenized
with the checkpoint's own tokenizer: `--calibration FILE` (error feedback, GPTQ-style), or by
default the shipped passes/calibration.txt (all of it, about 1,700 tokens: error feedback on
the LM head, the importance-weighted search for every other weight; q4_calibration.HEAD_ROLES
says why).
`--no-calibration`, or a checkpoint without a tokenizer, gives the data-free quantizer."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from fuselm.converter.errors import UserError
from fuselm.export.config import DecoderSpec
from fuselm.passes.quant.q4_calibration import HEAD_ROLES, Calibration, read_calibration

CONTEXT = 512  # tokens per forward (each chunk from an empty cache)
BUILTIN_FILE = "calibration.txt"
# Above this many linear weights the default stays data-free: the forward and the 32/64 choice
# scale with the weights (Qwen3-0.6B: +12 s wall, +29 s CPU on 2 cores), and an 8B model's
# default conversion on a 2-core machine went past 10 minutes with them (BENCHMARKS.md
# 'Convert time and memory').
# Quantization hurts small models most; `--calibration FILE` still calibrates any size.
BUILTIN_MAX_WEIGHTS = 2_000_000_000


def linear_weights(spec: DecoderSpec) -> int:
    """Weights of the projections and the LM head (what the default calibration weighs)."""
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    layer = spec.hidden_size * (2 * q + 2 * kv) + 3 * spec.hidden_size * spec.intermediate_size
    return spec.num_layers * layer + spec.vocab_size * spec.hidden_size


def builtin_calibration(model_dir: Path, spec: DecoderSpec | None = None) -> Calibration | None:
    """The default calibration: the shipped text through the checkpoint's tokenizer, error
    feedback on the LM head. None when the checkpoint has no tokenizer files or (given `spec`)
    more than BUILTIN_MAX_WEIGHTS linear weights: data-free then."""
    if spec is not None and linear_weights(spec) > BUILTIN_MAX_WEIGHTS:
        return None
    if not any((Path(model_dir) / n).is_file()
               for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    text = (resources.files("fuselm.passes") / BUILTIN_FILE).read_text(encoding="utf-8")
    ids = _tokenize(model_dir, text)
    if len(ids) < 64:
        return None
    return Calibration(ids, CONTEXT, gram=True, source=f"{BUILTIN_FILE} (built-in)",
                       feedback_roles=HEAD_ROLES)


def _tokenize(model_dir: Path, text: str) -> tuple[int, ...]:
    """No special tokens added, as `fuselm perplexity` does. A tokenizer.json is read with the
    `tokenizers` library itself (what transformers' fast tokenizers wrap): importing
    transformers' AutoTokenizer imports torch, +290 MB at the conversion's peak (the GGUF
    builder's conversion stays torch-free: BENCHMARKS.md 'Convert time and memory')."""
    if (Path(model_dir) / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
        return tuple(tok.encode(text, add_special_tokens=False).ids)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    return tuple(int(i) for i in tok.encode(text, add_special_tokens=False))


def load_calibration(model_dir: Path, path: str | Path) -> Calibration:
    """Read and tokenize the text (no special tokens, as `fuselm perplexity` does)."""
    try:
        text = read_calibration(path)
    except ValueError as e:
        raise UserError(str(e)) from None
    ids = _tokenize(model_dir, text)
    if len(ids) < 64:
        raise UserError(
            f"--calibration {path} has {len(ids)} tokens; pass a text of at least a few hundred "
            "words")
    return Calibration(ids, CONTEXT, gram=True, source=Path(path).name)
