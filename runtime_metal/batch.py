"""Batched decode: several sequences on one engine, each with its own position and cache length;
sequences join (prefill into a free slot) and leave between steps.

    dec = BatchDecoder(engine, max_batch=8, max_context=4096)
    a = dec.add(prompt_ids, SamplingOptions())   # -> slot
    while ...:
        for slot, token in dec.step().items(): ...  # one new token per active slot
    dec.remove(a)                                  # its cached tokens stay for prefix reuse

`step()` reports a slot's first token (sampled from its prompt's logits) on the first step after
`add`, then one token per step, the tokens `generate` yields for the same prompt. Sampling is the
host sampler (sampling.make_sampler, seeded per slot), so temperature 0 gives generate's greedy
tokens; greedy rows are picked on the device (one argmax for the batch).

Prefix reuse: a freed slot keeps its cached tokens. `add` picks the free slot whose tokens share
the longest prefix with the new prompt and prefills only the rest (at least the last prompt
token is fed again, for its logits).

Two ways to run, chosen per engine (`mode`):
- "batched" (MLX with the compiled program): one KV cache of [max_batch, kv_heads, capacity,
  head_dim] per layer; each step runs the program once over every row (a fixed shape: one
  compiled trace), with one offset per row for RoPE, the cache write and the mask. Rows not in
  use are fed a dummy token at their length, a position nothing reads and the next write
  overwrites. A prompt is prefilled through the engine's own single-sequence path (chunked,
  MLX's fused causal attention) into a scratch cache, then copied into its row.
- "rows" (onnxruntime on its lowered graph: ort_engine/row_batch.py): one KV buffer per layer
  with a row per slot; each slot's cache state is its row, so a prompt is prefilled as in
  "sequential", and a step runs the fed rows together, each at its own length.
- "sequential" (onnxruntime's plain graph, or MLX when the program is refused): each slot owns
  a cache state (Engine.swap_cache) and a step feeds the slots one after another.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from fuselm.runtime_metal.engine import Engine
from fuselm.runtime_metal.errors import RuntimeUserError
from fuselm.runtime_metal.generate import prefill
from fuselm.runtime_metal.kv_cache import KVCache
from fuselm.runtime_metal.prefix import common_prefix as _common
from fuselm.runtime_metal.sampling import Sampler, SamplingOptions, make_sampler


@dataclass
class _Slot:
    cached: list[int] = field(default_factory=list)  # token ids whose K/V the cache holds
    pending: int | None = None  # sampled, not yet fed
    reported: bool = True  # `pending` was already handed to the caller
    active: bool = False
    sampler: Sampler | None = None
    greedy: bool = True
    state: object = None  # sequential mode: the slot's engine cache state




class BatchDecoder:
    def __init__(self, engine: Engine, max_batch: int, max_context: int,
                 prefill_chunk: int | None = None, batched: bool | None = None) -> None:
        """batched: None = the batched program when the engine has it; False = sequential."""
        if max_batch < 1 or max_context < 2:
            raise RuntimeUserError("max_batch must be >= 1 and max_context >= 2")
        self.engine = engine
        self.max_batch = max_batch
        self.max_context = max_context
        self.prefill_chunk = prefill_chunk
        self.slots = [_Slot() for _ in range(max_batch)]
        self.exhausted: set[int] = set()  # slots that reached max_context (no more tokens)
        self.reused_tokens = 0  # prompt tokens not prefilled again (prefix reuse)
        # Room for max_context positions plus the dummy write of an idle row at its length.
        self.capacity = -(-(max_context + 1) // KVCache.step) * KVCache.step
        program = engine.batch_program()
        if batched and program is None:
            raise RuntimeUserError(
                f"engine {engine.name!r} has no batched program here; use batched=None")
        self.mode = "batched" if program is not None and batched is not False else "sequential"
        make_rows = getattr(engine, "row_batch", None)  # onnxruntime's
        self._rows = make_rows(max_batch, self.capacity) if (
            make_rows and self.mode == "sequential" and batched is not False) else None
        if self._rows is not None:
            self.mode = "rows"
            for i, s in enumerate(self.slots):
                s.state = self._rows.state(i)
        self.caches: list[KVCache] = []
        self._spans: dict[int, mx.array] = {}
        self._span_step = 0
        if self.mode == "batched":
            assert program is not None
            fn, layout, self._span_step = program
            for hk, dk, dv, dtype in layout:
                c = KVCache()
                c.allocate(max_batch, hk, dk, dv, dtype, self.capacity)
                self.caches.append(c)
            self._fn = fn

    # ---- slots ---------------------------------------------------------------------------

    @property
    def active(self) -> list[int]:
        return [i for i, s in enumerate(self.slots) if s.active]

    def length(self, slot: int) -> int:
        """Positions cached for `slot`."""
        return len(self.slots[slot].cached)

    def remove(self, slot: int) -> None:
        """The sequence leaves; its cached tokens stay for a later prompt that shares them."""
        s = self.slots[slot]
        s.active, s.pending, s.reported, s.sampler = False, None, True, None
        self.exhausted.discard(slot)

    def add(self, prompt: Sequence[int], sampling: SamplingOptions | None = None) -> int:
        """Prefill `prompt` into a free slot; its first token comes with the next step()."""
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise RuntimeUserError("the prompt is empty; give at least one token")
        if len(prompt) >= self.max_context:
            raise RuntimeUserError(
                f"the prompt has {len(prompt)} tokens but the batch's context is "
                f"{self.max_context}; shorten the prompt or raise max_context")
        free = [i for i, s in enumerate(self.slots) if not s.active]
        if not free:
            raise RuntimeUserError(
                f"all {self.max_batch} slots are busy; remove a finished sequence first")
        slot = max(free, key=lambda i: (_common(self.slots[i].cached, prompt), -i))
        s = self.slots[slot]
        keep = min(_common(s.cached, prompt), len(prompt) - 1)
        opts = sampling or SamplingOptions()
        logits = self._prefill(slot, prompt, keep)
        self.reused_tokens += keep
        s.cached = list(prompt)
        s.sampler = make_sampler(opts)
        s.greedy = opts.temperature == 0 and opts.repetition_penalty == 1.0
        s.pending = s.sampler(logits, s.cached)
        s.reported, s.active = False, True
        return slot

    def _prefill(self, slot: int, prompt: list[int], keep: int) -> np.ndarray:
        engine, s = self.engine, self.slots[slot]
        if self.mode != "batched":  # "rows": the slot's state is its row of the batch buffer
            saved = engine.swap_cache(s.state)
            try:
                engine.trim(engine.offset - keep)
                engine.reserve(self.capacity)
                logits = prefill(engine, prompt[keep:], self.prefill_chunk)
            finally:
                s.state = engine.swap_cache(saved)
            return logits
        scratch = [KVCache() for _ in self.caches]
        saved = engine.swap_cache(scratch)
        try:
            if keep:
                for c, row in zip(scratch, self.caches, strict=True):
                    hk, dk = row.keys.shape[1], row.keys.shape[3]  # type: ignore[union-attr]
                    c.allocate(1, hk, dk, row.values.shape[3], row.keys.dtype)  # type: ignore[union-attr]
                    c.update_and_fetch(row.keys[slot:slot + 1, :, :keep],  # type: ignore[index]
                                       row.values[slot:slot + 1, :, :keep])  # type: ignore[index]
            engine.reserve(self.capacity)
            logits = prefill(engine, prompt[keep:], self.prefill_chunk)
            n = len(prompt)
            for c, row in zip(scratch, self.caches, strict=True):
                k, v = c.state()
                keys, values = row.buffers()
                keys[slot:slot + 1, :, :n] = k
                values[slot:slot + 1, :, :n] = v
                row.adopt(keys, values, 0)
            mx.eval([a for row in self.caches for a in row.buffers()])
        finally:
            engine.swap_cache(saved)
        return logits

    # ---- decode ----------------------------------------------------------------------------

    def step(self) -> dict[int, int]:
        """One token for every active slot: a slot's first (from its prompt) or the next."""
        out: dict[int, int] = {}
        feed: list[int] = []
        for i in self.active:
            s = self.slots[i]
            if not s.reported:
                out[i], s.reported = s.pending, True  # type: ignore[assignment]
            elif len(s.cached) >= self.max_context:
                self.exhausted.add(i)
            else:
                feed.append(i)
        if feed:
            rows = (self._batched(feed) if self.mode == "batched" else
                    self._rows_step(feed) if self.mode == "rows" else self._sequential(feed))
            for i, token in rows.items():
                out[i] = token
        return dict(sorted(out.items()))

    def _sample(self, logits: dict[int, object]) -> dict[int, int]:
        out = {}
        for i, row in logits.items():
            s = self.slots[i]
            assert s.pending is not None and s.sampler is not None
            s.cached.append(s.pending)
            s.pending = s.sampler(np.asarray(row, np.float32), s.cached)
            out[i] = s.pending
        return out

    def _sequential(self, feed: list[int]) -> dict[int, int]:
        engine = self.engine
        logits: dict[int, object] = {}
        for i in feed:
            s = self.slots[i]
            saved = engine.swap_cache(s.state)
            try:
                logits[i] = np.asarray(engine.decode_step(s.pending), np.float32)
            finally:
                s.state = engine.swap_cache(saved)
        return self._sample(logits)

    def _rows_step(self, feed: list[int]) -> dict[int, int]:
        assert self._rows is not None
        # A row not fed writes a dummy at its length, kept inside the buffer and the rotary
        # tables: last_position >= max_context - 1, beyond any prefix a prompt reuses.
        last = self._rows.last_position
        logits = self._rows.step({i: self.slots[i].pending for i in feed},  # type: ignore[misc]
                                 [min(len(s.cached), last) for s in self.slots])
        for i in feed:
            state = self.slots[i].state
            self.slots[i].state = (state[0], len(self.slots[i].cached) + 1)  # type: ignore[index]
        return self._sample(logits)  # type: ignore[arg-type]

    def _span(self, feed: list[int]) -> mx.array:
        """Key positions 0..L-1 that the step's attention reads: L covers the longest fed
        row's new position, rounded up to the span step (a few compiled traces in all, not one
        per token), or the whole capacity (span step 0). Idle rows may lie past L: their
        output is never read."""
        cap = self.capacity
        step = self._span_step
        need = max(len(self.slots[i].cached) for i in feed) + 1
        n = cap if not step else min(cap, -(-need // step) * step)
        if n not in self._spans:
            self._spans[n] = mx.arange(n, dtype=mx.int32)
        return self._spans[n]

    def _batched(self, feed: list[int]) -> dict[int, int]:
        b = self.max_batch
        tokens = np.zeros((b, 1), np.int32)
        offsets = np.array([len(s.cached) for s in self.slots], np.int32)
        for i in feed:
            tokens[i, 0] = self.slots[i].pending  # type: ignore[assignment]
        # The buffers go to the call straight from the caches, with no list of them kept past
        # it: adopt() drops the caches' references, so the program's row writes (plain path)
        # update donated buffers in place; a list still alive at mx.eval below made MLX copy
        # every layer's whole [max_batch, heads, capacity, dim] buffers each step.
        logits, _, *new_kv = self._fn(mx.array(tokens), mx.array(offsets), self._span(feed),
                                      *(a for c in self.caches for a in c.buffers()))
        for j, c in enumerate(self.caches):
            c.adopt(new_kv[2 * j], new_kv[2 * j + 1], 0)
        greedy = [i for i in feed if self.slots[i].greedy]
        picks = mx.argmax(logits, axis=-1) if greedy else None
        host = [i for i in feed if not self.slots[i].greedy]
        mx.eval(*(x for x in (picks, logits if host else None) if x is not None), *new_kv)
        out: dict[int, int] = {}
        if picks is not None:
            chosen = picks.tolist()
            for i in greedy:
                s = self.slots[i]
                s.cached.append(s.pending)  # type: ignore[arg-type]
                s.pending = int(chosen[i])  # type: ignore[index]
                out[i] = s.pending
        if host:
            out.update(self._sample({i: np.array(logits[i]) for i in host}))
        return out

    def describe(self) -> dict[str, object]:
        return {"mode": self.mode, "max_batch": self.max_batch, "max_context": self.max_context,
                "capacity": self.capacity, "active": len(self.active)}
