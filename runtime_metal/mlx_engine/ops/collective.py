"""The ops a sharded graph adds (domain fuselm.dist, mlx_engine/shard.py says where): MLX's
distributed collectives over the process group mx.distributed.init() made (ring, JACCL or
NCCL, as mlx.launch started the ranks). Every rank runs the same steps in the same order, so
each collective meets its partners.

A pipeline's hidden state goes from rank r to r + 1 as an all_sum to which only rank r adds
non-zeros (x + 0 is x exactly), not as send/recv: MLX's NCCL backend has no send/recv. Every
rank takes part in each of the P - 1 hand-overs, in stage order: rank r's PipeRecv joins
hand-overs 0..r-1 (the last is its input), its PipeSend hand-over r (its own) and r+1..P-2."""

from __future__ import annotations

from types import ModuleType

import mlx.core as mx

from fuselm.runtime_metal.dtypes import onnx_dtype
from fuselm.runtime_metal.mlx_engine.ops.registry import op

D = "fuselm.dist"


@op(D, "AllSum")
def all_sum(xp: ModuleType, x):  # noqa: ANN001, ANN201
    """The ranks' partial products of a row-split projection (o_proj, down_proj), added."""
    return mx.distributed.all_sum(x)


@op(D, "AllGatherLast")
def all_gather_last(xp: ModuleType, x):  # noqa: ANN001, ANN201
    """Each rank's columns of the last axis (its vocabulary slice of the logits), joined in
    rank order: all_gather joins along axis 0."""
    return mx.moveaxis(mx.distributed.all_gather(mx.moveaxis(x, -1, 0)), 0, -1)


@op(D, "ShardIndex", host=True)
def shard_index(xp: ModuleType, ids, *, lo: int, hi: int):  # noqa: ANN001, ANN201
    """Token ids as rows of this rank's vocabulary slice [lo, hi); others read row 0 (their
    rows are zeroed by VocabSum)."""
    local = ids - lo
    return xp.where((local < 0) | (local >= hi - lo), 0, local)


@op(D, "VocabSum")
def vocab_sum(xp: ModuleType, x, ids, *, lo: int, hi: int):  # noqa: ANN001, ANN201
    """Embedding rows looked up in each rank's vocabulary slice: the rows of ids outside it
    zeroed, then added over the ranks (exactly one rank holds each id)."""
    mine = mx.logical_and(ids >= lo, ids < hi).reshape(*ids.shape, 1)
    return mx.distributed.all_sum(mx.where(mine, x, mx.zeros((), x.dtype)))


def _hand_overs(x: mx.array, count: int, after: mx.array | None = None) -> mx.array:
    """`count` hand-overs of arrays shaped like x, each an all_sum of zeros from this rank,
    one after the other (after `after`); the last one's sum."""
    out = after
    for _ in range(count):
        zeros = mx.zeros(x.shape, x.dtype)
        out = mx.distributed.all_sum(zeros if out is None else mx.depends(zeros, out))
    assert out is not None
    return out


@op(D, "PipeRecv")
def pipe_recv(xp: ModuleType, ids, *, src: int, width: int, elem_type: int):  # noqa: ANN001, ANN201
    """The hidden state [batch, seq, width] from the previous pipeline rank (src): the
    hand-overs up to its own, the last of them."""
    like = mx.zeros((*ids.shape, width), onnx_dtype(mx, elem_type))
    return _hand_overs(like, src + 1)


@op(D, "PipeSend")
def pipe_send(xp: ModuleType, h, *, dst: int, elem_type: int):  # noqa: ANN001, ANN201
    """The hidden state to the next pipeline rank (dst), in the dtype it receives: this
    rank's hand-over, then the later stages' ones; the result (the last sum) is what the
    logits step depends on, so evaluating the logits makes them all."""
    sent = mx.distributed.all_sum(h.astype(onnx_dtype(mx, elem_type)))
    later = mx.distributed.init().size() - 1 - dst
    return _hand_overs(sent, later, sent) if later else sent


@op(D, "PipeLogits")
def pipe_logits(xp: ModuleType, *xs, vocab: int, own: int):  # noqa: ANN001, ANN201
    """The logits on every rank of a pipeline: the last rank (own=1) contributes its LM head's
    logits, the others zeros shaped like them (rows of their sent hidden state, which they
    wait for), and one sum over the ranks gives each the last rank's logits exactly."""
    if own:
        return mx.distributed.all_sum(xs[0].astype(mx.float32))
    h = xs[0]
    zeros = mx.depends(mx.zeros((*h.shape[:-1], vocab), mx.float32), list(xs))
    return mx.distributed.all_sum(zeros)
