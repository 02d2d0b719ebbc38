"""Batched decode on onnxruntime: rows of different lengths in one run of the lowered graph.

The lowered graph (lowering.py) computes GroupQueryAttention's per-row `seqlens_k` from
attention_mask [rows, total] and writes each row's new K/V at its own length, into a KV
buffer bound as both past and present (shared_kv.py). So one buffer of [max_batch, kv_heads,
capacity, head_dim] per layer serves a batch: a step runs rows 0..k-1 (k = the highest row fed
+ 1) with right-padded masks, each row attending to its own positions only; the projections
run once over the k rows. Rows do not move when others join or leave: row i's K/V stay where
they are, and a row inside 0..k-1 that is not fed is given a dummy token at its length, a
position beyond its cached tokens that the next write there overwrites.

A row's buffers are contiguous views (buf[i:i+1]), so a prompt is prefilled straight into its
row by the engine's own single-sequence path (Engine.swap_cache with `state(i)`), no copy.
The binding of the KV views and of a logits buffer is made once per row count and kept: a step
binds only its small inputs and reads the logits where onnxruntime wrote them (asking the
binding for its outputs would wrap all 2 x layers + 1 of them anew every step).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from fuselm.runtime_metal.graph_io import present_for


class RowBatch:
    def __init__(self, session: object, inputs: set[str], past_names: list[str],
                 kv_heads: int, head_dim: int, vocab: int, max_batch: int, capacity: int,
                 max_position: int) -> None:
        """max_position: positions the graph's rotary tables cover (0: no limit)."""
        self.session = session
        self.inputs = inputs
        self.max_batch = max_batch
        self.capacity = capacity
        # The last position a dummy write may use: inside the buffer and the rotary tables.
        self.last_position = min(capacity, max_position or capacity) - 1
        self.vocab = vocab
        self.buffers = {n: np.zeros((max_batch, kv_heads, capacity, head_dim), np.float32)
                        for n in past_names}
        # rows -> binding with their KV views and a logits buffer [rows, 1, vocab] bound
        self._bindings: dict[int, tuple[object, np.ndarray]] = {}
        self._keep: list[object] = []  # the OrtValues those bindings point into

    def state(self, row: int) -> tuple[dict[str, np.ndarray], int]:
        """Row `row`'s cache as an engine cache state (its views, no positions valid)."""
        return {n: b[row:row + 1] for n, b in self.buffers.items()}, 0

    def copy_row(self, src: int, dst: int, n: int) -> tuple[dict[str, np.ndarray], int]:
        """Row `dst` takes row `src`'s first n positions (a sequence forked from another's
        prompt); returns dst's cache state holding them."""
        for buf in self.buffers.values():
            buf[dst, :, :n] = buf[src, :, :n]
        views, _ = self.state(dst)
        return views, n

    def _binding(self, rows: int) -> tuple[object, np.ndarray]:
        if rows not in self._bindings:
            import onnxruntime as ort

            binding = self.session.io_binding()  # type: ignore[attr-defined]
            logits = np.empty((rows, 1, self.vocab), np.float32)
            value = ort.OrtValue.ortvalue_from_numpy(logits)
            self._keep.append(value)
            binding.bind_ortvalue_output("logits", value)
            for name, buf in self.buffers.items():
                value = ort.OrtValue.ortvalue_from_numpy(buf[:rows])
                self._keep.append(value)
                binding.bind_ortvalue_input(name, value)
                binding.bind_ortvalue_output(present_for(name), value)
            self._bindings[rows] = binding, logits
        return self._bindings[rows]

    def step(self, tokens: Mapping[int, int], lengths: Sequence[int]) -> dict[int, np.ndarray]:
        """One new token for each row in `tokens` (row -> token id); `lengths[i]` is row i's
        cached positions (rows not fed included: their dummy write lands there). Returns
        row -> float32 logits [vocab]."""
        rows = max(tokens) + 1
        lens = np.asarray(lengths[:rows], np.int64)
        ids = np.zeros((rows, 1), np.int64)
        for row, token in tokens.items():
            ids[row, 0] = token
        total = int(lens.max()) + 1
        feeds = {
            "input_ids": ids,
            "attention_mask": (np.arange(total)[None, :] <= lens[:, None]).astype(np.int64),
            "position_ids": lens[:, None].copy(),
            "logits_from": np.zeros(1, np.int64),
        }
        binding, logits = self._binding(rows)
        for name, value in feeds.items():
            if name in self.inputs:
                binding.bind_cpu_input(name, value)  # type: ignore[attr-defined]
        self.session.run_with_iobinding(binding)  # type: ignore[attr-defined]
        # copies: the buffer is overwritten by the next step
        return {row: logits[row, -1].copy() for row in tokens}
