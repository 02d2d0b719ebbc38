"""Built-in random-weight checkpoints: real HF model directories made from a config, no download.

The README's demo and every test build their models here. HF's init leaves norm weights at 1
and biases at 0, which hides swapped or dropped tensors, so both are perturbed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fuselm.export.registry import demo_family, family_named, model_types

FAMILIES = model_types()  # every registered family's transformers model_type

# Tiny shapes; head_dim != hidden / heads and GQA on by default (the seed's step-10 bug hides
# when head_dim == hidden / heads).
TINY: dict[str, Any] = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=24,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)

# Qwen3-0.6B's shapes, for benchmarks.
QWEN3_0_6B: dict[str, Any] = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    rope_theta=1000000.0,
)

LLAMA_3_2_1B: dict[str, Any] = dict(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    rope_theta=500000.0,
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = (
    "fuselm turns Hugging Face decoder models into fused ONNX graphs and runs them with MLX. "
    "The quick brown fox jumps over the lazy dog. Hello world, hello metal, hello onnx. "
    "Rotary embeddings rotate queries and keys; grouped query attention shares keys and values. "
    "0123456789 + - * / = ( ) [ ] { } < > , . ; : ! ? ' \" "
)


def _config(family: str, overrides: dict[str, Any]):  # noqa: ANN202 - a transformers config
    import transformers

    cls = transformers.CONFIG_MAPPING[family]
    args = {**TINY, "tie_word_embeddings": False, **family_named(family).test_defaults,
            **overrides}
    rope_keys = ("rope_theta", "rope_scaling")
    rope = {k: args.pop(k) for k in rope_keys if k in args}
    config = cls(**args)
    # transformers 5.x keeps RoPE in `rope_parameters`; set it as the library would.
    params = dict(getattr(config, "rope_parameters", None) or {})
    if "rope_theta" in rope:
        params["rope_theta"] = rope["rope_theta"]
    if rope.get("rope_scaling"):
        params.update(rope["rope_scaling"])
        params.setdefault("rope_type", rope["rope_scaling"].get("rope_type", "default"))
    if params and not any(isinstance(v, dict) for v in params.values()):  # not per layer type
        params.setdefault("rope_type", "default")
        params.setdefault("rope_theta", 10000.0)
        config.rope_parameters = params
    config.bos_token_id = 1
    config.eos_token_id = 2
    return config


def build_tokenizer(out_dir: Path, vocab_size: int) -> None:
    """Train a tiny byte-level BPE and save it as an HF tokenizer with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))


def build_model(
    out_dir: str | Path,
    family: str | None = None,
    *,
    seed: int = 0,
    dtype: str = "float32",
    shard_size: str | None = None,
    tokenizer: bool = True,
    perturb: bool = True,
    **overrides: Any,
) -> Path:
    """Write a seeded random-weight HF checkpoint (config.json + safetensors) to `out_dir`.

    `overrides` are config fields (e.g. num_key_value_heads=1, attention_bias=True,
    rope_scaling={...}); `shard_size` (e.g. "200KB") writes a sharded checkpoint with
    model.safetensors.index.json.
    """
    import torch
    import transformers

    family = family or demo_family()
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose from {', '.join(FAMILIES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = _config(family, dict(overrides))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if perturb:
        gen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
                elif name.endswith(".bias"):
                    p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    model = model.to(getattr(torch, dtype))
    kwargs: dict[str, Any] = {}
    if shard_size:
        kwargs["max_shard_size"] = shard_size
    model.save_pretrained(str(out), **kwargs)
    gen_config = {
        "bos_token_id": 1,
        "eos_token_id": [2, 3],
        "do_sample": False,
        "max_new_tokens": 64,
    }
    (out / "generation_config.json").write_text(json.dumps(gen_config, indent=2))
    if tokenizer:
        build_tokenizer(out, config.vocab_size)
    return out
