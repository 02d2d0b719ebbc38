"""The MLX engine: the planned graph run by the executor, KV cache preallocated and in place.

Two ways through the graph:
- the compiled program (decode.py): `decode_step` (one token, device in and device out) and
  `forward`/`forward_device` for a prompt chunk (last-position logits), traced once per
  (token count, cache capacity) and replayed;
- the executor, which walks the plan's steps: all-position logits, profiling, `fast=False`
  (`fast_prefill=False` for prefill alone), and graphs the program refuses. `describe()` says
  which path decode and prefill take and why.

Its settings come from a RuntimeConfig (fuselm/config.py), resolved from the environment
when the caller gives none.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

from fuselm.config import RuntimeConfig, resolve
from fuselm.runtime_metal.artifact import Manifest, model_path
from fuselm.runtime_metal.cuda_kernels import selection as kernels
from fuselm.runtime_metal.dtypes import half
from fuselm.runtime_metal.errors import RuntimeUserError
from fuselm.runtime_metal.kv_cache import KVCache, KVQuant
from fuselm.runtime_metal.loader import LoadedGraph, read_model, read_weights
from fuselm.runtime_metal.manifest_schema import (
    check_graph_io,
    onnx_inputs,
    onnx_outputs,
    onnx_past_dtype,
)
from fuselm.runtime_metal.mlx_engine.decode import DecodeProgram, DecodeUnsupported, FastDecoder
from fuselm.runtime_metal.mlx_engine.executor import Executor
from fuselm.runtime_metal.mlx_engine.plan import build_plan
from fuselm.runtime_metal.mlx_engine.profile import Profiler
from fuselm.runtime_metal.mlx_engine.qweight import (
    QWeight,
    probe_kernels,
    set_dense_rows,
    settle_affine,
    warm_dense,
)
from fuselm.runtime_metal.mlx_engine.shard import ShardError, shard_graph
from fuselm.runtime_metal.parallel import Parallel, join


class MLXEngine:
    name = "mlx"
    device_loop = True

    def __init__(self, out_dir: str | Path, manifest: Manifest,
                 profiler: Profiler | None = None, fast: bool = True,
                 compiled: bool = True, fast_prefill: bool = True,
                 config: RuntimeConfig | None = None, parallel: str | None = None,
                 kv_bits: int | None = None, kv_group_size: int | None = None) -> None:
        self.config = config if config is not None else resolve()
        self.kv_quant = kv_quant(kv_bits, kv_group_size)
        kernels.configure(self.config)  # before the first GPU evaluation of the process
        self.manifest = manifest
        # several ranks: this one's share of the graph and weights (mlx_engine/shard.py)
        self.parallel: Parallel | None = join(parallel) if parallel else None
        graph = self._load(model_path(out_dir))
        # the weight bytes this process read: its share of model.onnx.data
        self.weight_bytes = sum(w.nbytes for w in graph.weights.values())
        self.plan = build_plan(graph)
        if self.kv_quant is not None:
            check_kv_quant(self.kv_quant, self.plan.kv_layout())
        self.executor = Executor(self.plan)
        self.executor.profiler = profiler
        self.caches = [KVCache(self.kv_quant) for _ in range(self.plan.num_layers)]
        self.dense_prefill_weights = 0
        act = self._activations()
        packed = [c for c in self.plan.constants.values() if isinstance(c, QWeight)]
        settle_affine(packed, act)
        self.dense_from_rows = kernels.dense_prefill_rows(self.config.prefill_dense)
        set_dense_rows(packed, self.dense_from_rows)
        if mx.default_device() == mx.gpu:
            weights = [c for c in packed if not c.rows_only]
            self.dense_prefill_weights = probe_kernels(weights, act)
            warm_dense(weights, act)  # made once here, not inside every compiled call
        self.fast: FastDecoder | None = None
        # the batched programs' compiled functions by DecodeProgram method, made on first use
        self._compiled: dict[str, object] = {}
        self.fast_reason = "off (fast=False)" if not fast else (
            "off (profiling times the executor's nodes)" if profiler is not None else "")
        if fast and profiler is None:
            try:
                program = DecodeProgram.build(self.plan, self.config)
                self.fast = FastDecoder(program, self.caches, compiled=compiled)
                self.fast_reason = "compiled" if compiled else "program (not compiled)"
            except DecodeUnsupported as e:
                self.fast_reason = f"off ({e})"
        self.fast_prefill = self.fast is not None and fast_prefill and self.fast.can_prefill
        if self.fast_prefill:
            self.prefill_reason = self.fast_reason
        elif self.fast is None:
            self.prefill_reason = f"executor (the program is {self.fast_reason})"
        else:
            self.prefill_reason = "executor ({})".format(
                self.fast.program.prefill_refused or "fast_prefill=False")

    def _activations(self) -> mx.Dtype:
        """What the engine computes in (dtypes.half: float32 on a CPU)."""
        return {"float16": half(mx.float16), "bfloat16": half(mx.bfloat16)}.get(
            self.manifest.dtype, mx.float32)

    def _load(self, path: Path) -> LoadedGraph:
        """The graph and weights, checked against the manifest before any sharding."""
        model = read_model(path)
        check_graph_io(self.manifest, onnx_inputs(model), path, onnx_past_dtype(model),
                       onnx_outputs(model))
        cuts = None
        if self.parallel is not None:
            info = self.manifest.model
            act = {mx.float16: "float16", mx.bfloat16: "bfloat16"}.get(self._activations(),
                                                                      "float32")
            try:
                cuts = shard_graph(model, self.parallel.mode, self.parallel.rank,
                                   self.parallel.size, hidden=info.hidden_size,
                                   vocab=info.vocab_size, dtype=act)
            except ShardError as e:
                hint = ("; --parallel pipeline splits it by layers instead"
                        if self.parallel.mode == "tensor" else "")
                raise RuntimeUserError(
                    f"--parallel {self.parallel.mode} over {self.parallel.size} ranks: {e}{hint}"
                ) from None
        return LoadedGraph(model, read_weights(model, path.parent, cuts), path)

    @property
    def offset(self) -> int:
        return self.caches[0].offset if self.caches else 0

    def reset(self) -> None:
        for c in self.caches:
            c.reset()

    def reserve(self, n: int) -> None:
        """Room for n cached positions before a generation starts (the compiled program's
        buffers; the executor grows its own as it goes)."""
        if self.fast is not None:
            self.fast.reserve(n)

    def swap_cache(self, state: list[KVCache] | None = None) -> list[KVCache]:
        """Install per-layer caches (None: fresh ones); return those in use. The list object is
        kept (the compiled program's driver holds it): its entries are replaced."""
        old = list(self.caches)
        new = state if state is not None else [KVCache(self.kv_quant) for _ in old]
        if len(new) != len(old):
            raise ValueError("a cache state has one KVCache per layer")
        self.caches[:] = new
        return old

    def batch_program(self) -> tuple[object, list, int] | None:
        """The compiled program for [b, 1] tokens at [b] offsets over the block cache
        (DecodeProgram.paged; compiled once per engine, its traces shared by every decoder of
        it: a function compiled per decoder, freed and made again, measured 2x slower steps on
        MLX's CPU backend),
        with the cache layout and the span step (Engine.batch_program); None when the program
        is refused or cannot allocate its cache. With the CUDA attention kernel on every layer
        (no sliding window), attention already stops at each row's length: one span, one
        trace per row count (a float cache, or an 8-bit one with the kernel's quantized forms
        on, kernels.kv_attn; not a 4-bit one, whose sealing steps run MLX's ops)."""
        if self.fast is None or self.fast.program.kv_layout is None:
            return None
        program = self.fast.program
        fn = self._compiled_once("paged")
        whole = (program.kernels
                 and (self.kv_quant is None
                      or (kernels.kv_attn() and not self.kv_quant.keys_per_channel))
                 and not any(w is not None for w in program.windows.values()))
        return fn, program.kv_layout, 0 if whole else KVCache.step

    def batch_verify(self) -> object | None:
        """The batched program for [b, s] tokens a step over the block cache, the logits of
        every position (DecodeProgram.paged_rows: the batch decoder's speculative step);
        compiled once per engine, like batch_program's. None where that one is None."""
        if self.batch_program() is None:
            return None
        return self._compiled_once("paged_rows")

    def batch_open(self) -> object | None:
        """batch_program's step for a step in which no row writes a key group's last position
        (DecodeProgram.paged_open: a 4-bit cache then quantizes no key); compiled once per
        engine, like batch_program's. None where that one is None or the keys are not per
        channel."""
        if (self.batch_program() is None or self.kv_quant is None
                or not self.kv_quant.keys_per_channel):
            return None
        return self._compiled_once("paged_open")

    def stage_program(self) -> tuple[object, int, int] | None:
        """This rank's pipeline stage alone over the block cache (DecodeProgram.paged_stage:
        the batch decoder's micro-batches, runtime_metal/pipeline_steps.py), with the rank and
        the number of stages; None unless the engine runs a stage of a pipeline and has the
        batched program. Compiled once per engine, like batch_program's."""
        if (self.parallel is None or self.parallel.mode != "pipeline"
                or self.batch_program() is None):
            return None
        return self._compiled_once("paged_stage"), self.parallel.rank, self.parallel.size

    def _compiled_once(self, method: str) -> object:
        """DecodeProgram.`method` compiled once per engine (one function for every decoder of
        the engine; made on first use), or as it is where the program is not compiled."""
        assert self.fast is not None
        if method not in self._compiled:
            fn = getattr(self.fast.program, method)
            self._compiled[method] = mx.compile(fn) if self.fast.compiled else fn
        return self._compiled[method]

    def trim(self, n: int) -> None:
        """Forget the last n cached positions."""
        for c in self.caches:
            c.trim(n)

    def forward_device(self, ids: np.ndarray, all_logits: bool = False) -> mx.array:
        """Like `forward`, but the logits stay a lazy float32 device array."""
        ids = np.asarray(ids, dtype=np.int64).reshape(1, -1)
        if self.fast_prefill and not all_logits:
            assert self.fast is not None
            return self.fast.prefill(ids)
        s, start = ids.shape[1], self.offset
        feeds = {
            "input_ids": ids,
            "attention_mask": np.ones((1, start + s), np.int64),
            "position_ids": np.arange(start, start + s, dtype=np.int64)[None, :],
        }
        prof = self.executor.profiler
        if prof is not None:
            prof.begin_pass()
        out = self.executor.run(feeds, self.caches, last_logits_only=not all_logits)
        logits = out["logits"]
        logits = logits[0] if all_logits else logits[0, -1]  # type: ignore[index]
        return mx.array(logits).astype(mx.float32)

    def forward(self, ids: np.ndarray, all_logits: bool = False) -> np.ndarray:
        logits = self.forward_device(ids, all_logits)
        # Evaluate logits and the cache writes together (they share the graph).
        mx.eval(logits, *[a for c in self.caches if c.keys is not None for a in c.buffers()])
        return np.array(logits)

    def prefill_padded(self, ids: np.ndarray, width: int) -> np.ndarray:
        """`forward` of a prompt chunk run padded to `width` tokens where the compiled program
        prefills (FastDecoder.prefill_padded: one trace per width, so prompts of many lengths
        share a few), else as it is; the last position's logits [vocab]."""
        if not self.fast_prefill:
            return self.forward(ids)
        assert self.fast is not None
        logits = self.fast.prefill_padded(np.asarray(ids, np.int64), width)
        mx.eval(logits, *[a for c in self.caches for a in c.buffers()])
        return np.array(logits)

    def verify(self, ids: np.ndarray) -> np.ndarray:
        """Feed ids [1, s] after the cached positions; the logits of every position [s, vocab]
        (speculative decoding's check of drafted tokens): the compiled program where it
        decodes, else the executor."""
        ids = np.asarray(ids, dtype=np.int64).reshape(1, -1)
        if self.fast is None or self.offset == 0:
            return self.forward(ids, all_logits=True)
        logits = self.fast.verify(ids)
        mx.eval(logits, *[a for c in self.caches for a in c.buffers()])
        return np.array(logits)

    def decode_step(self, token: mx.array | int) -> mx.array:
        """One token (an int, or a device scalar that may be lazy) -> its logits [vocab], lazy
        float32."""
        if not isinstance(token, mx.array):
            # uint32, the argmax's dtype: host and device tokens share one compiled trace
            token = mx.array(int(token) % 2**32, mx.uint32)
        if self.fast is not None and self.offset > 0:
            return self.fast.step(token)
        return mx.array(self.forward(np.array(token, np.int64).reshape(1, 1)))

    def describe(self) -> dict[str, object]:
        return {
            "engine": self.name,
            "device": str(mx.default_device()),
            **({"parallel": self.parallel.describe()} if self.parallel else {}),
            "weight_bytes": self.weight_bytes,
            "steps": len(self.plan.steps),
            "graph_nodes": self.plan.stats.get("nodes"),
            "kv_cache": "in-place ({}){}".format(
                "bound" if self.plan.cache_bound else "fed/written",
                "" if self.kv_quant is None else
                f", {self.kv_quant.bits}-bit (group {self.kv_quant.group_size})"),
            "decode": self.fast_reason,
            "prefill": self.prefill_reason,
            "dense_prefill_weights": self.dense_prefill_weights,
            "q4_dense_from_rows": self.dense_from_rows,  # 0: MLX's quantized matmul
            "fused_kernels": (
                "cuda (add+rms_norm, rope+attention writing K/V in place, Q4 GEMV with gated "
                "epilogue{}{})".format(
                    ", add+rms_norm in the GEMV epilogue" if self.fast.program.fold_norm else "",
                    ", attention over key splits" if self.fast.program.split_attention else "")
                if self.fast is not None and self.fast.program.kernels
                else "off (MLX built-ins)"),
        }


def kv_quant(bits: int | None, group_size: int | None) -> KVQuant | None:
    """The KV cache's quantization for the engine options kv_bits / kv_group_size (None: float
    K/V); a value MLX cannot store is refused by its option's name."""
    if bits is None:
        if group_size is not None:
            raise RuntimeUserError("--kv-group-size sets the group of a quantized KV cache; "
                                   "give it with --kv-bits")
        return None
    try:
        return KVQuant(int(bits), 64 if group_size is None else int(group_size))
    except ValueError as e:
        raise RuntimeUserError(str(e).replace("kv_bits", "--kv-bits").replace(
            "kv_group_size", "--kv-group-size")) from None


def check_kv_quant(quant: KVQuant, layout: list[tuple[int, int, int, mx.Dtype]]) -> None:
    """Every layer's key and value heads split into whole groups, or a one-line refusal."""
    for _, dk, dv, _ in layout:
        for dim in (dk, dv):
            if why := quant.misfit(dim):
                raise RuntimeUserError(f"--kv-group-size {quant.group_size}: {why}; use a "
                                       "group size that divides it")
