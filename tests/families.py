"""Tiny test configs of the families added after the move (export/families/): one line each,
shared by the export, runtime and passes suites. Every one keeps converter/builtin.py's TINY
shapes (head_dim 24 != hidden 64 / 4 heads, GQA 4:2) and exercises its family's quirks with
values large enough to matter: sliding windows shorter than the test prompts, small caps."""

from __future__ import annotations

from typing import Any

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
    "phi3": {"sliding_window": 12, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
             "rope_scaling": {"rope_type": "default", "partial_rotary_factor": 0.5}},
    "smollm3": {"no_rope_layers": [1, 0], "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    "granite": {"embedding_multiplier": 12.0, "residual_multiplier": 0.22,
                "attention_multiplier": 0.0078125, "logits_scaling": 8.0},
}
