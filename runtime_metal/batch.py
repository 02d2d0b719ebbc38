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
tokens; greedy rows are picked on the device (one argmax for the batch), and in batched mode a
greedy row's logprobs come from the device too (a log-sum-exp and the top alternatives per
row), so asking for them keeps the step pipelined. A row under a grammar
(runtime_metal/constraint.py) is masked: on the host from its logits in the modes that read
them, and in batched mode, when greedy (and without logprobs), on the device (below).

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
  last block of a prefix). A 4-bit cache's keys per channel (a block one key group, a float
  tail per slot: its index the table's last column) share whole blocks only, and a fork
  copies the prompt's tail with its blocks.
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

Speculative decoding (`drafter`, drafting.py; `step_tokens`): every greedy row is given up to
`num_draft` drafted tokens and feeds its pending token and its drafts in ONE step with the
others: batched mode through DecodeProgram.paged_rows (s tokens a row over the block cache,
the logits of every position), rows mode through RowBatch.step_rows, sequential mode through
Engine.verify per slot. Rows with fewer drafts (a sampled row has none: speculation keeps
greedy tokens exact, so it is greedy only) are padded with dummy tokens after their own, at
positions causal attention hides from them. A row keeps its drafts while they equal the
model's greedy pick (generate.accept_drafts), so its tokens are greedy decoding's; the
rejected positions are rolled back: its length drops to the accepted tokens (the dummies and
rejected drafts past it are overwritten by later writes) and, in batched mode, the blocks past
it go back to the pool. These steps are not pipelined: the next drafts need this step's
tokens on the host. On onnxruntime (rows mode) a row with drafts runs alone (its
GroupQueryAttention takes several new tokens a row only in a batch of one), so there drafts
are made only while one row decodes; several rows share the plain row-batch run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from fuselm.runtime_metal.constraint import TokenConstraint, fill_masks
from fuselm.runtime_metal.engine import Engine
from fuselm.runtime_metal.errors import RuntimeUserError
from fuselm.runtime_metal.generate import (
    DEFAULT_NUM_DRAFT,
    DraftBudget,
    Drafter,
    accept_drafts,
    prefill,
    prefill_chunk_for,
)
from fuselm.runtime_metal.kv_cache import (
    BLOCK,
    KEY_GROUP,
    BlockCache,
    KVCache,
    completes_no_key_group,
)
from fuselm.runtime_metal.pipeline_steps import MicroBatch, PipelineSteps
from fuselm.runtime_metal.prefix import common_prefix as _common
from fuselm.runtime_metal.sampling import (
    SamplingOptions,
    TokenLogprobs,
    TokenSampler,
    check_finite,
    token_logprobs,
)


@dataclass
class _Slot:
    cached: list[int] = field(default_factory=list)  # token ids whose K/V the cache holds
    pending: int | None = None  # sampled, not yet fed
    reported: bool = True  # `pending` was already handed to the caller
    active: bool = False
    sampler: TokenSampler | None = None
    greedy: bool = True  # picked on the device: temperature 0, no logits processor
    top_logprobs: int | None = None  # None: no logprobs; else the alternatives reported
    # when the sequence asked for them: the logprobs of its tokens sampled and not yet taken
    # (logprobs()), in order: a speculative step reports a new row's first token and the next
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logits: np.ndarray | None = None  # kept until its first token is reported (fork)
    constraint: TokenConstraint | None = None  # its grammar (batched mode: masked on device)
    state: object = None  # sequential mode: the slot's engine cache state
    epoch: int = 0  # bumped when the sequence leaves: a queued step's row of it is dropped
    blocks: list[int] = field(default_factory=list)  # batched mode: its block table
    used: int = 0  # when it last decoded or joined (a freed slot's blocks go LRU first)
    reused: int = 0  # prompt tokens of its sequence taken from the prefix cache
    budget: DraftBudget | None = None  # speculative decoding: its drafts' count


@dataclass
class _Step:
    """A batched step queued on the device (batched mode), not yet read."""

    rows: list[tuple[int, int]]  # (slot, epoch) of each row it fed, in its row order
    picks: mx.array | None  # argmax per row (uint32 [rows]) when a fed row is greedy
    # when a fed greedy row wants logprobs: per row the log-sum-exp and the max logit [rows],
    # the ids and logits of its likeliest [rows, k] (unordered)
    top: tuple[mx.array, mx.array, mx.array, mx.array] | None
    logits: mx.array | None  # [rows, vocab] when a fed row samples on the host or is masked
    next_offsets: mx.array  # every row's length after it (int32 [rows], on the device)
    # a pipeline's micro-batches of it (pipeline_steps.py), in row order; picks, top and
    # logits are made once they have all left the last stage (BatchDecoder._settle)
    batches: list[MicroBatch] = field(default_factory=list)
    wants: tuple[bool, bool, int | None] = (False, False, None)  # greedy, keep, top k
    written: np.ndarray | None = None  # the position each row wrote, where the host knows it


PAD = 16  # a padded prompt chunk's width is a multiple of this


def padded_width(n: int) -> int:
    """The width a prompt chunk of n tokens is padded to: the next multiple of PAD. Few
    dummies (where the prefill's work grows with its tokens, MLX's CPU backend, padding a
    90-token prompt to 128 cost more than tracing its length), few traces (chunk / PAD)."""
    return -(-n // PAD) * PAD


def _device_logprobs(top: list[np.ndarray], r: int, token: int, k: int) -> TokenLogprobs:
    """Row r's TokenLogprobs from a step's device figures (_Step.top) for its argmax `token`:
    its logprob is the max logit's; the alternatives likeliest first, ties by id."""
    lse, peak, ids, vals = (float(top[0][r]), float(top[1][r]), top[2][r], top[3][r])
    order = sorted(zip(vals.tolist(), ids.tolist(), strict=True), key=lambda p: (-p[0], p[1]))
    return TokenLogprobs(token, peak - lse, tuple((int(t), v - lse) for v, t in order[:k]))


class BatchDecoder:
    def __init__(self, engine: Engine, max_batch: int, max_context: int,
                 prefill_chunk: int | None = None, batched: bool | None = None,
                 kv_tokens: int | None = None, drafter: Drafter | None = None,
                 num_draft: int = DEFAULT_NUM_DRAFT) -> None:
        """batched: None = the batched program when the engine has it; False = sequential.
        kv_tokens: the KV cache's size in positions, all slots together (default: every slot
        at max_context). Batched mode: a pool of kv_tokens // BLOCK blocks, which may hold
        less than one sequence of max_context (the caller then admits only what fits:
        `kv_cost`). Rows and sequential modes: a slot holds a whole row of `capacity`
        positions, so kv_tokens // capacity slots at most.
        drafter: speculative decoding with up to num_draft drafted tokens a row a step (then
        step_tokens, not step)."""
        if max_batch < 1 or max_context < 2:
            raise RuntimeUserError("max_batch must be >= 1 and max_context >= 2")
        if drafter is not None and num_draft < 1:
            raise RuntimeUserError(f"the number of drafted tokens must be >= 1, got {num_draft}")
        self.drafter = drafter
        self.num_draft = num_draft if drafter is not None else 0
        # positions a row's step may write past its length: the token fed ahead, the drafts
        self.overhang = 1 + self.num_draft
        self.drafted = self.accepted = 0  # drafted tokens checked, and those kept
        self.engine = engine
        self.max_context = max_context
        self.prefill_chunk = prefill_chunk
        self.exhausted: set[int] = set()  # slots that reached max_context (no more tokens)
        self.reused_tokens = 0  # prompt tokens not prefilled again (prefix reuse)
        # Room for max_context positions plus the write of a token fed ahead at max_context,
        # and a speculative step's drafts and dummies past a row's length.
        room = max_context + self.overhang
        self.capacity = -(-room // KVCache.step) * KVCache.step
        self.row_blocks = -(-room // BLOCK)  # the most blocks one table holds
        program = engine.batch_program()
        if batched and program is None:
            raise RuntimeUserError(
                f"engine {engine.name!r} has no batched program here; use batched=None")
        self.mode = "batched" if program is not None and batched is not False else "sequential"
        if self.mode != "batched" and kv_tokens is not None:
            if kv_tokens < self.capacity:
                raise RuntimeUserError(
                    f"a KV budget of {kv_tokens} tokens cannot hold one sequence: on engine "
                    f"{engine.name!r} each holds a whole row of {self.capacity} positions "
                    f"(max_context {max_context}); give at least {self.capacity} tokens or a "
                    "lower max_context")
            max_batch = min(max_batch, kv_tokens // self.capacity)
        self.max_batch = max_batch
        self.slots = [_Slot() for _ in range(max_batch)]
        make_rows = getattr(engine, "row_batch", None)  # onnxruntime's
        self._rows = make_rows(max_batch, self.capacity) if (
            make_rows and self.mode == "sequential" and batched is not False) else None
        if self._rows is not None:
            self.mode = "rows"
            for i, s in enumerate(self.slots):
                s.state = self._rows.state(i)
        self._span_step = 0
        # A reused prefix's rest prefilled padded from the multiple of PAD before it
        # (_prefill_blocks): on a GPU, where a short prefill is launch-bound and a trace of the
        # prefix program costs tens of ms a new (offset, length); on MLX's CPU backend a
        # prefill's cost grows with its tokens, so a short rest goes as it is there.
        self.pad_after_prefix = mx.default_device().type == mx.gpu
        self._pipe: PipelineSteps | None = None  # a pipeline stage's micro-batched steps
        self.micro_batches = 1  # the most micro-batches a step's rows are split into
        self._inflight: _Step | None = None  # batched mode: the step queued by the last step()
        self._clock = 0
        self._table: tuple[np.ndarray, mx.array] | None = None  # the last table sent up
        self._fn_open: object | None = None  # batched mode: see below
        if self.mode == "batched":
            assert program is not None
            fn, layout, self._span_step = program
            n = max_batch * self.row_blocks if kv_tokens is None else kv_tokens // BLOCK
            if n < 1:
                raise RuntimeUserError(f"a KV budget of {kv_tokens} tokens holds no block of "
                                       f"{BLOCK} positions; give at least {BLOCK}")
            self.cache = BlockCache(layout, n, engine.kv_quant, rows=max_batch)
            self._fn = fn
            # a step in which no row writes a key group's last position: a 4-bit cache's
            # program that quantizes no key (None: every step takes _fn)
            opener = getattr(engine, "batch_open", None)
            self._fn_open = opener() if opener is not None else None
            verify = getattr(engine, "batch_verify", None)
            self._verify = verify() if verify is not None and drafter is not None else None
            stage = getattr(engine, "stage_program", None)
            stage = stage() if stage is not None and drafter is None else None
            if stage is not None:  # a pipeline stage: a step's rows in micro-batches
                stage_fn, rank, size = stage
                config = getattr(engine, "config", None)
                want = getattr(config, "micro_batches", None)
                self.micro_batches = size if want is None else want
                if self.micro_batches > 1:
                    info = engine.manifest.model
                    self._pipe = PipelineSteps(stage_fn, rank, size, info.hidden_size,
                                               info.vocab_size, self.cache.buffers,
                                               self.cache.adopt)

    # ---- the KV budget ---------------------------------------------------------------------

    def kv_cost(self, tokens: int) -> int:
        """KV positions a sequence of `tokens` positions (prompt + completion) holds at most:
        its whole blocks, with one position more for a token fed ahead (batched mode), or a
        slot's whole row (the other modes)."""
        if self.mode == "batched":  # a speculative step writes its drafts past the length
            return -(-(tokens + self.overhang) // BLOCK) * BLOCK
        return self.capacity

    @property
    def kv_budget(self) -> int:
        """KV positions the cache holds, all slots together."""
        if self.mode == "batched":
            return len(self.cache.pool.refs) * BLOCK
        return self.max_batch * self.capacity

    @property
    def kv_window(self) -> int:
        """The longest sequence (prompt + completion) the whole budget holds: max_context, or
        less when the block pool is smaller than one sequence of max_context (less `overhang`,
        as kv_cost counts it)."""
        if self.mode == "batched":
            return min(self.max_context, self.kv_budget - self.overhang)
        return self.max_context

    def kv_held(self) -> int:
        """KV positions held now: by running sequences and by finished ones' cached prefixes
        (which give way when a new sequence needs the room)."""
        if self.mode == "batched":
            return (len(self.cache.pool.refs) - self.cache.pool.available) * BLOCK
        return sum(self.capacity for s in self.slots if s.active or s.cached)

    # ---- slots ---------------------------------------------------------------------------

    @property
    def active(self) -> list[int]:
        return [i for i, s in enumerate(self.slots) if s.active]

    def length(self, slot: int) -> int:
        """Positions cached for `slot`."""
        return len(self.slots[slot].cached)

    def remove(self, slot: int) -> None:
        """The sequence leaves; its cached tokens stay for a later prompt that shares them."""
        self._settle_all()
        s = self.slots[slot]
        s.active, s.pending, s.reported, s.sampler = False, None, True, None
        s.logprobs, s.prompt_logits = [], None
        s.constraint = None
        s.epoch += 1
        self.exhausted.discard(slot)
        if self.mode == "batched":  # blocks past its cached tokens (a token fed ahead) go
            keep = -(-len(s.cached) // BLOCK)
            self.cache.pool.release(s.blocks[keep:])
            del s.blocks[keep:]

    def add(self, prompt: Sequence[int], sampling: SamplingOptions | None = None, *,
            top_logprobs: int | None = None, constraint: TokenConstraint | None = None
            ) -> int:
        """Prefill `prompt` into a free slot; its first token comes with the next step().
        top_logprobs: report each token's logprob and that many alternatives (`logprobs`).
        `constraint`: this sequence's grammar (runtime_metal/constraint.py); its row samples
        from masked logits, the other rows as before."""
        opts = sampling or SamplingOptions()
        opts.validate()
        opts.check_vocab(self.engine.manifest.model.vocab_size)
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
        self._settle_all()
        if self.mode == "batched":
            slot, keep, logits = self._add_blocks(prompt, free)
        else:
            slot = max(free, key=lambda i: (_common(self.slots[i].cached, prompt), -i))
            keep = min(_common(self.slots[slot].cached, prompt), len(prompt) - 1)
            logits, keep = self._prefill_sequential(slot, prompt, keep)
        self.reused_tokens += keep
        self._start(slot, prompt, keep, logits, opts, top_logprobs, constraint)
        return slot

    def fork(self, slot: int, sampling: SamplingOptions | None = None, *,
             top_logprobs: int | None = None, constraint: TokenConstraint | None = None
             ) -> int:
        """Another sequence from the prompt `slot` was just added with (its first token not yet
        reported): the prompt is not prefilled again, its first token is chosen from the same
        logits by its own sampler (OpenAI's n > 1). Batched mode shares the prompt's blocks by
        reference (the partly filled last one is copied when first written); rows mode copies
        the prompt's K/V into the new row; sequential mode (a cache state per slot, the
        engine's own) prefills the prompt again."""
        src = self.slots[slot]
        if not self.forkable(slot, src.cached):
            raise RuntimeUserError("fork: the sequence has started decoding; add its prompt "
                                   "instead")
        if self.mode == "sequential":
            return self.add(src.cached, sampling, top_logprobs=top_logprobs, constraint=constraint)
        opts = sampling or SamplingOptions()
        opts.validate()
        opts.check_vocab(self.engine.manifest.model.vocab_size)
        free = [i for i, s in enumerate(self.slots) if not s.active]
        if not free:
            raise RuntimeUserError(
                f"all {self.max_batch} slots are busy; remove a finished sequence first")
        prompt = list(src.cached)
        self._settle_all()
        if self.mode == "rows":
            assert self._rows is not None
            new = min(free, key=lambda i: (len(self.slots[i].cached), i))  # the least cached
            self.slots[new].state = self._rows.copy_row(slot, new, len(prompt))
        else:
            new = min(free, key=lambda i: (bool(self.slots[i].blocks), self.slots[i].used, i))
            s, pool = self.slots[new], self.cache.pool
            pool.release(s.blocks)
            s.blocks = [pool.share(b) for b in src.blocks]
            if self.cache.keys_per_channel:  # the prompt's newest keys in float
                self.cache.copy_tail(slot, new)
            s.epoch += 1
            s.used = self._tick()
        self.reused_tokens += len(prompt)
        self._start(new, prompt, len(prompt), src.prompt_logits, opts, top_logprobs, constraint)
        return new

    def forkable(self, slot: int, prompt: Sequence[int]) -> bool:
        """Whether `fork(slot)` starts a sequence from `prompt`: the slot's sequence was added
        with it and has not reported its first token yet."""
        s = self.slots[slot]
        return (s.active and not s.reported and s.prompt_logits is not None
                and s.cached == [int(t) for t in prompt])

    def _start(self, slot: int, prompt: list[int], keep: int, logits: np.ndarray,
               opts: SamplingOptions, top_logprobs: int | None,
               constraint: TokenConstraint | None = None) -> None:
        s = self.slots[slot]
        s.reused = keep
        s.cached = list(prompt)
        s.sampler = TokenSampler(opts)
        s.top_logprobs = top_logprobs
        s.logprobs = []
        # a greedy row under a grammar keeps the device argmax only where it can be masked on
        # the device (batched mode, its logprobs not asked: those come from unmasked logits
        # there); elsewhere it samples on the host from masked logits
        s.greedy = (opts.temperature == 0 and not opts.processed
                    and (constraint is None or (self.mode == "batched" and top_logprobs is None)))
        s.constraint = constraint
        s.prompt_logits = logits
        self._sample(slot, logits)
        s.reported, s.active = False, True
        s.budget = DraftBudget(self.num_draft) if self.drafter is not None else None

    def _sample(self, i: int, logits: np.ndarray) -> int:
        """Slot i's next token (`pending`) chosen on the host from `logits`, its logprobs with
        it when the sequence asked for them: the one per-row host step of every mode."""
        s = self.slots[i]
        assert s.sampler is not None
        if s.constraint is not None:  # the tokens its grammar refuses masked out first
            check_finite(logits)  # the model's own values, before the mask hides any
            logits = s.constraint.mask(np.asarray(logits, np.float32))
        s.pending = s.sampler(logits, s.cached)
        if s.constraint is not None:
            s.constraint.advance(s.pending)
        if s.top_logprobs is not None:
            assert s.sampler.processed is not None
            s.logprobs.append(token_logprobs(s.sampler.processed, s.pending, s.top_logprobs))
        return s.pending

    def logprobs(self, slot: int) -> TokenLogprobs | None:
        """The logprobs of `slot`'s next reported token not yet asked for (None unless its
        sequence asked for them): one call per token step() / step_tokens() reported, in
        order (a speculative step reports a new row's first token and the next together)."""
        s = self.slots[slot]
        return s.logprobs.pop(0) if s.top_logprobs is not None and s.logprobs else None

    def _prefill_sequential(self, slot: int, prompt: list[int], keep: int
                            ) -> tuple[np.ndarray, int]:
        """The prompt after its first `keep` tokens, which the slot's cache holds, prefilled
        into it; returns its logits and the tokens kept (fewer than `keep` where the trim
        forgets more: a 4-bit cache's keys, kv_cache.KVCache.trim)."""
        engine, s = self.engine, self.slots[slot]
        saved = engine.swap_cache(s.state)
        try:
            engine.trim(engine.offset - keep)
            keep = engine.offset
            engine.reserve(self.capacity)
            logits = prefill(engine, prompt[keep:], self.prefill_chunk)
        finally:
            s.state = engine.swap_cache(saved)
        return logits, keep

    # ---- the block cache (batched mode) ------------------------------------------------------

    def _add_blocks(self, prompt: list[int], free: list[int]) -> tuple[int, int, np.ndarray]:
        """Prefill `prompt` into a free slot's blocks, the longest cached prefix of any slot
        taken by reference; returns (slot, prefix tokens reused, the prompt's logits)."""
        slots, pool = self.slots, self.cache.pool
        src = max(range(self.max_batch), key=lambda i: (_common(slots[i].cached, prompt),
                                                        slots[i].active, -i))
        keep = min(_common(slots[src].cached, prompt), len(prompt) - 1)
        if self.cache.keys_per_channel:  # whole key groups: the source's tail is not read
            keep -= keep % KEY_GROUP
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
        return slot, keep, self._prefill_blocks(table, prompt, keep, slot)

    def _prefill_blocks(self, table: list[int], prompt: list[int], keep: int, slot: int
                        ) -> np.ndarray:
        """The prompt past `keep` through the engine's single-sequence path into a scratch
        cache at the decoder's capacity, then into its blocks. A rest of one prefill chunk at
        most is padded to a multiple of PAD tokens (padded_width), so prompts of many lengths
        share one compiled trace instead of tracing each new length (measured on a 28-layer
        model on a CPU: a new length's first token 1.3-1.6x a traced one's, the dummies of its
        padding 1.06-1.24x; on a GPU a short prefill is launch-bound, so its dummies cost
        about nothing). After a reused prefix (`pad_after_prefix`) the padded chunk starts at the
        multiple of PAD at or before `keep` (its program is traced per offset: a server's
        prompts share a system prompt or a chat template's header, so these offsets recur
        where `keep` varies; the few positions before `keep` are computed again in the
        scratch, the blocks keep theirs). Longer rests go as they are."""
        engine = self.engine
        pad = getattr(engine, "prefill_padded", None)
        start = keep - keep % PAD
        padded = pad is not None and (not keep or self.pad_after_prefix) and (
            len(prompt) - start <= prefill_chunk_for(engine, self.prefill_chunk))
        start = start if padded else keep
        scratch = self.cache.gather(table, start) if start else [
            KVCache(self.cache.quant) for _ in self.cache.keys]
        saved = engine.swap_cache(scratch)
        try:
            engine.reserve(self.capacity)
            if padded:
                assert pad is not None
                logits = pad(np.asarray(prompt[start:], np.int64),
                             padded_width(len(prompt) - start))
            else:
                logits = prefill(engine, prompt[keep:], self.prefill_chunk)
            self.cache.scatter(scratch, table, keep, len(prompt), slot)
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
        if self.drafter is not None:
            raise RuntimeUserError("a speculative batch decoder gives several tokens a step; "
                                   "call step_tokens()")
        if self.mode == "batched":
            return dict(sorted(self._step_batched().items()))
        out: dict[int, int] = {}
        feed: list[int] = []
        for i in self.active:
            s = self.slots[i]
            if not s.reported:
                out[i], s.reported = s.pending, True  # type: ignore[assignment]
                s.prompt_logits = None
            elif len(s.cached) >= self.max_context:
                self.exhausted.add(i)
            else:
                feed.append(i)
        if feed:
            out.update(self._rows_step(feed) if self.mode == "rows" else self._sequential(feed))
        return dict(sorted(out.items()))

    def step_tokens(self) -> dict[int, list[int]]:
        """Every active slot's tokens of one step, in order: one each (`step`), or with a
        drafter a slot's first token, its accepted drafts and the model's next token."""
        if self.drafter is None:
            return {i: [t] for i, t in self.step().items()}
        out: dict[int, list[int]] = {}
        feed: list[int] = []
        for i in self.active:
            s = self.slots[i]
            out[i] = []
            if not s.reported:
                out[i].append(s.pending)  # type: ignore[arg-type]
                s.reported = True
            if len(s.cached) >= self.max_context or (
                    self.mode == "batched" and not self._writable_block(i)):
                self.exhausted.add(i)
            else:
                feed.append(i)
        if feed:
            for i, tokens in self._speculate(feed).items():
                out[i] += tokens
        return {i: t for i, t in sorted(out.items()) if t}

    def _speculate(self, feed: list[int]) -> dict[int, list[int]]:
        """One speculative step for the `feed` rows: drafts, one run, acceptance, rollback."""
        assert self.drafter is not None
        # rows mode: a drafted row runs alone (below), which costs more than the shared run of
        # several rows saves (measured on SmolLM2 at batch 4: 0.85x an edit workload's tokens/s,
        # 0.38x a chat's), so drafts are made only when one row decodes
        alone = self.mode != "rows" or len(feed) == 1
        given: dict[int, list[int]] = {}
        for i in feed:
            s = self.slots[i]
            assert s.budget is not None
            # only a plain greedy row drafts (its tokens stay greedy decoding's); a row under
            # a grammar or asking for logprobs takes the one host sampling step (_sample)
            plain = s.greedy and s.constraint is None and s.top_logprobs is None
            k = min(s.budget.next(), self.max_context - 1 - len(s.cached)) if (
                plain and alone) else 0
            seq = [*s.cached, s.pending]
            given[i] = [s.pending, *self.drafter.propose(seq, k, key=i)] if k > 0 else [
                s.pending]  # type: ignore[list-item]
        if self.mode == "batched":
            logits = self._verify_blocks(given)
        elif self.mode == "rows":
            logits = self._verify_rows(given)
        else:
            logits = self._verify_sequential(given)
        out = {}
        for i, tokens in given.items():
            s = self.slots[i]
            assert s.sampler is not None
            if len(tokens) == 1:  # no drafts: the row's plain step, its host sampling step
                out[i] = [self._advance(i, logits[i][0])]
                s.used = self._tick()
                self._roll_back(i)
                continue
            drafts, picks = tokens[1:], []
            for row in logits[i]:  # a pick past the first refused draft is never used
                picks.append(s.sampler(np.asarray(row, np.float32), [*s.cached, *tokens[:1],
                                                                     *picks]))
                if len(picks) > len(drafts) or picks[-1] != drafts[len(picks) - 1]:
                    break
            m = accept_drafts(drafts, picks)
            assert s.budget is not None
            s.budget.record(len(drafts), m)
            self.drafted += len(drafts)
            self.accepted += m
            s.cached += tokens[:m + 1]
            s.pending = picks[m]
            s.used = self._tick()
            out[i] = picks[:m + 1]
            self._roll_back(i)
        return out

    def _roll_back(self, i: int) -> None:
        """Slot i's cache back to its accepted tokens: the state's length (rows, sequential)
        or the blocks past them (batched: back to the pool)."""
        s = self.slots[i]
        if self.mode == "batched":
            keep = -(-len(s.cached) // BLOCK)
            self.cache.pool.release(s.blocks[keep:])
            del s.blocks[keep:]
        elif self.mode == "rows":
            s.state = (s.state[0], len(s.cached))  # type: ignore[index]
        else:
            engine = self.engine
            saved = engine.swap_cache(s.state)
            try:
                engine.trim(engine.offset - len(s.cached))
            finally:
                s.state = engine.swap_cache(saved)

    def _verify_sequential(self, given: dict[int, list[int]]) -> dict[int, np.ndarray]:
        engine, out = self.engine, {}
        for i, tokens in given.items():
            s = self.slots[i]
            saved = engine.swap_cache(s.state)
            try:
                out[i] = engine.verify(np.array([tokens], np.int64))
            finally:
                s.state = engine.swap_cache(saved)
        return out

    def _verify_rows(self, given: dict[int, list[int]]) -> dict[int, np.ndarray]:
        """The rows without drafts in one run of the lowered graph (RowBatch.step); each row
        with drafts in a run of its own through the single-sequence path on its row's views:
        onnxruntime's GroupQueryAttention refuses several new tokens a row in a batch with a
        past ("batch_size must be 1 when sequence_length > 1 and past context is given").
        The shared run goes first: its dummy writes land at the drafted rows' lengths, which
        their own runs then write."""
        assert self._rows is not None
        last = self._rows.last_position
        single = {i: t[0] for i, t in given.items() if len(t) == 1}
        out: dict[int, np.ndarray] = {}
        if single:
            logits = self._rows.step(single, [min(len(s.cached), last) for s in self.slots])
            out.update({i: row[None] for i, row in logits.items()})
        drafted = {i: t for i, t in given.items() if len(t) > 1}
        if drafted:
            out.update(self._verify_sequential(drafted))
        return out

    def _verify_blocks(self, given: dict[int, list[int]]) -> dict[int, mx.array]:
        """One run of the batched program over the block cache, s tokens a row (dummies after
        a row's own), each row first given writable blocks for its s positions (a row whose
        blocks run out gets fewer drafts)."""
        feed = list(given)
        s_len = max(len(t) for t in given.values())
        for i in feed:  # the blocks for positions len .. len + s_len - 1
            s = self.slots[i]
            end = len(s.cached) + s_len
            while len(s.blocks) * BLOCK < end:
                self._make_room(1, spare=i)
                try:
                    s.blocks.append(self.cache.pool.alloc())
                except IndexError:
                    break
            if len(s.blocks) * BLOCK < end:  # the pool is full: this step's tokens shrink
                s_len = len(s.blocks) * BLOCK - len(s.cached)
        given = {i: t[:s_len] for i, t in given.items()}
        ids = np.zeros((len(feed), s_len), np.uint32)
        for r, i in enumerate(feed):
            ids[r, :len(given[i])] = given[i]
        offsets = mx.array(np.array([len(self.slots[i].cached) for i in feed], np.int32))
        logits, _, *new_kv = self._verify(mx.array(ids), offsets,  # type: ignore[misc]
                                          self._block_table(feed, s_len),
                                          *self.cache.buffers())
        self.cache.adopt(new_kv)
        del new_kv
        host = np.array(logits)
        return {i: host[r, :len(given[i])] for r, i in enumerate(feed)}

    def _advance(self, i: int, logits: object) -> int:
        """Slot i's fed token joins its cache; its next token is sampled from `logits`."""
        s = self.slots[i]
        assert s.pending is not None
        s.cached.append(s.pending)
        return self._sample(i, np.asarray(logits, np.float32))

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
                s.prompt_logits = None
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
        if done is not None:
            self._mask_picks(done, rows)
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
        others their host `pending` token. On a pipeline stage the rows go in micro-batches
        (_queue_micro)."""
        n = len(feed)
        parts = _split(n, min(self.micro_batches, n)) if self._pipe is not None else [n]
        steady = prev is not None and from_device == feed == [i for i, _ in prev.rows]
        if len(parts) > 1 and steady and prev is not None and [
                b.rows for b in prev.batches] == parts and not any(
                self.slots[i].constraint for i in feed):
            # the steady state of a pipeline: micro-batch j fed the argmax of the step
            # before's micro-batch j, entering as soon as that one leaves the last stage (a
            # row under a grammar takes the masked argmax of the whole step instead)
            return self._queue_micro(feed, parts, None, prev.next_offsets, prev)
        if prev is not None:  # its argmax, whole, for the rows fed from it
            self._settle(prev)
        if steady:
            # the steady state: the same rows as the step before, each one position on, fed
            # its argmax: nothing goes up from the host but a changed block table
            assert prev is not None and prev.picks is not None
            tokens, offsets = prev.picks, prev.next_offsets
            written = None if prev.written is None else prev.written + 1
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
            written = np.array([len(self.slots[i].cached) for i in feed], np.int32)
            offsets = mx.array(written)
        if len(parts) > 1:
            return self._queue_micro(feed, parts, tokens, offsets, None)
        self._settle_all()  # a pipeline's micro-batches still on their way go first
        # The pools go to the call straight from the cache, with no list of them kept past
        # it: adopt() drops the cache's references, so the program's row writes update
        # donated buffers in place; a list still alive at evaluation made MLX copy every
        # layer's whole pool each step.
        fn = self._fn  # _fn_open where no row's write completes a key group
        if (self._fn_open is not None and written is not None
                and completes_no_key_group(written)):
            fn = self._fn_open
        logits, nxt, *new_kv = fn(tokens.reshape(n, 1), offsets, self._block_table(feed),
                                  *self.cache.buffers())
        self.cache.adopt(new_kv)
        del new_kv
        step = _Step([(i, self.slots[i].epoch) for i in feed], None, None, None, nxt,
                     wants=self._wants(feed), written=written)
        self._finish(step, logits)
        return step

    def _queue_micro(self, feed: list[int], parts: list[int], tokens: mx.array | None,
                     offsets: mx.array, prev: _Step | None) -> _Step:
        """The step's rows in micro-batches of `parts` rows through the pipeline's stages
        (pipeline_steps.py): fed `tokens`, or (None) each the argmax of prev's micro-batch in
        its place. Queued until every micro-batch has entered the first stage; the step is
        read once they all left the last (_settle)."""
        wants = self._wants(feed)
        table = self._block_table(feed)
        batches: list[MicroBatch] = []
        at = 0
        for j, rows in enumerate(parts):
            batches.append(MicroBatch(
                rows, None if tokens is None else tokens[at:at + rows], offsets[at:at + rows],
                table[at:at + rows], None if prev is None else prev.batches[j],
                want_picks=wants[0]))
            at += rows
        assert self._pipe is not None
        self._pipe.start(batches)
        return _Step([(i, self.slots[i].epoch) for i in feed], None, None, None, offsets + 1,
                     batches=batches, wants=wants)

    def _wants(self, feed: list[int]) -> tuple[bool, bool, int | None]:
        """What a step's reader takes of the `feed` rows: the argmax (a greedy row), the
        logits (rows sampled on the host, greedy rows masked on the device), the k likeliest
        (a greedy row's logprobs)."""
        greedy = any(self.slots[i].greedy for i in feed)
        keep = any(not self.slots[i].greedy or self.slots[i].constraint for i in feed)
        k = max((self.slots[i].top_logprobs for i in feed if self.slots[i].greedy
                 and self.slots[i].top_logprobs is not None), default=None)
        return greedy, keep, k

    def _finish(self, step: _Step, logits: mx.array) -> None:
        """The step's argmax, logits and top figures out of its logits [rows, vocab], queued."""
        greedy, keep, k = step.wants
        if step.batches and greedy:
            picks = mx.concatenate([b.picks for b in step.batches])  # type: ignore[misc]
        else:
            picks = mx.argmax(logits, axis=-1) if greedy else None
        top = None
        if k is not None:  # float32: a float16 model's logits would round the log-sum-exp
            z = logits.astype(mx.float32)
            k = min(max(k, 1), z.shape[-1])
            ids = mx.argpartition(-z, kth=k - 1, axis=-1)[:, :k]
            top = (mx.logsumexp(z, axis=-1), z.max(axis=-1), ids,
                   mx.take_along_axis(z, ids, axis=-1))
        mx.async_eval(*(x for x in (picks, logits if keep else None, *(top or ()))
                        if x is not None))
        step.picks, step.top, step.logits = picks, top, logits if keep else None

    def _settle(self, step: _Step) -> None:
        """A micro-batched step's micro-batches through the last stage, and its figures made
        (_finish); nothing for a step already settled or not micro-batched."""
        if not step.batches or step.picks is not None or step.logits is not None:
            return
        assert self._pipe is not None
        self._pipe.settle(step.batches)
        if step.wants[0] or step.wants[1]:
            self._finish(step, mx.concatenate([b.logits for b in step.batches]))  # type: ignore[misc]

    def _settle_all(self) -> None:
        """Every micro-batch on its way through the pipeline out of it (before the block
        cache changes hands: no pending write may land in a block given to another row)."""
        if self._pipe is None:
            return
        if self._inflight is not None:
            self._settle(self._inflight)
        self._pipe.settle()

    def _mask_picks(self, done: _Step, rows: list[int]) -> None:
        """The argmax of `done`'s greedy rows under a grammar, over the logits each allows:
        their masks (from their grammar state, current up to the token `done` was fed) made on
        the host while the device runs `done`, then one masked argmax there. Other rows' picks
        are unchanged (every token allowed)."""
        masked = [i for i in rows if self.slots[i].greedy and self.slots[i].constraint]
        if not masked:
            return
        self._settle(done)
        assert done.logits is not None and done.picks is not None
        where = {i: r for r, (i, _) in enumerate(done.rows)}
        vocab = done.logits.shape[-1]
        bits = np.full((len(done.rows), (vocab + 31) // 32), -1, np.int32)
        fill_masks([(self.slots[i].constraint, where[i]) for i in masked],  # type: ignore[misc]
                   bits)
        shifts = mx.arange(32, dtype=mx.int32)
        allowed = ((mx.array(bits)[:, :, None] >> shifts) & 1).reshape(len(done.rows), -1)
        done.picks = mx.argmax(mx.where(allowed[:, :vocab].astype(mx.bool_), done.logits,
                                        -mx.inf), axis=-1)

    def _block_table(self, feed: list[int], ahead: int = 1) -> mx.array:
        """The fed rows' block tables, [rows, W] int32: W covers the longest fed row's next
        position rounded up to the span step (a few compiled traces in all, not one per
        token), or every row's most blocks (span step 0: the attention kernel reads each row's
        own length). Entries past a row's blocks are never read (block 0). Sent up only when it
        changed (a row took a block, or the rows changed)."""
        w = self.row_blocks
        if self._span_step:
            need = max(len(self.slots[i].cached) for i in feed) + ahead
            span = -(-need // self._span_step) * self._span_step
            w = min(w, -(-span // BLOCK))
        tails = self.cache.keys_per_channel  # a last column: each row's tail slot
        table = np.zeros((len(feed), w + tails), np.int32)
        for r, i in enumerate(feed):
            b = self.slots[i].blocks
            table[r, :len(b)] = b
            if tails:
                table[r, -1] = i
        if self._table is None or not np.array_equal(self._table[0], table):
            self._table = (table, mx.array(table))
        return self._table[1]

    def _read(self, done: _Step, rows: list[int]) -> dict[int, int]:
        """The tokens of a queued step for its `rows` (waits for it): greedy rows its device
        argmax, the others sampled on the host from its logits."""
        out: dict[int, int] = {}
        if not rows:
            return out
        self._settle(done)
        where = {i: r for r, (i, _) in enumerate(done.rows)}
        chosen = done.picks.tolist() if done.picks is not None else []
        top = [np.array(x) for x in done.top] if done.top is not None else []
        for i in rows:
            s = self.slots[i]
            if s.greedy:
                s.pending = int(chosen[where[i]])  # type: ignore[index]
                if s.top_logprobs is not None:
                    s.logprobs.append(_device_logprobs(top, where[i], s.pending,
                                                       s.top_logprobs))
                if s.constraint is not None:  # masked on the device: the grammar moves on
                    s.constraint.advance(s.pending)
            else:
                assert done.logits is not None
                self._sample(i, np.array(done.logits[where[i]], np.float32))
            out[i] = s.pending
        return out

    def describe(self) -> dict[str, object]:
        out: dict[str, object] = {"mode": self.mode, "max_batch": self.max_batch,
                                  "max_context": self.max_context, "active": len(self.active),
                                  "kv_budget_tokens": self.kv_budget}
        if self.mode == "batched":
            pool = self.cache.pool
            out.update(kv_block=BLOCK, kv_blocks=len(pool.refs), kv_blocks_free=pool.available)
        if self._pipe is not None:  # and how many of its slots kept every rank busy
            out.update(micro_batches=self.micro_batches, pipeline_slots=self._pipe.slots,
                       pipeline_full_slots=self._pipe.full_slots)
        return out


def _split(n: int, parts: int) -> list[int]:
    """n rows in `parts` micro-batches, in order, the first ones one row longer."""
    base, extra = divmod(n, parts)
    return [base + (1 if j < extra else 0) for j in range(parts)]
