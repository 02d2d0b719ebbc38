"""A generation session that keeps its KV cache between calls (multi-turn chat).

Each call's prompt is the whole conversation so far; the positions whose tokens equal the
cached ones are kept, the cache is trimmed to that common prefix and only the rest is
prefilled. Comparing tokens (not text) keeps this exact even when a chat template re-renders
earlier turns differently from what was generated.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import Any

from fuselm.runtime_metal.engine import Engine
from fuselm.runtime_metal.generate import GenerationResult, iter_generate
from fuselm.runtime_metal.prefix import common_prefix


class CachedSession:
    """Generations over one engine; `cached` are the token ids whose K/V the engine holds.
    `defaults` are iter_generate options every call takes (a model's EOS set, decode, context
    length: LoadedModel.session)."""

    def __init__(self, engine: Engine, **defaults: Any) -> None:
        self.engine = engine
        self.defaults = defaults
        self.cached: list[int] = []
        self.reused = 0  # positions kept from the cache by the last call

    def reset(self) -> None:
        self.engine.reset()
        self.cached = []

    def stream(self, prompt: Sequence[int], **options: Any
               ) -> Generator[str, None, GenerationResult]:
        """`iter_generate` over the full `prompt`, prefilling only what the cache lacks."""
        ids = [int(i) for i in prompt]
        # At least the last prompt token is fed again: its logits pick the first new token.
        keep = min(common_prefix(self.cached, ids), len(ids) - 1) if ids else 0
        if keep <= 0 or self.engine.offset != len(self.cached):
            self.reset()
            keep = 0
        else:
            self.engine.trim(self.engine.offset - keep)
        self.reused = keep
        self.cached = ids[:keep]
        fed_ok = False
        try:
            result = yield from iter_generate(self.engine, ids[keep:], reset=False,
                                              cached=ids[:keep],
                                              **{**self.defaults, **options})
            fed_ok = True
        finally:
            # Interrupted mid-step (Ctrl-C), the cache's content is unknown: start over next time.
            if not fed_ok:
                self.reset()
        seq = ids + result.tokens
        self.cached = seq[:self.engine.offset]
        if len(self.cached) != self.engine.offset:  # EOS fed to the cache: unknown tail
            self.reset()
        return result
