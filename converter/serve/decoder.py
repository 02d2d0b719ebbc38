"""The batch decoder `fuselm serve` drives: the runtime's BatchDecoder (runtime_metal/batch.py:
MLX decodes every active sequence in one batched step on the device; onnxruntime serves its
slots one after another each step), plus what the server reports of it — how many prompt tokens
of a request came from the prefix cache."""

from __future__ import annotations

from collections.abc import Sequence

from fuselm.runtime_metal.engine import Engine
from fuselm.runtime_metal.sampling import SamplingOptions


class ServeDecoder:
    def __init__(self, engine: Engine, max_batch: int, max_context: int,
                 prefill_chunk: int | None = None) -> None:
        from fuselm.runtime_metal.batch import BatchDecoder

        self.dec = BatchDecoder(engine, max_batch=max_batch, max_context=max_context,
                                prefill_chunk=prefill_chunk)
        self._cached: dict[int, int] = {}

    def add(self, prompt_ids: Sequence[int], sampling: SamplingOptions) -> int:
        # BatchDecoder reuses the longest cached prefix (all but the last prompt token at
        # most): what is reported.
        slot = self.dec.add(prompt_ids, sampling)
        self._cached[slot] = self.dec.slots[slot].reused
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

    def idle(self) -> None:
        """Nothing to do between requests (the scheduler's hook)."""

    def describe(self) -> dict[str, object]:
        return self.dec.describe()
