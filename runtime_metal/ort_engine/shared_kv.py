"""The KV buffers of a lowered onnxruntime graph (ort_lowering.py): one float32 buffer per
past/present pair, bound as both, so GroupQueryAttention writes the new positions in place.

Buffers hold `capacity` positions ([1, kv_heads, capacity, head_dim]); `offset` of them are
valid, and the graph learns that from attention_mask's length. Trimming only lowers the
offset; growing copies the valid rows into a larger buffer (reserve() sizes it once per
generation, as the MLX cache does). A state (buffers, offset) is owned by whoever holds it:
swapping one in and decoding writes into its buffers.
"""

from __future__ import annotations

import numpy as np

from fuselm.runtime_metal.graph_io import present_for

GROW = 256  # positions added beyond a request, so decoding does not regrow every step


class SharedKV:
    def __init__(self, past_names: list[str], kv_heads: int, head_dim: int) -> None:
        self.past_names = past_names
        self.shape = (1, kv_heads, 0, head_dim)
        self.reset()

    def reset(self) -> None:
        self.buffers = {n: np.zeros(self.shape, np.float32) for n in self.past_names}
        self.offset = 0
        self._values: dict[str, object] | None = None  # OrtValues over the buffers, made once
        self._bound: object = None  # the binding those OrtValues are bound to

    @property
    def capacity(self) -> int:
        return next(iter(self.buffers.values())).shape[2] if self.buffers else 0

    def reserve(self, n: int) -> None:
        """Room for n positions: a larger buffer holding the valid rows, if needed."""
        if n <= self.capacity:
            return
        b, h, _, d = self.shape
        grown = {}
        for name, buf in self.buffers.items():
            new = np.zeros((b, h, n, d), np.float32)
            new[:, :, :self.offset] = buf[:, :, :self.offset]
            grown[name] = new
        self.buffers, self._values = grown, None

    def trim(self, n: int) -> None:
        self.offset = max(self.offset - n, 0)

    def bind(self, binding: object, ort_value: object) -> None:
        """Bind every buffer as its past input and its present output (the same memory), unless
        this binding holds them already (rebinding them costs 4 binds per layer per step)."""
        if self._values is None:  # an OrtValue from numpy wraps the array's memory, no copy
            self._values = {n: ort_value.ortvalue_from_numpy(b)  # type: ignore[attr-defined]
                            for n, b in self.buffers.items()}
            self._bound = None
        if self._bound is binding:
            return
        self._bound = binding
        for name, value in self._values.items():
            binding.bind_ortvalue_input(name, value)  # type: ignore[attr-defined]
            binding.bind_ortvalue_output(present_for(name), value)  # type: ignore[attr-defined]

    def swap(self, state: tuple[dict[str, np.ndarray], int] | None
             ) -> tuple[dict[str, np.ndarray], int]:
        old = (self.buffers, self.offset)
        if state is None:
            self.reset()
        else:
            self.buffers, self.offset = dict(state[0]), state[1]
        self._values = None
        return old
