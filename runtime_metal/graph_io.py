"""Graph input/output names of the contract (optimum's): how past/present KV pair up."""

from __future__ import annotations

import re

PAST = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")
PRESENT = re.compile(r"^present\.(\d+)\.(key|value)$")


def present_for(past_name: str) -> str:
    return past_name.replace("past_key_values.", "present.", 1)

LOGITS = "logits"
# The LM head's own output when a collective of a sharded graph (mlx_engine/shard.py) makes
# `logits` from it: still the LM head (step.Step.is_lm_head).
LOGITS_PART = "logits.part"
