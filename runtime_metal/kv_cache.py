"""KV cache preallocated in steps of 256 positions (mlx-lm's shape) and written in place."""

from __future__ import annotations

import mlx.core as mx


class KVCache:
    step = 256

    def __init__(self) -> None:
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append [b, Hk, s, D] keys/values; return views of everything cached so far."""
        prev = self.offset
        s = keys.shape[2]
        if self.keys is None or prev + s > self.keys.shape[2]:
            b, h, _, d = keys.shape
            n = (self.step + s - 1) // self.step * self.step
            new_k = mx.zeros((b, h, n, d), keys.dtype)
            new_v = mx.zeros((b, h, n, values.shape[3]), values.dtype)
            if self.keys is not None:
                self.keys = mx.concatenate([self.keys[..., :prev, :], new_k], axis=2)
                self.values = mx.concatenate([self.values[..., :prev, :], new_v], axis=2)
            else:
                self.keys, self.values = new_k, new_v
        self.offset += s
        self.keys[..., prev:self.offset, :] = keys
        self.values[..., prev:self.offset, :] = values
        return self.keys[..., :self.offset, :], self.values[..., :self.offset, :]

    def state(self) -> tuple[mx.array, mx.array]:
        assert self.keys is not None and self.values is not None
        return self.keys[..., :self.offset, :], self.values[..., :self.offset, :]

    def trim(self, n: int) -> None:
        """Forget the last n positions (the buffer is kept)."""
        self.offset = max(self.offset - n, 0)

    def reset(self) -> None:
        self.offset = 0
