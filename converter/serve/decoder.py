"""The batch decoder `fuselm serve` drives: the runtime's BatchDecoder (runtime_metal/batch.py:
MLX decodes every active sequence in one batched step on the device; onnxruntime serves its
slots one after another each step), plus what the server reports of it — how many prompt tokens
of a request came from the prefix cache."""

from __future__ import annotations

from collections.abc import Sequence

from fuselm.runtime_metal.engine import Engine
from fuselm.runtime_metal.prefix import common_prefix
from fuselm.runtime_metal.sampling import SamplingOptions


class ServeDecoder:
    def __init__(self, engine: Engine, max_batch: int, max_context: int,
                 prefill_chunk: int | None = None) -> None:
        from fuselm.runtime_metal.batch import BatchDecoder

        self.dec = BatchDecoder(engine, max_batch=max_batch, max_context=max_context,
                                prefill_chunk=prefill_chunk)
        self._cached: dict[int, int] = {}

    def add(self, prompt_ids: Sequence[int], sampling: SamplingOptions) -> int:
        # A free slot keeps the tokens of its last sequence; BatchDecoder reuses the longest
        # shared prefix (all but the last prompt token at most), which is what is reported.
        before = [None if s.active else list(s.cached) for s in self.dec.slots]
        slot = self.dec.add(prompt_ids, sampling)
        self._cached[slot] = min(common_prefix(before[slot] or [], prompt_ids),
                                 len(prompt_ids) - 1)
        return slot

    def cached_tokens(self, slot: int) -> int:
        return self._cached.get(slot, 0)

    def step(self) -> dict[int, int]:
        return self.dec.step()

    def remove(self, slot: int) -> None:
        self._cached.pop(slot, None)
        self.dec.remove(slot)

    def reset(self) -> None:
        for slot in self.dec.active:
            self.remove(slot)

    def describe(self) -> dict[str, object]:
        return self.dec.describe()
