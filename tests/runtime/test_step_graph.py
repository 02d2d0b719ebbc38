"""The size of the MLX graph a decode step hands to evaluation (profile.graph_nodes: counted, not
timed): the batched program at one row (DecodeProgram.paged over the block cache) stays within a
few nodes a layer of the single sequence's step. What it may add: per layer its K and V gathers
through the block table (a Gather and a Squeeze each), and once a step the table's index math
(kv_cache.BlockIndex, shared by every layer). Index math rebuilt in every layer, or the new rows
transposed and reshaped per layer again, grows the graph by more than that and fails here."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

from fuselm.runtime_metal.engine import make_engine
from fuselm.runtime_metal.kv_cache import BlockCache
from fuselm.runtime_metal.mlx_engine.profile import graph_nodes

PER_LAYER = 5  # the K and V gathers (Gather + Squeeze each), one spare
PER_STEP = 28  # the block table's write and read indices, made once a step


def _single_step_nodes(engine, prompt: list[int]) -> int:  # noqa: ANN001
    engine.reset()
    engine.reserve(len(prompt) + 4)
    y = mx.argmax(engine.forward_device(np.array([prompt])), axis=-1).astype(mx.uint32)
    mx.eval(y)
    logits = engine.decode_step(y)
    written = [a for c in engine.fast.caches for a in c.buffers()]  # its cache writes, lazy
    return sum(graph_nodes(logits, mx.argmax(logits, axis=-1), *written).values())


def _batched_step_nodes(engine, rows: int, at: int) -> int:  # noqa: ANN001
    fn, layout, _ = engine.batch_program()
    width = 4
    cache = BlockCache(layout, rows * width, engine.kv_quant)
    table = mx.arange(rows * width, dtype=mx.int32).reshape(rows, width)
    offsets = mx.array(at + np.arange(rows), mx.int32)
    tokens = mx.zeros((rows, 1), mx.uint32)
    mx.eval(table, offsets, *cache.buffers())
    logits, _, *kv = fn(tokens, offsets, table, *cache.buffers())
    return sum(graph_nodes(logits, mx.argmax(logits, axis=-1), *kv).values())


def test_batched_step_graph_stays_near_the_single_sequence_step(qwen3_artifact: Path) -> None:
    engine = make_engine(qwen3_artifact, "mlx")
    assert engine.batch_program() is not None
    layers = engine.fast.program.num_layers
    single = _single_step_nodes(engine, [int(t) for t in range(5, 25)])
    one_row = _batched_step_nodes(engine, 1, 20)
    assert single < one_row <= single + PER_LAYER * layers + PER_STEP, (single, one_row)
    # more rows: the same graph (the rows are an axis of each node, not nodes)
    assert _batched_step_nodes(engine, 4, 20) <= one_row + 2
