"""A serial stand-in for a batched decoder: the batch API (add -> slot, step -> {slot: token},
remove) over the single-sequence generation loop, one sequence at a time.

The scheduler above drives any decoder of this shape. This one runs the oldest slot to its end
before the next starts (the others wait, holding no cache), so its output is exactly
`generate_steps`' — the same tokens `fuselm run` prints. It keeps the engine's cache after a
sequence ends: a prompt that extends what is cached (a chat's next turn) is fed only its new
tokens. Engines that can trim their cache (MLX) also reuse a shared prefix of a diverging prompt.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from fuselm.runtime_metal.engine import Engine
from fuselm.runtime_metal.errors import RuntimeUserError
from fuselm.runtime_metal.generate import generate_steps
from fuselm.runtime_metal.sampling import SamplingOptions, make_device_sampler, make_sampler


@dataclass
class _Slot:
    prompt: list[int]
    sampling: SamplingOptions
    steps: Iterator[int] | None = None
    yielded: list[int] = field(default_factory=list)
    cached_tokens: int = 0


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class SerialBatch:
    """Serves one sequence at a time behind the batch interface (`max_batch` is 1 in effect)."""

    batched = False

    def __init__(self, engine: Engine, max_context: int, prefill_chunk: int = 512) -> None:
        self.engine = engine
        self.max_context = max_context
        self.prefill_chunk = prefill_chunk
        self._slots: dict[int, _Slot] = {}
        self._ids = itertools.count()
        self._cached: list[int] = []  # the token ids whose K/V the engine's cache holds now
        engine.reset()

    def add(self, prompt_ids: Sequence[int], sampling: SamplingOptions) -> int:
        if not len(prompt_ids):
            raise RuntimeUserError("the prompt is empty; give at least one token")
        if len(prompt_ids) >= self.max_context:
            raise RuntimeUserError(f"the prompt has {len(prompt_ids)} tokens; the context is "
                                   f"{self.max_context}")
        sampling.validate()
        slot = next(self._ids)
        self._slots[slot] = _Slot([int(i) for i in prompt_ids], sampling)
        return slot

    def cached_tokens(self, slot: int) -> int:
        """Prompt tokens of `slot` taken from the cache instead of computed (0 until it starts)."""
        return self._slots[slot].cached_tokens

    def step(self) -> dict[int, int]:
        """One new token for the running slot (the oldest); {} when no slot is left."""
        if not self._slots:
            return {}
        slot = next(iter(self._slots))
        s = self._slots[slot]
        if s.steps is None:
            s.steps = self._start(s)
        token = next(s.steps, None)
        if token is None:  # the context is full: the scheduler should have removed it
            self.remove(slot)
            return {}
        s.yielded.append(token)
        return {slot: token}

    def remove(self, slot: int) -> None:
        s = self._slots.pop(slot, None)
        if s is None or s.steps is None:
            return
        s.steps.close()  # the MLX loop trims the token it fed ahead
        # The loop feeds each token before yielding the next, so the last one is never cached.
        self._cached = s.prompt + s.yielded[:-1]
        if self.engine.offset != len(self._cached):  # never trust a cache we cannot account for
            self.engine.reset()
            self._cached = []

    def _start(self, s: _Slot) -> Iterator[int]:
        # Reuse what the cache holds in common with this prompt; at least one token is fed.
        keep = min(common_prefix(self._cached, s.prompt), len(s.prompt) - 1)
        trim = getattr(self.engine, "trim", None)
        if keep < len(self._cached) and (trim is None or keep == 0):
            keep = 0
        if keep == 0:
            self.engine.reset()
        elif keep < len(self._cached):
            trim(len(self._cached) - keep)  # type: ignore[misc]
        self._cached = []  # from here the cache is in flux until `remove`
        s.cached_tokens = keep
        opts = s.sampling
        device = None
        if hasattr(self.engine, "decode_step") and opts.temperature == 0:
            device = make_device_sampler(opts)  # greedy: the same tokens, pipelined on device
        return generate_steps(self.engine, s.prompt[keep:],
                              max_new_tokens=self.max_context - len(s.prompt),
                              sampler=make_sampler(opts), prefill_chunk=self.prefill_chunk,
                              device_sampler=device)

    def reset(self) -> None:
        """Drop every slot and the cache (after an engine failure)."""
        for s in self._slots.values():
            if s.steps is not None:
                s.steps.close()
        self._slots.clear()
        self._cached = []
        self.engine.reset()
