"""The length of the common prefix of two token sequences: prompt-cache reuse (chat sessions,
batch slots, the server) and greedy agreement (validate) all measure the same thing."""

from __future__ import annotations

from collections.abc import Sequence


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
