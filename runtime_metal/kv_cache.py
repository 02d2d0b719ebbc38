"""The KV cache of one layer: buffers preallocated in blocks of 256 positions (mlx-lm's shape),
rows written in place, and the one definition of a cache write (`write_rows`), which the
node-by-node executor and the compiled program (decode.py) both use.

Buffers are [batch, kv_heads, capacity, head_dim]. `offset` is how many positions are cached
(the same for every row of a single-sequence cache; batch.py keeps per-row lengths itself and
writes with a per-row offset array).
"""

from __future__ import annotations

import mlx.core as mx


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
