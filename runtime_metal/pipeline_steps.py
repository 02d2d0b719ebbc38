"""Micro-batched decode steps of a pipeline-parallel model (`--parallel pipeline`): the batch
decoder's rows split into micro-batches, so that while rank r runs its layers over one, rank
r + 1 runs its own over the one before, and no rank waits for the whole batch to pass.

Without it a step of b rows goes through the stages one after another (each rank idle while
the others work: P ranks, 1/P of the time busy). With the rows in P micro-batches the step is
a wavefront of slots: in slot k, rank r runs micro-batch k - r through its stage alone (the
engine's `stage_program`: DecodeProgram.paged_stage, no collective inside), then every rank
joins the slot's ONE collective, an all_sum of a buffer that holds, at fixed places, the
hidden state each stage hands to the next and the logits of the micro-batch that left the
last stage (each rank writes its own parts, zeros elsewhere: the sum is each part exactly).
A collective is the same call on every backend (MLX's NCCL has no send/recv), and one a slot
keeps the order of collectives, which every rank must share, a plain function of the schedule.

Every rank makes the same decoder calls (the server's followers replay rank 0's), so every
rank builds the same schedule. Slots are built and submitted (mx.async_eval, one collective
each, in order) only here, only when the decoder asks:
- `start(batches)`: slots until every new micro-batch has entered the first stage. A
  micro-batch fed the device argmax of one of the step before enters once that one has left
  the last stage; its slot also carries the earlier micro-batches on, so consecutive steps
  overlap (in the steady state of P micro-batches every rank is busy in every slot).
- `settle(batches)`: slots until those have left the last stage (their logits are then
  lazy arrays over submitted work only).
Micro-batches started and not settled stay pending between decoder calls; the decoder
settles everything before it changes the block cache's ownership (a row joins, forks or
leaves), so no pending write lands in a block given to another sequence.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

StageFn = Callable[..., tuple[mx.array, ...]]


@dataclass
class MicroBatch:
    """Some of a step's rows: what their first stage is fed, and where they are."""

    rows: int
    tokens: mx.array | None  # [rows] fed to the first stage; None: fed_from's argmax
    offsets: mx.array  # [rows] the rows' positions
    table: mx.array  # the rows' block tables [rows, W]
    # the micro-batch of the step before whose argmax this one is fed: it enters the first
    # stage only once that one has left the last
    fed_from: MicroBatch | None = None
    stage: int = -1  # the stage it runs in the next slot (-1: not entered)
    hidden: mx.array | None = None  # this rank's input when `stage` is this rank's
    logits: mx.array | None = None  # [rows, vocab] float32, once out of the last stage
    picks: mx.array | None = None  # its argmax per row, when asked for (`want_picks`)
    want_picks: bool = False

    @property
    def done(self) -> bool:
        return self.logits is not None


class PipelineSteps:
    """The slots of one rank of a pipeline over the batch decoder's block cache."""

    def __init__(self, fn: StageFn, rank: int, size: int, width: int, vocab: int,
                 buffers: Callable[[], list[mx.array]],
                 adopt: Callable[[list[mx.array]], None]) -> None:
        self.fn = fn
        self.rank, self.size = rank, size
        self.width, self.vocab = width, vocab
        self.buffers, self.adopt = buffers, adopt
        self.pending: list[MicroBatch] = []  # entered, not out of the last stage
        self.slots = 0  # slots run
        self.full_slots = 0  # of them, those where every rank ran its stage
        self._none = mx.zeros((1, 1, width), mx.float32)  # the first stage's unread input

    def start(self, batches: list[MicroBatch]) -> None:
        """Slots until every one of `batches` has entered the first stage (in order)."""
        waiting = list(batches)
        while waiting:
            source = waiting[0].fed_from
            entering = waiting[0] if source is None or source.done else None
            if entering is not None:
                waiting.pop(0)
            self._slot(entering)

    def settle(self, batches: list[MicroBatch] | None = None) -> None:
        """Slots until `batches` (None: every pending one) have left the last stage."""
        while any(not b.done for b in (self.pending if batches is None else batches)):
            self._slot(None)

    def _slot(self, entering: MicroBatch | None) -> None:
        if entering is not None:
            entering.stage = 0
            self.pending.append(entering)
        if not self.pending:
            raise RuntimeError("a pipeline slot with nothing to run")
        self.slots += 1
        self.full_slots += len(self.pending) == self.size
        mine = next((b for b in self.pending if b.stage == self.rank), None)
        out = self._run_stage(mine) if mine is not None else None
        # the slot's buffer: per running micro-batch, last stage first, its logits (leaving
        # the last stage) or its hidden state (for the next stage)
        order = sorted(self.pending, key=lambda b: -b.stage)
        sizes = [b.rows * (self.vocab if b.stage == self.size - 1 else self.width)
                 for b in order]
        parts = [out.reshape(-1) if b is mine and out is not None
                 else mx.zeros((n,), mx.float32) for b, n in zip(order, sizes, strict=True)]
        total = mx.distributed.all_sum(mx.concatenate(parts) if len(parts) > 1 else parts[0])
        mx.async_eval(total)
        at = 0
        for b, n in zip(order, sizes, strict=True):
            part = total[at:at + n]
            at += n
            if b.stage == self.size - 1:
                b.logits = part.reshape(b.rows, self.vocab)
                if b.want_picks:
                    b.picks = mx.argmax(b.logits, axis=-1)
            elif b.stage + 1 == self.rank:
                b.hidden = part.reshape(b.rows, 1, self.width)
            else:
                b.hidden = None
            b.stage += 1
        self.pending = [b for b in self.pending if not b.done]

    def _run_stage(self, b: MicroBatch) -> mx.array:
        """This rank's layers over micro-batch b: its hidden state [rows, width] float32 for
        the next stage, or on the last stage its logits [rows, vocab]."""
        source = b.fed_from
        tokens = b.tokens if source is None else source.picks
        assert tokens is not None
        if self.rank == 0:
            hidden = self._none
        else:
            assert b.hidden is not None
            hidden, b.hidden = b.hidden, None
        out, _, *new_kv = self.fn(tokens.reshape(b.rows, 1), b.offsets, b.table, hidden,
                                  *self.buffers())
        self.adopt(new_kv)
        del new_kv
        return out
