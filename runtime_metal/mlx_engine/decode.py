"""The compiled program: a chunk of s tokens through the planned graph as ONE compiled MLX
function, for decode (s = 1) and prefill (s = the chunk length) alike.

Everything resolvable is resolved once, at load (`DecodeProgram.build`): the plan's constants
(weights packed, host shapes folded), which nodes are the mask subgraph (dropped: the program
applies its own mask, program_masks.py checks that the graph's means the same), which FusedRoPE
reads the positions, which Attention writes which cache layer. What is left is a pure function

    run(tokens[s], offset, k_0, v_0, ..., k_L, v_L) -> (logits, offset + s, k_0', v_0', ...)

over a KV cache of fixed capacity (the preallocated buffers of kv_cache.KVCache): new K/V are
written at `offset` with `mx.slice_update` (in place: the buffers are donated), attention runs
over the whole buffer with the device-built mask `key j <= offset + i` ([s, capacity]; for one
token, every cached position; a sliding-window layer also `j > offset + i - W`, its window read
off the graph's mask at load by program_masks.check_decode), RoPE takes `offset` as a device
scalar, and the LM head runs on the last position only. Shapes therefore depend only on (s,
capacity), so `mx.compile` traces once per pair (capacity moves every `KVCache.step` positions;
prefill chunk lengths are few: the chunk size and one tail), fuses the elementwise chains, and
each later call costs one call into the compiled graph: no Python walk over the nodes, no host
mask, no host sync.

Two step pairs run as one op each (program_ops.fuse_pairs): a residual Add with the RMSNorm
that reads it, and a FusedRoPE with its Attention. On MLX-CUDA each is one fused kernel for a
decoded token (cuda_kernels/sources.py; the attention kernel reads cache rows 0..offset
and needs no mask); elsewhere, or when the shapes do not fit, the pair runs as its two steps.
With the kernels on, an add+RMSNorm whose added row comes from a Q4 MatMul (a layer's o_proj
and down projection; program_ops.fold_into_producers) is not launched at all: that GEMV adds
the residual in its epilogue and its last block normalizes the rows (FUSELM_FOLD_NORM=epilogue,
the default; `0` keeps the separate add+RMSNorm kernel).

A chunk at offset 0 (a fresh prompt) has its own variant: attention over the first s cache
rows with MLX's fused "causal" mask (bottom-right aligned: exact when nothing precedes), the
path mlx-lm's prefill takes, with no [s, capacity] mask read. A later chunk of a long prompt
attends the cached rows 0..offset+s the same way (`prefix`, FastDecoder.prefix_prefill, on by
default): no mask over the whole capacity, no work on rows not yet written. Its shapes depend
on the host offset, so each offset gets its own compiled function (a prompt's chunk starts are
few and recur: multiples of the chunk size), kept in a small table.

The program refuses (and the engine keeps the node-by-node executor) when a graph needs host
values per step that it cannot move to load time: dynamic-NTK RoPE, Attention softcap,
unbound KV, or a node other than the mask subgraph that reads attention_mask/position_ids.
Prefill alone is refused when the graph's mask is not plain causal or the K/V shapes are not
static (decode then still runs compiled).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from fuselm.config import RuntimeConfig
from fuselm.runtime_metal.cuda_kernels import selection as kernels
from fuselm.runtime_metal.dtypes import onnx_dtype, to_device
from fuselm.runtime_metal.errors import RuntimeUserError
from fuselm.runtime_metal.kv_cache import (
    BlockIndex,
    KVCache,
    completes_no_key_group,
    is_key_groups,
    join_layers,
    split_layers,
)
from fuselm.runtime_metal.mlx_engine import program_ops, qweight
from fuselm.runtime_metal.mlx_engine.attention import Mask
from fuselm.runtime_metal.mlx_engine.program_masks import (
    MaskUnsupported,
    check_decode,
    check_prefill,
    mask_subgraph,
    tainted,
)
from fuselm.runtime_metal.mlx_engine.program_ops import ProgramOp
from fuselm.runtime_metal.mlx_engine.step import KVLayout, Plan, Step, call_step, lm_head_rows


class DecodeUnsupported(Exception):
    """The graph needs per-step host work; the reason says which node and why."""


@dataclass
class DecodeProgram:
    ops: list[ProgramOp]
    logits: str
    num_layers: int
    dropped: int  # mask-subgraph steps removed
    kv_layout: KVLayout | None = None  # to allocate the cache for a fresh prompt
    prefill_refused: str = ""  # why prefill stays on the executor ("" = it may run here)
    windows: dict[str, int | None] = field(default_factory=dict)  # mask name -> sliding window
    # fuselm's fused CUDA kernels where they fit (cuda_kernels/selection.py), the Q4 GEMV
    # (cuda_kernels/q4_gemv.py) for decode steps' Q4 matmuls among them
    kernels: bool = False
    # with the kernels: decode steps' add+RMSNorm in the epilogue of the GEMV making the added
    # row (FUSELM_FOLD_NORM=epilogue), and attention over key splits (FUSELM_ATTN_SPLIT=auto)
    fold_norm: bool = False
    split_attention: bool = False

    # ---- load time -------------------------------------------------------------------------

    @classmethod
    def build(cls, plan: Plan, config: RuntimeConfig) -> DecodeProgram:
        if not plan.cache_bound:
            raise DecodeUnsupported("the KV cache is not bound to Attention nodes")
        if "logits" not in plan.outputs:
            raise DecodeUnsupported("the graph has no 'logits' output")
        if "input_ids" not in plan.inputs:
            raise DecodeUnsupported("the graph has no 'input_ids' input")
        mask_only = mask_subgraph(plan)
        dyn = tainted(plan)
        ops: list[ProgramOp] = []
        for s in plan.steps:
            if s.name in mask_only:
                continue
            kind = _kind(s, dyn)
            args: list[tuple[str, object]] = []
            for i, n in enumerate(s.inputs):
                if not n or (kind == "attention" and i >= 3) or (kind == "rope" and i == 2):
                    args.append(("none", None))
                elif n in plan.constants:
                    args.append(("const", plan.constants[n]))
                else:
                    args.append(("env", n))
            ops.append(ProgramOp(kind, s, args))
        try:
            windows = check_decode(plan)
        except MaskUnsupported as e:
            raise DecodeUnsupported(str(e)) from e
        live = _live(ops, "logits")
        on = kernels.enabled(config.kernels)
        program = cls(program_ops.fuse_pairs(live), "logits", plan.num_layers,
                      len(plan.steps) - len(live), kernels=on, windows=windows,
                      fold_norm=on and config.fold_norm == "epilogue",
                      split_attention=on and config.attn_split == "auto")
        if program.fold_norm:
            program_ops.fold_into_producers(program.ops)
        try:
            check_prefill(plan, windows)
            program.kv_layout = plan.kv_layout()
        except (MaskUnsupported, RuntimeUserError) as e:
            program.prefill_refused = str(e)
        return program

    # ---- trace time (runs once per compiled shape, or every call when not compiled) ---------

    def __call__(self, tokens: mx.array, offset: mx.array, *kv: mx.array
                 ) -> tuple[mx.array, ...]:
        """s tokens (a device array of s ids, or one scalar) after `offset` cached positions;
        or a batch: tokens [b, s] (one row per sequence, cache buffers [b, ...]) after
        `offset` [b] positions per row, logits [b, vocab]."""
        return self.run(tokens, offset, kv, fresh=False)

    def step_open(self, tokens: mx.array, offset: mx.array, *kv: mx.array
                  ) -> tuple[mx.array, ...]:
        """`__call__` for one token whose position is not a key group's last, which the
        caller knows: a 4-bit cache's write then quantizes nothing (kv_cache.write_key_groups'
        `seal`)."""
        return self.run(tokens, offset, kv, fresh=False, seal=False)

    def fresh(self, tokens: mx.array, offset: mx.array, *kv: mx.array) -> tuple[mx.array, ...]:
        """The same for a chunk at offset 0 (nothing cached): MLX's fused causal attention."""
        return self.run(tokens, offset, kv, fresh=True)

    def paged(self, tokens: mx.array, offset: mx.array, table: mx.array, *kv: mx.array
              ) -> tuple[mx.array, ...]:
        """A batch step over the block cache (kv_cache.BlockCache; batch.py): kv are the
        layers' pools [blocks, kv_heads, BLOCK, dim], tokens [n, 1] one per row, row r at
        offset[r] with its positions in the blocks table[r] ([n, W] block ids); attention
        reads W * BLOCK positions a row (the mask hides those past its offset), the new K/V
        row goes into its block in place."""
        return self.run(tokens, offset, kv, fresh=False, table=table)

    def paged_open(self, tokens: mx.array, offset: mx.array, table: mx.array, *kv: mx.array
                   ) -> tuple[mx.array, ...]:
        """`paged` for a step in which no row's position is a key group's last (the caller,
        BatchDecoder, knows every row's): a 4-bit cache's write quantizes nothing, its key
        tails alone written (kv_cache.write_key_blocks' `seal`)."""
        return self.run(tokens, offset, kv, fresh=False, table=table, seal=False)

    def verify(self, tokens: mx.array, offset: mx.array, *kv: mx.array) -> tuple[mx.array, ...]:
        """Speculative decoding's check: s tokens after `offset` cached positions (the device
        mask over the capacity: any offset, one trace per (s, capacity)), the logits of every
        position [s, vocab]."""
        return self.run(tokens, offset, kv, fresh=False, all_rows=True)

    def paged_rows(self, tokens: mx.array, offset: mx.array, table: mx.array, *kv: mx.array
                   ) -> tuple[mx.array, ...]:
        """`paged` for s tokens a row (tokens [n, s]: row r's at positions offset[r]..+s-1,
        written into its blocks), the logits of every position [n, s, vocab]: the batch
        decoder's speculative step (drafted tokens verified in one step)."""
        return self.run(tokens, offset, kv, fresh=False, table=table, all_rows=True)

    def padded(self, tokens: mx.array, offset: mx.array, last: mx.array, *kv: mx.array
               ) -> tuple[mx.array, ...]:
        """`fresh` for a prompt padded with dummy tokens after its own (one trace per padded
        width, where `fresh` traces each new length): the logits of position `last` (a
        device index, the prompt's last own token), which causal attention keeps from seeing
        the dummies. Their K/V rows land past the prompt; the caller's cache length leaves
        them out, and later writes overwrite them."""
        return self.run(tokens, offset, kv, fresh=True, last=last)

    def paged_stage(self, tokens: mx.array, offset: mx.array, table: mx.array,
                    hidden: mx.array, *kv: mx.array) -> tuple[mx.array, ...]:
        """`paged` for this rank's pipeline stage alone, with no collective in it (the batch
        decoder's micro-batches, pipeline_steps.py, move the hidden states and logits
        between the stages themselves): the previous stage's hidden state `hidden` [n, 1,
        width] stands for PipeRecv's (the first stage ignores it); the first value out is
        this stage's hidden state [n, width] float32 where PipeSend would send it, on the
        last stage the LM head's logits [n, vocab]."""
        return self.run(tokens, offset, kv, fresh=False, table=table, stage=hidden)

    def run(self, tokens: mx.array, offset: mx.array, kv: tuple[mx.array, ...], fresh: bool,
            prefix: int | None = None, table: mx.array | None = None,
            all_rows: bool = False, last: mx.array | None = None,
            stage: mx.array | None = None, seal: bool = True) -> tuple[mx.array, ...]:
        """fresh: nothing cached; prefix: the host's count of cached rows (offset's value), so
        attention takes rows 0..prefix+s with MLX's causal mask; else a device mask over the
        whole capacity, or, with a block `table`, over the positions its blocks hold.
        all_rows: the logits of every position ([b, s, vocab] or [s, vocab]), not the last;
        `last`: the logits of that position (a device index) instead of the last.
        stage: a pipeline rank's stage alone (paged_stage), this hidden state received.
        seal=False: no row's new positions complete a 4-bit cache's key group (step_open)."""
        batched = tokens.ndim == 2
        ids = tokens if batched else tokens.reshape(1, -1)
        if not (ids.dtype == mx.uint32 and self.kernels and ids.shape[1] == 1):
            # a decode step with the kernels takes the argmax's uint32 token as it is (the
            # embedding kernel reads it; a cast would be one more launch a step)
            ids = ids.astype(mx.int32)
        s = ids.shape[1]
        # each layer's (K, V) buffers: arrays, or a quantized cache's triples (kv_cache.py)
        out_kv = split_layers(kv, self.num_layers)
        tails = None
        if table is not None and is_key_groups(out_kv[0][0]):
            # keys per channel: the table's last column is each row's tail slot
            # (kv_cache.BlockCache), the columns before it its blocks
            table, tails = table[:, :-1], table[:, -1]
        # positions: axis 2 of a value array (a per-channel key buffer has them last)
        capacity = kv[-1].shape[2] * (1 if table is None else table.shape[1])
        rows = s if fresh else None if prefix is None else prefix + s
        masks: dict[int | None, Mask] = {}

        def mask_for(attn: Step) -> Mask:
            """The layer's mask: query i (position offset + i) sees key j iff j <= offset + i
            (s = 1: all cached) and, with a sliding window w, j > offset + i - w. A full layer
            whose cached row count is known (`rows`) uses MLX's fused "causal" over those rows;
            else an array mask [b or 1, 1, s, capacity], one offset per batch row or one for all.
            """
            w = _window(self.windows, attn)
            if w not in masks:
                if w is None and rows is not None:
                    masks[w] = "causal"
                else:  # the mask's width is the key span attention reads (over_cache)
                    keys = mx.arange(capacity)
                    q = offset.reshape(-1, 1, 1, 1) + mx.arange(s).reshape(s, 1)
                    seen = keys <= q
                    if w is not None:
                        seen = mx.logical_and(seen, keys > q - w)
                    masks[w] = seen
            return masks[w]

        env: dict[str, object] = {"input_ids": ids}
        # an add+RMSNorm computed by the GEMV making its row: that GEMV's id -> the pair; and
        # the pairs so computed (they launch nothing)
        producing = ({id(o.norm_producer): o for o in self.ops if o.norm_producer is not None}
                     if self.fold_norm and s == 1 else {})
        done: set[int] = set()
        # decode with the kernels: a FusedQKV's projection by its (q, k, v) output names, so the
        # attention kernel reads them out of it (no slices)
        joined: dict[tuple[object, ...], mx.array] = {}
        # the attention kernel's positions, offset as [b]: made once a step for every layer
        offset_rows = mx.broadcast_to(offset.reshape(-1), ids.shape[:1])
        # the block table's index math (where each row's positions lie in the pools), built
        # once a step on first use and read by every layer that does not take the kernel
        blocks = None if table is None else BlockIndex(table, offset_rows, s, tails)
        # decode (one token per sequence): the Q4 matmuls run fuselm's GEMV kernel where it fits
        with qweight.tracing(), qweight.gemv_kernel(self.kernels and s == 1):
            for o in self.ops:
                if id(o) in done:
                    continue
                args = _resolve(o.args, env)
                if id(o) in producing:
                    pair = producing[id(o)]
                    assert pair.partner is not None
                    residual = _resolve([pair.args[1 - pair.producer_arg]], env)[0]
                    # h and y: views of the launch's one output, which the GEMVs reading
                    # them take in their place (QWeight.matmul_add_norm): unread, no graph node
                    h_y = program_ops.matmul_add_norm(
                        o, pair, args[0], residual, _resolve(pair.partner.args[1:2], env)[0])
                    if h_y is not None:
                        _bind(env, pair.step.outputs[:1] + pair.partner.step.outputs[:1], h_y)
                        done.add(id(pair))
                        continue
                if o.kind == "add_norm":
                    assert o.partner is not None
                    values = program_ops.add_norm(o.step, o.partner.step, args[0], args[1],
                                                  _resolve(o.partner.args[1:2], env)[0],
                                                  self.kernels)
                    _bind(env, o.step.outputs[:1] + o.partner.step.outputs[:1], values)
                    continue
                if o.kind in ("attention", "rope_attention"):
                    attn = o.partner if o.partner is not None else o
                    layer = attn.step.layer
                    assert layer is not None
                    k_old, v_old = out_kv[layer]
                    mask = mask_for(attn.step)
                    # the fused kernel reads every cached row: full-attention layers only; a
                    # float or 8-bit cache, or a 4-bit one in a step that seals no key group
                    # (program_ops.rope_attention, kernels.rope_attend_fits)
                    use_kernel = self.kernels and _window(self.windows, attn.step) is None
                    if o.partner is not None:
                        v = _resolve(attn.args[2:3], env)[0]
                        parent = joined.get((o.args[0][1], o.args[1][1], attn.args[2][1]))
                        y, k_new, v_new = program_ops.rope_attention(
                            o.step, attn.step, args, v, k_old, v_old, offset, mask,  # type: ignore[arg-type]
                            use_kernel, offset_rows, rows, qkv=parent,
                            splits=None if self.split_attention else 0, blocks=blocks,
                            seal=seal)
                    else:
                        y, k_new, v_new = program_ops.attend(
                            o.step, args[0], args[1], args[2], k_old, v_old, offset, mask,  # type: ignore[arg-type]
                            rows, blocks, seal)
                    out_kv[layer] = (k_new, v_new)
                    _bind(env, attn.step.outputs[:1], (y,))
                    continue
                if stage is not None and o.step.op_type in _PIPE:
                    values = _stage_values(o.step, args, stage)
                elif o.kind == "rope":
                    values = call_step(o.step, args, {"device_offset": offset})
                elif o.step.op_type == "FusedQKV" and self.kernels and s == 1:
                    # the slices stay bound for any other reader; unread, they are no graph node
                    *parts, qkv = call_step(o.step, args, {"joined": True})
                    assert isinstance(qkv, mx.array)
                    values = tuple(parts)
                    joined[tuple(o.step.outputs[:3])] = qkv
                elif o.step.is_lm_head:
                    # the logits leave float32 (the decode GEMV writes them so: no cast launch)
                    with qweight.float32_result():
                        values = call_step(o.step, args if all_rows else
                                           lm_head_rows(o.step, args, last))
                else:
                    values = call_step(o.step, args)
                _bind(env, o.step.outputs, values)
        logits = to_device(env[self.logits])
        assert isinstance(logits, mx.array)
        # the last position's row; reshapes and a slice, not integer indexing: MLX gathers for
        # `a[0]` / `a[:, -1]`, a kernel launch (26 µs for Qwen3's vocabulary on the H200)
        vocab = logits.shape[-1]
        if all_rows:
            every = logits.reshape(ids.shape[0], s, vocab).astype(mx.float32)
            return (every if batched else every.reshape(s, vocab), offset + s,
                    *join_layers(out_kv))
        rows_ = logits.reshape(ids.shape[0], -1, vocab)
        if rows_.shape[1] > 1:
            rows_ = rows_[:, -1:] if last is None else mx.take(rows_, last.reshape(1), axis=1)
        last = rows_.reshape(ids.shape[0], vocab).astype(mx.float32)
        return (last if batched else last.reshape(vocab), offset + s, *join_layers(out_kv))


_PIPE = ("PipeRecv", "PipeSend", "PipeLogits")  # a pipeline graph's collectives (shard.py)


def _stage_values(step: Step, args: list[object], hidden: mx.array) -> tuple[mx.array]:
    """A pipeline collective's value when the stage runs alone: PipeRecv the hidden state
    given, PipeSend what it would send, PipeLogits what this rank would add to the sum (its
    sent hidden state, or the last rank's logits)."""
    if step.op_type == "PipeRecv":
        return (hidden.astype(onnx_dtype(mx, int(step.attrs["elem_type"]))),)  # type: ignore[arg-type]
    if step.op_type == "PipeSend":
        return (args[0].astype(onnx_dtype(mx, int(step.attrs["elem_type"]))),)  # type: ignore[union-attr, arg-type]
    return (args[0],)  # type: ignore[return-value]


def _window(windows: dict[str, int | None], attn: Step) -> int | None:
    return windows.get(attn.inputs[3]) if len(attn.inputs) > 3 else None


def _resolve(args: list[tuple[str, object]], env: dict[str, object]) -> list[object]:
    return [v if k == "const" else env[v] if k == "env" else None  # type: ignore[index]
            for k, v in args]


def _bind(env: dict[str, object], names: list[str], values: tuple[object, ...]) -> None:
    for name, v in zip(names, values, strict=False):
        if name:
            env[name] = v


def _kind(s: Step, tainted: set[str]) -> str:
    dyn = {i for i, n in enumerate(s.inputs) if n and n in tainted}
    if s.op_type == "Attention" and s.layer is not None:
        if int(s.attrs.get("n_outputs", 1)) > 3 or (len(s.inputs) > 6 and s.inputs[6]):
            raise DecodeUnsupported(f"{s.name}: Attention with qk output / nonpad_kv_seqlen")
        if any(i < 3 for i in dyn):
            raise DecodeUnsupported(f"{s.name}: q/k/v depend on attention_mask/position_ids")
        return "attention"
    if s.op_type == "FusedRoPE":
        if float(s.attrs.get("dynamic_factor", 0.0) or 0.0) > 0:
            raise DecodeUnsupported(f"{s.name}: dynamic-NTK RoPE needs host positions per step")
        if dyn - {2} or (2 in dyn and s.inputs[2] != "position_ids"):
            raise DecodeUnsupported(f"{s.name}: positions computed in the graph")
        return "rope"
    if dyn:
        raise DecodeUnsupported(
            f"{s.name} ({s.op_type}) reads attention_mask/position_ids outside the mask")
    return "step"


def _live(ops: list[ProgramOp], output: str) -> list[ProgramOp]:
    """Drop what only fed the dropped mask subgraph (e.g. Shape(input_ids))."""
    needed, live = {output}, []
    for o in reversed(ops):
        if any(n and n in needed for n in o.step.outputs):
            live.append(o)
            needed.update(v for k, v in o.args if k == "env")  # type: ignore[misc]
    return live[::-1]


class FastDecoder:
    """Drives a DecodeProgram over the engine's KVCache objects (the same buffers the executor
    writes when it runs instead), compiled with mx.compile unless `compiled=False`: `step` for
    one decoded token, `prefill` for a prompt chunk."""

    def __init__(self, program: DecodeProgram, caches: list[KVCache], compiled: bool = True
                 ) -> None:
        self.program = program
        self.caches = caches
        self.compiled = compiled
        # Two compiled functions (each keeps one trace per input shape): any offset, and a
        # fresh prompt's first chunk, whose attention differs in structure ("causal").
        self._fn: Callable[..., tuple[mx.array, ...]] = (
            mx.compile(program) if compiled else program)
        self._fresh: Callable[..., tuple[mx.array, ...]] = (
            mx.compile(program.fresh) if compiled else program.fresh)
        # True: a later prompt chunk attends rows 0..offset+s with MLX's causal mask, one
        # compiled function per host offset (`_prefixed`); False: the compiled call with the
        # device mask over the whole capacity (the work and the mask read grow with capacity,
        # not with what is cached: measured 2-3x slower than mlx-lm at 2,048-8,192 tokens).
        self.prefix_prefill = True
        self._prefixed: dict[tuple[int, bool], Callable[..., tuple[mx.array, ...]]] = {}
        self._verify: Callable[..., tuple[mx.array, ...]] | None = None  # made on first use
        self._padded: Callable[..., tuple[mx.array, ...]] | None = None  # made on first use
        # a 4-bit cache's decode step that completes no key group (step_open), made on first use
        self._open: Callable[..., tuple[mx.array, ...]] | None = None
        self._offset: mx.array | None = None
        self._offset_at = -1  # the host offset `_offset` holds

    @property
    def can_prefill(self) -> bool:
        return not self.program.prefill_refused and self.program.kv_layout is not None

    def step(self, token: mx.array) -> mx.array:
        """Feed one token (a device scalar, possibly still lazy); return its logits [vocab] as a
        lazy float32 array. The caches advance by one position."""
        if self.caches[0].keys is None:
            raise RuntimeUserError("decode needs a prefilled cache (feed the prompt first)")
        c0 = self.caches[0]
        if (c0.quant is not None and c0.quant.keys_per_channel
                and completes_no_key_group(c0.offset)):
            if self._open is None:
                self._open = (mx.compile(self.program.step_open) if self.compiled
                              else self.program.step_open)
            return self._call(self._open, token, 1)
        return self._call(self._fn, token, 1)

    def prefill(self, ids: np.ndarray) -> mx.array:
        """Feed a chunk of prompt ids; return the last position's logits [vocab], lazy float32
        (the cache writes are in the same graph: evaluating the logits performs them)."""
        assert self.can_prefill
        ids = np.asarray(ids).reshape(-1)
        pos = self.caches[0].offset
        fn = self._fresh if pos == 0 else self._fn
        if pos and ids.size > 1 and self.prefix_prefill:
            fn = self._prefix_fn(pos)
        return self._call(fn, mx.array(ids.astype(np.int32)), ids.size)

    def verify(self, ids: np.ndarray) -> mx.array:
        """Feed s tokens after the cache (speculative decoding's drafted tokens); return the
        logits of every position [s, vocab], lazy float32 (DecodeProgram.verify: compiled once
        per (s, capacity), at any offset)."""
        if self.caches[0].keys is None:
            raise RuntimeUserError("verify needs a prefilled cache (feed the prompt first)")
        if self._verify is None:
            self._verify = mx.compile(self.program.verify) if self.compiled else (
                self.program.verify)
        ids = np.asarray(ids).reshape(-1)
        return self._call(self._verify, mx.array(ids.astype(np.int32)), ids.size)

    def prefill_padded(self, ids: np.ndarray, width: int) -> mx.array:
        """Feed a prompt chunk padded to `width` tokens; return its last own position's logits
        [vocab], lazy float32. The caches advance by the chunk's own tokens. At offset 0
        (DecodeProgram.padded) one trace per (width, capacity); after cached positions (a
        reused prefix's rest) the prefix program of that offset (`_prefix_fn`), one trace per
        width: where each new length traced its own, a server that reuses one prefix (a system
        prompt, a chat template's header) for prompts of many lengths traces a few widths. A
        chunk whose dummies the capacity cannot hold, or after cached positions with
        `prefix_prefill` off, goes as `prefill` (its own length: the device mask that would
        take any offset is slow for s > 1 on MLX's CPU backend, ~10x the causal prefill of a
        40-token chunk)."""
        assert self.can_prefill
        ids = np.asarray(ids).reshape(-1)
        n = ids.size
        if not 0 < n <= width:
            raise ValueError(f"a chunk of {n} tokens padded to {width}")
        c0 = self.caches[0]
        # keys per channel (a 4-bit cache): dummies that complete the prompt's last group would
        # be quantized into it, and its floats may be gone from the tail when they are trimmed
        if (c0.keys is None or c0.offset + width > c0.capacity
                or (c0.offset and not self.prefix_prefill)
                or (c0.quant is not None and c0.quant.keys_per_channel)):
            return self.prefill(ids)
        if c0.offset:
            padded = self._prefix_fn(c0.offset, padded=True)
        else:
            if self._padded is None:
                self._padded = mx.compile(self.program.padded) if self.compiled else (
                    self.program.padded)
            padded = self._padded
        last = mx.array(n - 1, mx.int32)
        tokens = np.zeros(width, np.int32)
        tokens[:n] = ids

        def run(tok: mx.array, offset: mx.array, *kv: mx.array) -> tuple[mx.array, ...]:
            return padded(tok, offset, last, *kv)
        logits = self._call(run, mx.array(tokens), width)
        for c in self.caches:  # the dummies' positions are not cached
            c.trim(width - n)
        self._offset_at = -1  # the device offset is past the dummies: made again
        return logits

    @property
    def compiled_prefixes(self) -> int:
        """How many chunk starts have their own compiled prefix function now."""
        return len(self._prefixed)

    _PREFIXED_KEPT = 64  # compiled prefix functions kept (oldest dropped first)

    def _prefix_fn(self, pos: int, padded: bool = False) -> Callable[..., tuple[mx.array, ...]]:
        """The program for a chunk after `pos` cached rows, attending rows 0..pos+s; padded:
        taking the index of the chunk's last own position after the offset (its logits)."""
        fn = self._prefixed.pop((pos, padded), None)
        if fn is None:
            program = self.program
            if padded:
                def run(tokens: mx.array, offset: mx.array, last: mx.array, *kv: mx.array
                        ) -> tuple[mx.array, ...]:
                    return program.run(tokens, offset, kv, fresh=False, prefix=pos, last=last)
            else:
                def run(tokens: mx.array, offset: mx.array, *kv: mx.array  # type: ignore[misc]
                        ) -> tuple[mx.array, ...]:
                    return program.run(tokens, offset, kv, fresh=False, prefix=pos)
            fn = mx.compile(run) if self.compiled else run
            if len(self._prefixed) >= self._PREFIXED_KEPT:
                self._prefixed.pop(next(iter(self._prefixed)))
        self._prefixed[(pos, padded)] = fn  # re-inserted: most recently used last
        return fn

    def _call(self, fn: Callable[..., tuple[mx.array, ...]], tokens: mx.array, s: int
              ) -> mx.array:
        caches = self.caches
        pos = caches[0].offset
        self.reserve(pos + s)
        if self._offset is None or self._offset_at != pos:
            self._offset = mx.array(pos, mx.int32)
        kv = [a for c in caches for a in c.buffers()]
        logits, self._offset, *new_kv = fn(tokens, self._offset, *kv)
        per = len(new_kv) // len(caches)  # 2 arrays a layer, 6 quantized
        for i, c in enumerate(caches):
            c.adopt(new_kv[per * i: per * (i + 1)], pos + s)
        self._offset_at = pos + s
        return logits

    def reserve(self, n: int) -> None:
        """Capacity for n positions (KVCache.reserve: whole blocks, each capacity one compiled
        shape). A generation reserves prompt + new tokens up front, so its prefill and decode
        see one capacity and a repeated generation traces nothing."""
        layout = self.program.kv_layout
        for i, c in enumerate(self.caches):
            if c.keys is None:
                assert layout is not None
                hk, dk, dv, dtype = layout[i]
                c.allocate(1, hk, dk, dv, dtype)
            c.reserve(n)
