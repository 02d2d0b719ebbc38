"""The block KV cache (kv_cache.BlockPool / BlockCache, batch.py's batched mode): the free list
and reference counts, copy on write of a shared block, block reads and writes against a
contiguous cache, a short row holding only its own blocks beside a long one, prompt prefixes
shared by reference between running and finished sequences with the tokens unchanged, and a
pool too small for a prompt refused in one line."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from fuselm.runtime_metal.batch import BatchDecoder
from fuselm.runtime_metal.engine import make_engine
from fuselm.runtime_metal.errors import RuntimeUserError
from fuselm.runtime_metal.generate import generate
from fuselm.runtime_metal.kv_cache import (
    BLOCK,
    BlockIndex,
    BlockPool,
    read_blocks,
    write_blocks,
)

N = 8


def test_free_list_and_reference_counts() -> None:
    pool = BlockPool(4)
    a, b = pool.alloc(), pool.alloc()
    assert (a, b) == (0, 1) and pool.available == 2
    pool.share(a)  # a second table holds block a
    pool.release([a])
    assert pool.available == 2 and pool.refs[a] == 1  # still held once
    pool.release([a, b])
    assert pool.available == 4 and pool.refs == [0, 0, 0, 0]
    assert {pool.alloc() for _ in range(4)} == {0, 1, 2, 3}
    with pytest.raises(IndexError):
        pool.alloc()


def test_copy_on_write_of_a_shared_block() -> None:
    pool = BlockPool(3)
    blk = pool.alloc()
    assert pool.writable(blk) == (blk, False)  # held alone: written in place
    pool.share(blk)
    new, copied = pool.writable(blk)  # held twice: the writer gets its own block
    assert copied and new != blk and pool.refs[blk] == 1 and pool.refs[new] == 1


def test_block_reads_and_writes_match_a_contiguous_cache() -> None:
    rng = np.random.default_rng(0)
    rows, heads, d, w = 3, 2, 8, 3
    contiguous = rng.normal(size=(rows, heads, w * BLOCK, d)).astype(np.float32)
    table = rng.permutation(rows * w + 2)[:rows * w].reshape(rows, w).astype(np.int32)
    pool = np.zeros((rows * w + 2, heads, BLOCK, d), np.float32)
    blocks = contiguous.reshape(rows, heads, w, BLOCK, d).transpose(0, 2, 1, 3, 4)
    pool[table.reshape(-1)] = blocks.reshape(-1, heads, BLOCK, d)
    bt = mx.array(table)
    assert np.array_equal(np.array(read_blocks(mx.array(pool), bt)), contiguous)
    offsets = np.array([0, BLOCK + 5, 3 * BLOCK - 1], np.int32)
    new = rng.normal(size=(rows, 1, heads, d)).astype(np.float32)  # [n, s, h, d]
    written = write_blocks(mx.array(pool), mx.array(new), BlockIndex(bt, mx.array(offsets)))
    for r, p in enumerate(offsets):
        contiguous[r, :, p] = new[r, 0]
    index = BlockIndex(bt)  # one step's index, read by both gathers below
    assert np.array_equal(np.array(read_blocks(written, index)), contiguous)
    # three positions a row (a speculative step's), across a block boundary
    offsets = np.array([2, BLOCK - 2, 2 * BLOCK], np.int32)
    new = rng.normal(size=(rows, 3, heads, d)).astype(np.float32)
    written = write_blocks(written, mx.array(new), BlockIndex(bt, mx.array(offsets), 3))
    for r, p in enumerate(offsets):
        contiguous[r, :, p:p + 3] = new[r].transpose(1, 0, 2)
    assert np.array_equal(np.array(read_blocks(written, index)), contiguous)


def _prompt(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(4, 384, n)]


def _tokens(dec: BatchDecoder, slots: list[int], steps: int) -> dict[int, list[int]]:
    got: dict[int, list[int]] = {s: [] for s in slots}
    for _ in range(steps):
        for slot, token in dec.step().items():
            got.setdefault(slot, []).append(token)
    return got


def test_short_rows_hold_their_own_blocks(qwen3_artifact) -> None:  # noqa: ANN001
    """Blocks follow each row's length: a 6-token row beside a 200-token row holds one block
    while the long one holds four; the pool gives back what a finished row held beyond its
    cached prefix."""
    engine = make_engine(qwen3_artifact, "mlx")
    dec = BatchDecoder(engine, max_batch=2, max_context=300)
    assert dec.mode == "batched"
    pool = dec.cache.pool
    total = pool.available
    short, long = dec.add(_prompt(6, 1)), dec.add(_prompt(200, 2))
    _tokens(dec, [short, long], 4)
    held = {s: len(dec.slots[s].blocks) for s in (short, long)}
    assert held == {short: 1, long: -(-(200 + 4) // BLOCK)}
    assert pool.available == total - sum(held.values())
    dec.remove(long)  # its cached tokens stay (prefix reuse): their blocks stay held
    assert pool.available == total - 1 - -(-dec.length(long) // BLOCK)


def test_prefix_blocks_are_shared_by_reference(qwen3_artifact) -> None:  # noqa: ANN001
    """Two requests with a common 150-token prefix, both running: the second holds the first's
    two whole blocks of it by reference (the same block ids, held twice) and a copy of the
    partly shared third; a later turn extending a finished sequence reuses its blocks; every
    sequence's greedy tokens are its solo run's."""
    engine = make_engine(qwen3_artifact, "mlx")
    base = _prompt(150, 3)
    a_prompt, b_prompt = base + [5, 6], base + [7, 8, 9]
    want_a = generate(engine, a_prompt, max_new_tokens=N).tokens
    want_b = generate(engine, b_prompt, max_new_tokens=N).tokens
    dec = BatchDecoder(engine, max_batch=3, max_context=256)
    pool = dec.cache.pool
    a = dec.add(a_prompt)
    got = _tokens(dec, [a], 2)
    b = dec.add(b_prompt)
    assert dec.slots[b].reused == 150 and b != a
    ta, tb = dec.slots[a].blocks, dec.slots[b].blocks
    assert tb[:2] == ta[:2] and all(pool.refs[x] == 2 for x in ta[:2])
    assert tb[2] != ta[2] and pool.refs[ta[2]] == 1  # copied on write
    more = _tokens(dec, [a, b], N)
    assert got[a] + more[a][:N - 2] == want_a and more[b] == want_b
    # the next turn: a's prompt, its reply and a new message; a has finished
    dec.remove(a)
    turn = a_prompt + want_a[:5] + [11, 12]
    want_turn = generate(engine, turn, max_new_tokens=N).tokens
    c = dec.add(turn)
    assert dec.slots[c].reused == len(a_prompt) + 5
    assert _tokens(dec, [c], N)[c] == want_turn


def test_a_full_pool_refuses_and_evicts_freed_prefixes(qwen3_artifact) -> None:  # noqa: ANN001
    """A pool of 5 blocks: a prompt needing more than the free blocks is refused by name; a
    finished sequence's cached blocks are dropped (least recently used) when a new prompt
    needs them."""
    engine = make_engine(qwen3_artifact, "mlx")
    dec = BatchDecoder(engine, max_batch=2, max_context=250, kv_tokens=5 * BLOCK)
    a = dec.add(_prompt(3 * BLOCK, 4))  # 3 blocks + 1 for its first decoded token
    _tokens(dec, [a], 2)
    with pytest.raises(RuntimeUserError, match="KV cache is full"):
        dec.add(_prompt(2 * BLOCK, 5))
    dec.remove(a)
    p = _prompt(2 * BLOCK, 6)
    b = dec.add(p)  # into the empty slot; a's cached prefix goes to make room
    assert b != a and dec.length(a) == 0 and not dec.slots[a].blocks
    assert _tokens(dec, [b], N)[b] == generate(engine, p, max_new_tokens=N).tokens


def test_kv_token_bytes_is_what_the_caches_hold(qwen3_artifact) -> None:  # noqa: ANN001
    """--memory-limit's conversion: the bytes per token it counts are the block pool's (MLX)
    and a slot's row's (onnxruntime) real bytes per position."""
    from fuselm.runtime_metal.artifact import read_manifest
    from fuselm.runtime_metal.kv_budget import budget_tokens, kv_token_bytes

    manifest = read_manifest(qwen3_artifact)
    dec = BatchDecoder(make_engine(qwen3_artifact, "mlx"), max_batch=2, max_context=100,
                       kv_tokens=3 * BLOCK)
    assert dec.kv_budget == 3 * BLOCK and dec.kv_window == 100
    pool = sum(a.nbytes for a in dec.cache.buffers())
    assert pool == 3 * BLOCK * kv_token_bytes(manifest, "mlx")
    ort = BatchDecoder(make_engine(qwen3_artifact, "onnxruntime"), max_batch=4, max_context=100,
                       kv_tokens=2 * 256 + 100)
    assert ort.max_batch == 2 and ort.kv_budget == 2 * ort.capacity == 512  # whole rows
    ort.add(_prompt(20, 1))
    kv, _ = ort.slots[0].state  # its K/V arrays: its row's views, or its own arrays
    per_position = sum(a.nbytes // a.shape[0] // a.shape[2] for a in kv.values())
    assert per_position == kv_token_bytes(manifest, "onnxruntime")
    assert budget_tokens(None, 0.001, 1000) == 1000
    with pytest.raises(RuntimeUserError, match="not both"):
        budget_tokens(10, 1.0, 1000)


def test_the_window_fits_the_budget_with_drafts(qwen3_artifact) -> None:  # noqa: ANN001
    """The longest sequence the budget holds (what a chat is cut to, and where a request
    without max_tokens stops) reserves no more than the budget, a speculative row's drafted
    positions included."""
    from fuselm.runtime_metal.drafting import PromptLookup

    engine = make_engine(qwen3_artifact, "mlx")
    for drafter in (None, PromptLookup()):
        dec = BatchDecoder(engine, max_batch=2, max_context=250, kv_tokens=3 * BLOCK,
                           drafter=drafter)
        assert dec.kv_cost(dec.kv_window) <= dec.kv_budget < dec.kv_cost(dec.kv_window + 1)
