"""The batch decoder `fuselm serve` drives: the runtime's BatchDecoder (runtime_metal/batch.py:
MLX decodes every active sequence in one batched step on the device; onnxruntime serves its
slots one after another each step), plus what the server reports of it — how many prompt tokens
of a request came from the prefix cache."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fuselm.runtime_metal.engine import Engine
from fuselm.runtime_metal.sampling import SamplingOptions


class ServeDecoder:
    def __init__(self, engine: Engine, max_batch: int, max_context: int,
                 prefill_chunk: int | None = None, **speculative: Any) -> None:
        """speculative: the batch decoder's drafter and num_draft (speculative decoding)."""
        from fuselm.runtime_metal.batch import BatchDecoder

        self.dec = BatchDecoder(engine, max_batch=max_batch, max_context=max_context,
                                prefill_chunk=prefill_chunk, **speculative)
        self._cached: dict[int, int] = {}

    def add(self, prompt_ids: Sequence[int], sampling: SamplingOptions) -> int:
        # BatchDecoder reuses the longest cached prefix (all but the last prompt token at
        # most): what is reported.
        slot = self.dec.add(prompt_ids, sampling)
        self._cached[slot] = self.dec.slots[slot].reused
        return slot

    def cached_tokens(self, slot: int) -> int:
        return self._cached.get(slot, 0)

    def step(self) -> dict[int, list[int]]:
        return self.dec.step_tokens()

    def remove(self, slot: int) -> None:
        self._cached.pop(slot, None)
        self.dec.remove(slot)

    def reset(self) -> None:
        for slot in self.dec.active:
            self.remove(slot)

    def describe(self) -> dict[str, object]:
        out = self.dec.describe()
        if self.dec.drafter is not None:
            out.update(drafter=self.dec.drafter.name, num_draft=self.dec.num_draft)
        return out
