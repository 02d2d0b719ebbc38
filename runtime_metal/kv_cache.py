"""The KV cache, defined once, in its two forms:

* `KVCache`, one layer of one sequence (the engine's generation loop): buffers preallocated in
  blocks of 256 positions (mlx-lm's shape), rows written in place, and the one definition of a
  cache write (`write_rows`), which the node-by-node executor and the compiled program
  (decode.py) both use. Buffers are [batch, kv_heads, capacity, head_dim]; `offset` is how
  many positions are cached.
* the block cache of the batch decoder (batch.py): `BlockCache`, every layer's pool of
  fixed-size blocks [blocks, kv_heads, BLOCK, head_dim], and `BlockPool`, their free list and
  reference counts. A sequence holds a block table (its blocks in position order), so a row
  holds the blocks of its own length, and a prompt prefix is shared between tables by
  reference, copied only when a table writes into a shared block (`BlockPool.writable`).
  `write_blocks` / `read_blocks` are the block forms of the write and of the read attention
  does (attention.Attention.over_cache); the CUDA attention kernel reads and writes through
  the table itself (cuda_kernels/sources.py).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np


def write_rows(buf: mx.array, rows: mx.array, offset: mx.array | int) -> mx.array:
    """buf[:, :, offset:offset + s] = rows [b, h, s, d]; in place when `buf` is donated (the
    compiled program) or the only reference. `offset`: a scalar (every row at one position) or
    an int32 array [b] (one position per batch row; s must then be 1).

    One row per batch entry is a scatter: MLX-CUDA launches its dynamic slice update over the
    whole destination (measured: the cost grows with the cache's capacity) plus an offset
    kernel; the scatter is one launch over the rows."""
    rows = rows.astype(buf.dtype)
    off = offset if isinstance(offset, mx.array) else mx.array(offset, mx.int32)
    if rows.shape[2] == 1:
        index = mx.broadcast_to(off.reshape(-1, 1, 1, 1), rows.shape)
        return mx.put_along_axis(buf, index, rows, axis=2)
    if off.size != 1:
        raise ValueError("a per-row offset writes one position per row")
    return mx.slice_update(buf, rows, off.reshape(1), axes=(2,))


class KVCache:
    step = 256

    def __init__(self) -> None:
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def allocate(self, batch: int, kv_heads: int, k_dim: int, v_dim: int, dtype: mx.Dtype,
                 capacity: int = 0) -> None:
        """Empty buffers (capacity rounded up to whole blocks); drops what was cached."""
        n = -(-capacity // self.step) * self.step
        self.keys = mx.zeros((batch, kv_heads, n, k_dim), dtype)
        self.values = mx.zeros((batch, kv_heads, n, v_dim), dtype)
        self.offset = 0

    def reserve(self, n: int) -> None:
        """Capacity for n positions, grown in whole blocks (each capacity is one compiled
        shape for the program: traced once, then cached). Needs allocated buffers."""
        assert self.keys is not None and self.values is not None, "allocate first"
        if n <= self.capacity:
            return
        b, h, cap, dk = self.keys.shape
        extra = -(-(n - cap) // self.step) * self.step
        self.keys = mx.concatenate([self.keys, mx.zeros((b, h, extra, dk), self.keys.dtype)],
                                   axis=2)
        self.values = mx.concatenate(
            [self.values, mx.zeros((b, h, extra, self.values.shape[3]), self.values.dtype)],
            axis=2)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append [b, Hk, s, D] keys/values at `offset`; return views of everything cached."""
        if self.keys is None:
            b, h, s, d = keys.shape
            self.allocate(b, h, d, values.shape[3], keys.dtype)
        prev = self.offset
        self.reserve(prev + keys.shape[2])
        assert self.keys is not None and self.values is not None
        self.keys = write_rows(self.keys, keys, prev)
        self.values = write_rows(self.values, values, prev)
        self.offset = prev + keys.shape[2]
        return self.state()

    def buffers(self) -> tuple[mx.array, mx.array]:
        """The whole buffers (every position up to capacity), for the compiled program."""
        assert self.keys is not None and self.values is not None
        return self.keys, self.values

    def adopt(self, keys: mx.array, values: mx.array, offset: int) -> None:
        """Take the buffers a compiled call returned (it wrote rows into donated copies)."""
        if keys.shape != self.keys.shape:  # type: ignore[union-attr]
            raise ValueError("adopted buffers must keep the cache's shape")
        self.keys, self.values, self.offset = keys, values, offset

    def state(self) -> tuple[mx.array, mx.array]:
        assert self.keys is not None and self.values is not None
        return self.keys[..., :self.offset, :], self.values[..., :self.offset, :]

    def trim(self, n: int) -> None:
        """Forget the last n positions (the buffer is kept)."""
        self.offset = max(self.offset - n, 0)

    def reset(self) -> None:
        self.offset = 0


# ---- the block cache (batch.py): fixed-size blocks, a free list, shared prefixes --------------

BLOCK = 64  # positions a block holds (a power of two: the attention kernel divides by it)


class BlockPool:
    """Which blocks of a pool are free and how many block tables hold each. A block held by
    two tables (a shared prompt prefix) is read by both and written by neither: the table that
    writes into it first takes a private copy (`writable`: copy on write)."""

    def __init__(self, blocks: int) -> None:
        if blocks < 1:
            raise ValueError("a block pool needs at least one block")
        self.refs = [0] * blocks
        self.free = list(range(blocks - 1, -1, -1))  # popped from the end: block 0 first

    @property
    def available(self) -> int:
        return len(self.free)

    def alloc(self) -> int:
        """A free block, held once; IndexError when none is free."""
        if not self.free:
            raise IndexError("no free KV block")
        b = self.free.pop()
        self.refs[b] = 1
        return b

    def share(self, block: int) -> int:
        """One more table holds `block` (by reference: no copy)."""
        assert self.refs[block] > 0, "sharing a free block"
        self.refs[block] += 1
        return block

    def release(self, blocks: list[int]) -> None:
        """A table lets go of `blocks`; a block no table holds goes back to the free list."""
        for b in blocks:
            assert self.refs[b] > 0, "releasing a free block"
            self.refs[b] -= 1
            if not self.refs[b]:
                self.free.append(b)

    def writable(self, block: int) -> tuple[int, bool]:
        """The block a table may write in place of `block`: itself when it holds it alone,
        else a new one (the caller copies the contents over and drops its hold on the shared
        one: returns (new, True))."""
        if self.refs[block] == 1:
            return block, False
        new = self.alloc()
        self.release([block])
        return new, True


def write_blocks(pool: mx.array, rows: mx.array, table: mx.array, offset: mx.array
                 ) -> mx.array:
    """pool [blocks, h, BLOCK, d] with row r's new positions rows[r] ([n, h, s, d]) written at
    offset[r]..offset[r]+s-1, each in its block table[r, position // BLOCK]: one scatter on the
    pool itself (no reshape of it in between: the compiled program's donated pool is updated
    in place). s > 1 is the speculative step's drafted tokens."""
    n, h, s, d = rows.shape
    bs = pool.shape[2]
    off = offset.reshape(-1)
    if s == 1:
        blk = mx.take_along_axis(table, (off // bs).reshape(-1, 1), axis=1).reshape(n)
        pool[blk, :, off % bs] = rows.astype(pool.dtype).reshape(n, h, d)
        return pool
    pos = off.reshape(-1, 1) + mx.arange(s, dtype=off.dtype)  # [n, s]
    blk = mx.take_along_axis(table, pos // bs, axis=1)
    pool[blk, :, pos % bs] = rows.astype(pool.dtype).transpose(0, 2, 1, 3)  # [n, s, h, d]
    return pool


def read_blocks(pool: mx.array, table: mx.array) -> mx.array:
    """The positions a block table [n, W] holds, gathered: [n, h, W * BLOCK, d], in one gather
    of the pool's rows (no transposed copy after it)."""
    n, w = table.shape
    _, h, bs, d = pool.shape
    heads = mx.arange(h, dtype=mx.int32).reshape(1, h, 1, 1)
    rows = (table.reshape(n, 1, w, 1) * h + heads) * bs + mx.arange(bs, dtype=mx.int32)
    return mx.take(pool.reshape(-1, d), rows.reshape(n, h, w * bs), axis=0)


class BlockCache:
    """Every layer's K/V pool ([blocks, kv_heads, BLOCK, head_dim] each) and their one
    BlockPool: a block id names the same block in every layer."""

    def __init__(self, layout: list[tuple[int, int, int, mx.Dtype]], blocks: int) -> None:
        self.pool = BlockPool(blocks)
        self.keys = [mx.zeros((blocks, hk, BLOCK, dk), dt) for hk, dk, _, dt in layout]
        self.values = [mx.zeros((blocks, hk, BLOCK, dv), dt) for hk, _, dv, dt in layout]

    def buffers(self) -> list[mx.array]:
        """k_0, v_0, k_1, v_1, ...: the compiled program's cache inputs."""
        return [a for kv in zip(self.keys, self.values, strict=True) for a in kv]

    def adopt(self, arrays: list[mx.array]) -> None:
        """Take the pools a compiled call returned (it wrote rows into donated buffers)."""
        self.keys, self.values = list(arrays[0::2]), list(arrays[1::2])

    def copy_block(self, src: int, dst: int) -> None:
        """dst's contents := src's, in every layer (the copy of copy on write)."""
        for arrays in (self.keys, self.values):
            for i, a in enumerate(arrays):
                a[dst:dst + 1] = a[src:src + 1]
                arrays[i] = a

    def gather(self, blocks: list[int], n: int) -> list[KVCache]:
        """Positions 0..n-1 of the blocks, as one single-sequence cache per layer."""
        out = []
        idx = mx.array(np.asarray(blocks, np.int32).reshape(1, -1))
        for k, v in zip(self.keys, self.values, strict=True):
            c = KVCache()
            c.allocate(1, k.shape[1], k.shape[3], v.shape[3], k.dtype, n)
            c.update_and_fetch(read_blocks(k, idx)[:, :, :n], read_blocks(v, idx)[:, :, :n])
            out.append(c)
        return out

    def scatter(self, caches: list[KVCache], blocks: list[int], start: int, end: int) -> None:
        """Positions start..end-1 of single-sequence `caches` into `blocks` (the table that
        holds them alone: writable)."""
        for i, c in enumerate(caches):
            k, v = c.state()
            for arrays, src in ((self.keys, k), (self.values, v)):
                a = arrays[i]
                p = start
                while p < end:
                    b, lo = blocks[p // BLOCK], p % BLOCK
                    hi = min(BLOCK, lo + end - p)
                    a[b:b + 1, :, lo:hi] = src[:, :, p:p + hi - lo]
                    p += hi - lo
                arrays[i] = a
