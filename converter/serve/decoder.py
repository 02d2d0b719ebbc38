"""The batch decoder `fuselm serve` drives: the runtime's BatchDecoder (runtime_metal/batch.py:
MLX decodes every active sequence in one batched step on the device; onnxruntime serves its
slots one after another each step), plus what the server reports of it — how many prompt tokens
of a request came from the prefix cache."""

from __future__ import annotations

from collections.abc import Sequence

from fuselm.runtime_metal.engine import Engine
from fuselm.runtime_metal.sampling import SamplingOptions, TokenLogprobs


class ServeDecoder:
    def __init__(self, engine: Engine, max_batch: int, max_context: int,
                 prefill_chunk: int | None = None) -> None:
        from fuselm.runtime_metal.batch import BatchDecoder

        self.dec = BatchDecoder(engine, max_batch=max_batch, max_context=max_context,
                                prefill_chunk=prefill_chunk)
        self._cached: dict[int, int] = {}

    def add(self, prompt_ids: Sequence[int], sampling: SamplingOptions,
            top_logprobs: int | None = None, fork_of: int | None = None) -> int:
        """fork_of: the slot of another choice of the same request (n > 1): while its first
        token is not out yet, the new row starts from its prompt (BatchDecoder.fork)."""
        if fork_of is not None and self.dec.forkable(fork_of, prompt_ids):
            slot = self.dec.fork(fork_of, sampling, top_logprobs)
        else:
            slot = self.dec.add(prompt_ids, sampling, top_logprobs)
        # BatchDecoder reuses the longest cached prefix (all but the last prompt token at
        # most; a fork its whole prompt): what is reported.
        self._cached[slot] = self.dec.slots[slot].reused
        return slot

    def logprobs(self, slot: int) -> TokenLogprobs | None:
        return self.dec.logprobs(slot)

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
