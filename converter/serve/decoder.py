"""The batch decoder `fuselm serve` drives: the runtime's BatchDecoder (runtime_metal/batch.py:
MLX decodes every active sequence in one batched step on the device; onnxruntime serves its
slots one after another each step), plus what the server reports of it — how many prompt tokens
of a request came from the prefix cache — and the KV budget the scheduler admits against."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fuselm.runtime_metal.constraint import TokenConstraint
from fuselm.runtime_metal.engine import Engine
from fuselm.runtime_metal.sampling import SamplingOptions, TokenLogprobs


class ServeDecoder:
    def __init__(self, engine: Engine, max_batch: int, max_context: int,
                 prefill_chunk: int | None = None, kv_tokens: int | None = None,
                 **speculative: Any) -> None:
        """speculative: the batch decoder's drafter and num_draft (speculative decoding)."""
        from fuselm.runtime_metal.batch import BatchDecoder

        self.dec = BatchDecoder(engine, max_batch=max_batch, max_context=max_context,
                                prefill_chunk=prefill_chunk, kv_tokens=kv_tokens, **speculative)
        self.max_batch = self.dec.max_batch  # fewer than asked when the KV budget holds fewer
        self.kv_budget = self.dec.kv_budget
        self.kv_window = self.dec.kv_window
        self.kv_cost = self.dec.kv_cost
        self.kv_held = self.dec.kv_held
        self._cached: dict[int, int] = {}
        if kv_tokens is not None and self.dec.mode == "batched":
            # MLX keeps freed buffers for reuse, one per size met (every prompt length's
            # prefill scratch): under a budget that cache is capped at the KV pool's own size,
            # so the process stays at weights + pool + at most as much again.
            import mlx.core as mx

            mx.set_cache_limit(sum(a.nbytes for a in self.dec.cache.buffers()))

    @property
    def exhausted(self) -> set[int]:
        """Slots that can take no more tokens (the context or the KV pool is full)."""
        return self.dec.exhausted

    def add(self, prompt_ids: Sequence[int], sampling: SamplingOptions, *,
            top_logprobs: int | None = None, fork_of: int | None = None,
            constraint: TokenConstraint | None = None) -> int:
        """fork_of: the slot of another choice of the same request (n > 1): while its first
        token is not out yet, the new row starts from its prompt (BatchDecoder.fork).
        constraint: the row's grammar (its own; runtime_metal/constraint.py)."""
        if fork_of is not None and self.dec.forkable(fork_of, prompt_ids):
            slot = self.dec.fork(fork_of, sampling, top_logprobs=top_logprobs,
                                 constraint=constraint)
        else:
            slot = self.dec.add(prompt_ids, sampling, top_logprobs=top_logprobs,
                                constraint=constraint)
        # BatchDecoder reuses the longest cached prefix (all but the last prompt token at
        # most; a fork its whole prompt): what is reported.
        self._cached[slot] = self.dec.slots[slot].reused
        return slot

    def logprobs(self, slot: int) -> TokenLogprobs | None:
        return self.dec.logprobs(slot)

    def first_token(self, slot: int) -> int:
        """The token `add` sampled from the slot's prompt: its first, which the next step
        reports (BatchDecoder's `pending`, known once the prefill is done)."""
        token = self.dec.slots[slot].pending
        assert token is not None
        return token

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

    def memory(self) -> dict[str, int]:
        """The engine's device memory in use, for /health: MLX's allocator's active buffers
        (onnxruntime's arena shows in the process's RSS only)."""
        if self.dec.engine.name != "mlx":
            return {}
        import mlx.core as mx

        return {"mlx_active_bytes": int(mx.get_active_memory()),
                "mlx_cache_bytes": int(mx.get_cache_memory())}

    def idle(self) -> None:
        """Nothing to do between requests (the scheduler's hook)."""

    def describe(self) -> dict[str, object]:
        out = self.dec.describe()
        if self.dec.drafter is not None:
            out.update(drafter=self.dec.drafter.name, num_draft=self.dec.num_draft)
        return out
