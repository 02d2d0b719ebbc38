"""Tiny test configs of the families added after the move (export/families/): one line each,
shared by the export, runtime and passes suites. Every one keeps converter/models/builtin.py's TINY
shapes (head_dim 24 != hidden 64 / 4 heads, GQA 4:2) and exercises its family's quirks with
values large enough to matter: sliding windows shorter than the test prompts, small caps."""

from __future__ import annotations

from typing import Any


def longrope(original: int) -> dict[str, Any]:
    """Phi-3's LongRoPE over 8 rotary dims (partial_rotary_factor 0.5 of head_dim 16: Phi-3's
    config validates the factors against hidden / heads, so this config keeps them equal)."""
    return {"rope_type": "longrope", "partial_rotary_factor": 0.5,
            "original_max_position_embeddings": original,
            "short_factor": [1.0, 1.2, 1.6, 2.5], "long_factor": [1.0, 2.0, 4.0, 9.0]}


TEST_CONFIGS: dict[str, dict[str, Any]] = {
    "gemma2": {"sliding_window": 8, "query_pre_attn_scalar": 32, "attn_logit_softcapping": 0.5,
               "final_logit_softcapping": 0.5, "layer_types": ["sliding_attention",
                                                               "full_attention"]},
    "gemma3_text": {"sliding_window": 8, "query_pre_attn_scalar": 32,
                    "layer_types": ["sliding_attention", "full_attention"],
                    "rope_parameters": {
                        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                        "full_attention": {"rope_type": "linear", "factor": 2.0,
                                           "rope_theta": 1000000.0}}},
    # LongRoPE already past its switch for the runtime's 16-token prefill chunks (the export
    # suite's "phi3-longrope" crosses it mid-decode; its "phi3" has head_dim 24 != 64 / 4)
    "phi3": {"sliding_window": 12, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
             "head_dim": 16, "original_max_position_embeddings": 8, "rope_scaling": longrope(8)},
    "smollm3": {"no_rope_layers": [1, 0], "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    "granite": {"embedding_multiplier": 12.0, "residual_multiplier": 0.22,
                "attention_multiplier": 0.0078125, "logits_scaling": 8.0},
}
