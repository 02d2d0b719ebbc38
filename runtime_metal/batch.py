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

Two ways to run, chosen per engine (`mode`):
- "batched" (MLX with the compiled program): the KV cache is a block cache (kv_cache.BlockCache:
  per layer a pool of fixed-size blocks, one free list). Each slot holds a block table, the
  blocks of its positions in order, taking a block when its length crosses into one: a short
  row holds the blocks of its own length, whatever the longest row's. A step runs the program
  (DecodeProgram.paged: the single sequence's program and fused kernels, one token a row) over
  the fed rows only, each at its own offset through its table; rows not decoding cost nothing.
  A prompt is prefilled through the engine's own single-sequence path (chunked, MLX's fused
  causal attention) into a scratch cache, then written into its blocks.
  Prefix sharing: a new prompt takes, by reference, the blocks of the longest prefix any slot
  caches (a running sequence's or a finished one's: a freed slot keeps its tokens and blocks
  until the pool needs them, least recently used first), and prefills only the rest (at least
  the last prompt token is fed again, for its logits). A block held by two tables is written by
  neither: the one that writes into it first takes a copy (copy on write: the partly shared
  last block of a prefix).
  The step is pipelined like generate's loop: `step()` queues the next step, fed with the
  device argmax of the one before (the same rows: tokens and offsets never leave the device),
  and only then reads that one's tokens, so the device never waits for the host between
  steps. A row sampled on the host needs its logits first: a call whose last step fed one
  reads before it queues. A sequence that leaves drops the token queued for it.
- "rows" (onnxruntime on its lowered graph: ort_engine/row_batch.py): one KV buffer per layer
  with a row per slot; each slot's cache state is its row, so a prompt is prefilled as in
  "sequential", and a step runs the fed rows together, each at its own length.
- "sequential" (onnxruntime's plain graph, or MLX when the program is refused): each slot owns
  a cache state (Engine.swap_cache) and a step feeds the slots one after another.
In both of these a freed slot keeps its tokens, and `add` picks the free slot sharing the
longest prefix with the prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from fuselm.runtime_metal.engine import Engine
from fuselm.runtime_metal.errors import RuntimeUserError
from fuselm.runtime_metal.generate import prefill
from fuselm.runtime_metal.kv_cache import BLOCK, BlockCache, KVCache
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
    epoch: int = 0  # bumped when the sequence leaves: a queued step's row of it is dropped
    blocks: list[int] = field(default_factory=list)  # batched mode: its block table
    used: int = 0  # when it last decoded or joined (a freed slot's blocks go LRU first)
    reused: int = 0  # prompt tokens of its sequence taken from the prefix cache


@dataclass
class _Step:
    """A batched step queued on the device (batched mode), not yet read."""

    rows: list[tuple[int, int]]  # (slot, epoch) of each row it fed, in its row order
    picks: mx.array | None  # argmax per row (uint32 [rows]) when a fed row is greedy
    logits: mx.array | None  # [rows, vocab] when a fed row samples on the host
    next_offsets: mx.array  # every row's length after it (int32 [rows], on the device)


class BatchDecoder:
    def __init__(self, engine: Engine, max_batch: int, max_context: int,
                 prefill_chunk: int | None = None, batched: bool | None = None,
                 blocks: int | None = None) -> None:
        """batched: None = the batched program when the engine has it; False = sequential.
        blocks: the block pool's size (batched mode; default: every slot at max_context)."""
        if max_batch < 1 or max_context < 2:
            raise RuntimeUserError("max_batch must be >= 1 and max_context >= 2")
        self.engine = engine
        self.max_batch = max_batch
        self.max_context = max_context
        self.prefill_chunk = prefill_chunk
        self.slots = [_Slot() for _ in range(max_batch)]
        self.exhausted: set[int] = set()  # slots that reached max_context (no more tokens)
        self.reused_tokens = 0  # prompt tokens not prefilled again (prefix reuse)
        # Room for max_context positions plus the write of a token fed ahead at max_context.
        self.capacity = -(-(max_context + 1) // KVCache.step) * KVCache.step
        self.row_blocks = -(-(max_context + 1) // BLOCK)  # the most blocks one table holds
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
        self._span_step = 0
        self._inflight: _Step | None = None  # batched mode: the step queued by the last step()
        self._clock = 0
        self._table: tuple[np.ndarray, mx.array] | None = None  # the last table sent up
        if self.mode == "batched":
            assert program is not None
            fn, layout, self._span_step = program
            n = blocks if blocks is not None else max_batch * self.row_blocks
            if n < self.row_blocks:
                raise RuntimeUserError(
                    f"a pool of {n} KV blocks cannot hold one sequence of max_context "
                    f"{max_context} ({self.row_blocks} blocks of {BLOCK})")
            self.cache = BlockCache(layout, n, engine.kv_quant)
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
        s.epoch += 1
        self.exhausted.discard(slot)
        if self.mode == "batched":  # blocks past its cached tokens (a token fed ahead) go
            keep = -(-len(s.cached) // BLOCK)
            self.cache.pool.release(s.blocks[keep:])
            del s.blocks[keep:]

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
        if self.mode == "batched":
            slot, keep, logits = self._add_blocks(prompt, free)
        else:
            slot = max(free, key=lambda i: (_common(self.slots[i].cached, prompt), -i))
            keep = min(_common(self.slots[slot].cached, prompt), len(prompt) - 1)
            logits = self._prefill_sequential(slot, prompt, keep)
        s = self.slots[slot]
        opts = sampling or SamplingOptions()
        self.reused_tokens += keep
        s.reused = keep
        s.cached = list(prompt)
        s.sampler = make_sampler(opts)
        s.greedy = opts.temperature == 0 and opts.repetition_penalty == 1.0
        s.pending = s.sampler(logits, s.cached)
        s.reported, s.active = False, True
        return slot

    def _prefill_sequential(self, slot: int, prompt: list[int], keep: int) -> np.ndarray:
        engine, s = self.engine, self.slots[slot]
        saved = engine.swap_cache(s.state)
        try:
            engine.trim(engine.offset - keep)
            engine.reserve(self.capacity)
            logits = prefill(engine, prompt[keep:], self.prefill_chunk)
        finally:
            s.state = engine.swap_cache(saved)
        return logits

    # ---- the block cache (batched mode) ------------------------------------------------------

    def _add_blocks(self, prompt: list[int], free: list[int]) -> tuple[int, int, np.ndarray]:
        """Prefill `prompt` into a free slot's blocks, the longest cached prefix of any slot
        taken by reference; returns (slot, prefix tokens reused, the prompt's logits)."""
        slots, pool = self.slots, self.cache.pool
        src = max(range(self.max_batch), key=lambda i: (_common(slots[i].cached, prompt),
                                                        slots[i].active, -i))
        keep = min(_common(slots[src].cached, prompt), len(prompt) - 1)
        # the slot: the source itself when free and shared (its blocks stay where they are),
        # else a free one holding nothing, else the least recently used
        slot = src if src in free and keep else min(free, key=lambda i: (bool(slots[i].blocks),
                                                                          slots[i].used, i))
        s = slots[slot]
        table = [pool.share(b) for b in slots[src].blocks[:-(-keep // BLOCK)]]
        pool.release(s.blocks)
        s.blocks, s.cached = [], []
        s.epoch += 1  # a token queued for the slot's last sequence is dropped
        try:
            need = -(-len(prompt) // BLOCK) - len(table)
            self._make_room(need + 1, spare=slot)  # + 1: its first decoded token's block
            table += [pool.alloc() for _ in range(need)]
            if keep % BLOCK:  # the partly shared block receives the prompt's rest: a copy
                last = keep // BLOCK
                old = table[last]
                table[last], copied = pool.writable(old)
                if copied:
                    self.cache.copy_block(old, table[last])
        except IndexError:
            pool.release(table)
            raise RuntimeUserError(
                f"the KV cache is full ({pool.available} free blocks of {BLOCK} positions); "
                "wait for a sequence to finish") from None
        s.blocks = table
        s.used = self._tick()
        return slot, keep, self._prefill_blocks(table, prompt, keep)

    def _prefill_blocks(self, table: list[int], prompt: list[int], keep: int) -> np.ndarray:
        engine = self.engine
        scratch = self.cache.gather(table, keep) if keep else [
            KVCache(self.cache.quant) for _ in self.cache.keys]
        saved = engine.swap_cache(scratch)
        try:
            engine.reserve(self.capacity)
            logits = prefill(engine, prompt[keep:], self.prefill_chunk)
            self.cache.scatter(scratch, table, keep, len(prompt))
            mx.eval(self.cache.buffers())
        finally:
            engine.swap_cache(saved)
        return logits

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _make_room(self, n: int, spare: int) -> None:
        """Free blocks until n are free, dropping freed slots' cached prefixes, least recently
        used first (never `spare`'s, nor a running sequence's)."""
        pool = self.cache.pool
        idle = sorted((s.used, i) for i, s in enumerate(self.slots)
                      if not s.active and i != spare and s.blocks)
        for _, i in idle:
            if pool.available >= n:
                return
            s = self.slots[i]
            pool.release(s.blocks)
            s.blocks, s.cached = [], []

    def _writable_block(self, slot: int) -> bool:
        """The block for `slot`'s next position, taken (a new one) or made its own (copy on
        write); False when the pool has none to give."""
        s, pool = self.slots[slot], self.cache.pool
        at = len(s.cached) // BLOCK
        try:
            if at == len(s.blocks):
                self._make_room(1, spare=slot)
                s.blocks.append(pool.alloc())
            elif pool.refs[s.blocks[at]] > 1:
                self._make_room(1, spare=slot)
                old = s.blocks[at]
                s.blocks[at], _ = pool.writable(old)
                self.cache.copy_block(old, s.blocks[at])
        except IndexError:
            return False
        return True

    # ---- decode ----------------------------------------------------------------------------

    def step(self) -> dict[int, int]:
        """One token for every active slot: a slot's first (from its prompt) or the next."""
        if self.mode == "batched":
            return dict(sorted(self._step_batched().items()))
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
            out.update(self._rows_step(feed) if self.mode == "rows" else self._sequential(feed))
        return dict(sorted(out.items()))

    def _advance(self, i: int, logits: object) -> int:
        """Slot i's fed token joins its cache; its next token is sampled from `logits`."""
        s = self.slots[i]
        assert s.pending is not None and s.sampler is not None
        s.cached.append(s.pending)
        s.pending = s.sampler(np.asarray(logits, np.float32), s.cached)
        return s.pending

    def _sequential(self, feed: list[int]) -> dict[int, int]:
        engine = self.engine
        out = {}
        for i in feed:
            s = self.slots[i]
            saved = engine.swap_cache(s.state)
            try:
                logits = np.asarray(engine.decode_step(s.pending), np.float32)
            finally:
                s.state = engine.swap_cache(saved)
            out[i] = self._advance(i, logits)
        return out

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
        return {i: self._advance(i, row) for i, row in logits.items()}  # type: ignore[union-attr]

    def _step_batched(self) -> dict[int, int]:
        """The pipelined step (generate's loop, for b rows): the step queued by the previous
        call is read here while the next one, fed with its device argmax, is already queued,
        so the device never waits for the host between steps. A row that samples on the host
        needs its logits before its next token exists: a step that fed one is read first and
        the next is queued after (no overlap that call)."""
        out: dict[int, int] = {}
        fresh = []  # rows reporting their first token (sampled from the prompt) now
        for i in self.active:
            s = self.slots[i]
            if not s.reported:
                out[i], s.reported = s.pending, True  # type: ignore[assignment]
                fresh.append(i)
        done = self._inflight
        self._inflight = None
        rows: list[int] = []  # the rows `done` fed that are still the same sequences
        if done is not None:
            for i, epoch in done.rows:
                s = self.slots[i]
                if s.active and s.epoch == epoch:
                    s.cached.append(s.pending)  # type: ignore[arg-type]
                    rows.append(i)
        overlap = done is not None and all(self.slots[i].greedy for i in rows)
        if done is not None and not overlap:
            out.update(self._read(done, rows))
        feed = []
        for i in sorted(fresh + rows):
            if len(self.slots[i].cached) >= self.max_context or not self._writable_block(i):
                self.exhausted.add(i)
            else:
                feed.append(i)
                self.slots[i].used = self._tick()
        if feed:
            # rows whose token is the device argmax of `done` (read below, after queueing)
            from_device = [i for i in rows if i in feed] if overlap else []
            self._inflight = self._queue(feed, done if from_device else None, from_device)
        if done is not None and overlap:
            out.update(self._read(done, rows))
        return out

    def _queue(self, feed: list[int], prev: _Step | None, from_device: list[int]) -> _Step:
        """Queue one batched step for the `feed` rows (row r of the step: slot feed[r]). The
        rows in `from_device` are fed prev's argmax without a trip through the host; the
        others their host `pending` token."""
        n = len(feed)
        if prev is not None and from_device == feed == [i for i, _ in prev.rows]:
            # the steady state: the same rows as the step before, each one position on, fed
            # its argmax: nothing goes up from the host but a changed block table
            assert prev.picks is not None
            tokens, offsets = prev.picks, prev.next_offsets
        else:
            host = np.array([0 if i in from_device else self.slots[i].pending for i in feed],
                            np.uint32)
            tokens = mx.array(host)
            if prev is not None:
                assert prev.picks is not None
                where = {i: r for r, (i, _) in enumerate(prev.rows)}
                at = np.array([where.get(i, 0) for i in feed], np.int32)
                take = np.array([i in from_device for i in feed])
                tokens = mx.where(mx.array(take), prev.picks[mx.array(at)], tokens)
            offsets = mx.array(np.array([len(self.slots[i].cached) for i in feed], np.int32))
        # The pools go to the call straight from the cache, with no list of them kept past
        # it: adopt() drops the cache's references, so the program's row writes update
        # donated buffers in place; a list still alive at evaluation made MLX copy every
        # layer's whole pool each step.
        logits, nxt, *new_kv = self._fn(tokens.reshape(n, 1), offsets, self._block_table(feed),
                                        *self.cache.buffers())
        self.cache.adopt(new_kv)
        del new_kv
        greedy = any(self.slots[i].greedy for i in feed)
        picks = mx.argmax(logits, axis=-1) if greedy else None
        sampled = not all(self.slots[i].greedy for i in feed)
        mx.async_eval(*(x for x in (picks, logits if sampled else None) if x is not None))
        return _Step([(i, self.slots[i].epoch) for i in feed], picks,
                     logits if sampled else None, nxt)

    def _block_table(self, feed: list[int]) -> mx.array:
        """The fed rows' block tables, [rows, W] int32: W covers the longest fed row's next
        position rounded up to the span step (a few compiled traces in all, not one per
        token), or every row's most blocks (span step 0: the attention kernel reads each row's
        own length). Entries past a row's blocks are never read (block 0). Sent up only when it
        changed (a row took a block, or the rows changed)."""
        w = self.row_blocks
        if self._span_step:
            need = max(len(self.slots[i].cached) for i in feed) + 1
            span = -(-need // self._span_step) * self._span_step
            w = min(w, -(-span // BLOCK))
        table = np.zeros((len(feed), w), np.int32)
        for r, i in enumerate(feed):
            b = self.slots[i].blocks
            table[r, :len(b)] = b
        if self._table is None or not np.array_equal(self._table[0], table):
            self._table = (table, mx.array(table))
        return self._table[1]

    def _read(self, done: _Step, rows: list[int]) -> dict[int, int]:
        """The tokens of a queued step for its `rows` (waits for it): greedy rows its device
        argmax, the others sampled on the host from its logits."""
        out: dict[int, int] = {}
        if not rows:
            return out
        where = {i: r for r, (i, _) in enumerate(done.rows)}
        chosen = done.picks.tolist() if done.picks is not None else []
        for i in rows:
            s = self.slots[i]
            if s.greedy:
                s.pending = int(chosen[where[i]])  # type: ignore[index]
            else:
                assert done.logits is not None and s.sampler is not None
                s.pending = s.sampler(np.array(done.logits[where[i]], np.float32), s.cached)
            out[i] = s.pending
        return out

    def describe(self) -> dict[str, object]:
        out: dict[str, object] = {"mode": self.mode, "max_batch": self.max_batch,
                                  "max_context": self.max_context, "active": len(self.active)}
        if self.mode == "batched":
            pool = self.cache.pool
            out.update(kv_block=BLOCK, kv_blocks=len(pool.refs), kv_blocks_free=pool.available)
        return out
