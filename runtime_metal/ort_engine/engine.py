"""The onnxruntime engine: the same artifact through an ORT session with past/present feeds.

The reference for the MLX engine, and the fast path on CPU-only hosts. The Q4 activation
precision is chosen here, explicitly: ORT fuses DequantizeLinear + MatMul into MatMulNBits and
`session.qdq_matmulnbits_accuracy_level` picks its compute (4 = int8 activations, fast, ~5e-3
per matmul; 0 = float, exact).

On the CPU provider with full graph optimization the engine runs ort_lowering.py's lowering of
the artifact (onnxruntime's contrib ops, float32 activations, a KV buffer shared by past and
present: ort_shared_kv.py) unless `lower=False`, or the lowering does not cover the model, in
which case it runs the plain graph and `describe()["lowering"]` says why.

`exact_rows=True` (lowered graph only) makes a step of several tokens compute each position
exactly as a one-token step does (lowering.py `_attention`: a dummy query row in every
attention), so speculative decoding's check and prefill agree bit for bit with decode steps
at any accuracy level. It costs every step (decode included) the attention of one more row:
+11% CPU time per decode step at 268 cached positions, +28% at 768 on SmolLM2-135M
(BENCHMARKS.md 'Speculative decoding'), hence off for plain decoding; speculative decoding
asks for it (drafting.py `speculative_engine_options`: its checks cost the same either way).
`exact_rows=None`: on where the lowered graph runs, off (said in `describe()`) where it does
not. Its rows are not batched (`row_batch` None): GroupQueryAttention takes several new tokens
a row only in a batch of one.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fuselm.runtime_metal.artifact import Manifest, model_path
from fuselm.runtime_metal.errors import RuntimeUserError
from fuselm.runtime_metal.graph_io import PAST, present_for
from fuselm.runtime_metal.manifest_schema import check_graph_io, ort_past_dtype
from fuselm.runtime_metal.ort_engine.lowering import Lowered, float32_plain, lower_for_cpu
from fuselm.runtime_metal.ort_engine.row_batch import RowBatch
from fuselm.runtime_metal.ort_engine.session import (
    OPTIMIZATION_LEVELS,
    make_session,
    ort_version,
)
from fuselm.runtime_metal.ort_engine.shared_kv import GROW, SharedKV


class OrtEngine:
    name = "onnxruntime"
    device_loop = False
    kv_quant = None  # its KV cache is float (make_engine refuses --kv-bits)

    def __init__(self, out_dir: str | Path, manifest: Manifest, accuracy_level: int = 4,
                 optimization: str = "all", threads: int | None = None,
                 profile_dir: str | None = None, lower: bool = True,
                 exact_rows: bool | None = False) -> None:
        if accuracy_level not in (0, 1, 2, 3, 4):
            raise RuntimeUserError(f"accuracy_level must be 0..4, got {accuracy_level}")
        if optimization not in OPTIMIZATION_LEVELS:
            raise RuntimeUserError(
                f"optimization must be one of {', '.join(OPTIMIZATION_LEVELS)}")
        self.manifest = manifest
        self.accuracy_level = accuracy_level
        self.optimization = optimization
        path = model_path(out_dir)
        lowered = lower_for_cpu(path, manifest, exact_rows is not False) if (
            lower and optimization == "all") else None
        how = {"accuracy_level": accuracy_level, "optimization": optimization,
               "threads": threads or None,
               "profile_prefix": str(Path(profile_dir) / "ort_profile") if profile_dir else None}
        lowered_session = None
        if isinstance(lowered, Lowered):
            # An onnxruntime older than the one the lowering was written against can refuse the
            # lowered graph at load (1.30's shape inference after GroupQueryAttention, on a
            # model whose whole plain graph it runs): the plain graph runs then, and
            # `lowering` says why
            try:
                lowered_session = make_session(
                    lowered.model.SerializeToString(), external_data_dir=path.parent,
                    initializers=lowered.memory_values, **how)
            except Exception as e:  # ORT raises its own exception types for unloadable models
                lowered = (f"onnxruntime {ort_version()} cannot load the lowered graph: "
                           f"{str(e).strip().splitlines()[0][:300]}")
        if exact_rows and not isinstance(lowered, Lowered):
            raise RuntimeUserError(
                "exact_rows needs the lowered graph (optimization 'all', lower=True); here: "
                + (lowered if isinstance(lowered, str) else "not lowered"))
        self.exact_rows = exact_rows is not False and isinstance(lowered, Lowered)
        self._pad = int(self.exact_rows)  # positions past a step's own its dummy row writes
        self.lowering = lowered if isinstance(lowered, str) else (
            "onnxruntime contrib ops (GroupQueryAttention, SkipSimplifiedLayerNormalization), "
            "float32 activations" + (f", {lowered.int4_count} symmetric Q4 tensors as int4"
                                     if lowered.int4_count else "") if lowered else "off")
        if exact_rows is None and not self.exact_rows:
            self.lowering += "; exact rows off (they need the lowered graph)"
        # onnxruntime's CPU provider has no bfloat16 kernels for most ops: a bfloat16 artifact
        # runs in float32, its weights upcast when the session is made (exact: every bfloat16
        # value is a float32 value), lowered or not
        plain, plain_past = None, None
        if manifest.dtype == "bfloat16":
            self.lowering += "; bfloat16 weights upcast to float32 at load"
            if not isinstance(lowered, Lowered):
                try:
                    plain, plain_past = float32_plain(path)
                except Exception as e:  # unreadable, or a 16-bit tensor attribute
                    raise RuntimeUserError(f"onnxruntime cannot load {path}: {e}") from e
        if lowered_session is not None:
            self.session, self.session_info = lowered_session
        else:
            try:
                self.session, self.session_info = make_session(
                    plain.SerializeToString() if plain is not None else path,
                    external_data_dir=path.parent if plain is not None else None, **how)
            except Exception as e:  # ORT raises its own exception types for unreadable models
                raise RuntimeUserError(f"onnxruntime cannot load {path}: {e}") from e
        self._inputs = {i.name: i for i in self.session.get_inputs()}
        outputs = {o.name: o.shape for o in self.session.get_outputs()}
        if isinstance(lowered, Lowered):
            check_graph_io(manifest, lowered.artifact_inputs, path, lowered.artifact_past_dtype,
                           outputs)
        else:
            check_graph_io(manifest, {n: i.shape for n, i in self._inputs.items()}, path,
                           plain_past if plain is not None else
                           ort_past_dtype(self.session.get_inputs()), outputs)
        self._outputs = [o.name for o in self.session.get_outputs()]
        self._past_names = sorted((n for n in self._inputs if PAST.match(n)),
                                  key=lambda n: (int(PAST.match(n).group(1)), n))
        self._float = np.float16 if manifest.dtype == "float16" else np.float32
        m = manifest.model
        self._kv = SharedKV(self._past_names, m.num_kv_heads, m.head_dim) if isinstance(
            lowered, Lowered) else None
        self._rope_positions = lowered.rope_positions if isinstance(lowered, Lowered) else 0
        self._binding = None
        self.reset()

    @property
    def offset(self) -> int:
        return self._kv.offset if self._kv else self._offset

    def reset(self) -> None:
        if self._kv:
            self._kv.reset()
            return
        m = self.manifest.model
        empty = np.zeros((1, m.num_kv_heads, 0, m.head_dim), self._float)
        self._past = {n: empty for n in self._past_names}
        self._offset = 0

    def reserve(self, n: int) -> None:
        """The lowered graph's shared buffer grows to n positions; the plain graph returns each
        call's present K/V as new tensors, so there is nothing to do."""
        if self._kv:
            self._kv.reserve(n + self._pad)

    def trim(self, n: int) -> None:
        """Forget the last n cached positions (the K/V arrays keep their first offset - n)."""
        if self._kv:
            self._kv.trim(n)
            return
        keep = max(self._offset - n, 0)
        self._past = {k: v[:, :, :keep] for k, v in self._past.items()}
        self._offset = keep

    def forward(self, ids: np.ndarray, all_logits: bool = False) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64).reshape(1, -1)
        s, start = ids.shape[1], self.offset
        feeds = {
            "input_ids": ids,
            "attention_mask": np.ones((1, start + s), np.int64),
            "position_ids": np.arange(start, start + s, dtype=np.int64)[None, :],
        }
        if self._kv:
            feeds["logits_from"] = np.array([0 if all_logits else s - 1], np.int64)
            logits = self._forward_shared(feeds, start + s)[0]
        else:
            values = dict(zip(self._outputs, self.session.run(None, {**feeds, **self._past}),
                              strict=True))
            for name in self._past_names:
                self._past[name] = values[present_for(name)]
            self._offset += s
            logits = values["logits"][0]
        # Each call's logits are a fresh array: no copy when they are float32 already.
        return (logits if all_logits else logits[-1]).astype(np.float32, copy=False)

    def _forward_shared(self, feeds: dict[str, np.ndarray], total: int) -> np.ndarray:
        """One call of the lowered graph: GroupQueryAttention writes the new K/V into the
        buffers bound as both past and present."""
        import onnxruntime as ort

        kv = self._kv
        assert kv is not None
        if self._rope_positions and total > self._rope_positions:
            raise RuntimeUserError(
                f"{total} positions exceed the model's context length {self._rope_positions}; "
                "use a shorter prompt or fewer new tokens")
        if total + self._pad > kv.capacity:
            kv.reserve(min(total + GROW, max(self._rope_positions, total)) + self._pad)
        if self._binding is None:  # one binding for the session's life: the KV stays bound
            self._binding = self.session.io_binding()
        binding = self._binding
        for name, value in feeds.items():
            if name in self._inputs:
                binding.bind_cpu_input(name, value)
        binding.bind_output("logits")
        kv.bind(binding, ort.OrtValue)
        self.session.run_with_iobinding(binding)
        kv.offset = total
        return binding.get_outputs()[0].numpy()

    def swap_cache(self, state: tuple[dict[str, np.ndarray], int] | None = None
                   ) -> tuple[dict[str, np.ndarray], int]:
        """Install (KV, offset) from an earlier swap (None: empty); return the current."""
        if self._kv:
            return self._kv.swap(state)
        old = (self._past, self._offset)
        if state is None:
            self.reset()
        else:
            self._past, self._offset = dict(state[0]), state[1]
        return old

    def batch_program(self) -> None:
        """None: MLX's compiled batched program has no onnxruntime counterpart (row_batch)."""
        return None

    def row_batch(self, max_batch: int, capacity: int) -> RowBatch | None:
        """Rows of different lengths decoded in one run (row_batch.py), on the lowered graph;
        None on the plain graph or with exact_rows (batch.py then feeds its rows one after
        another)."""
        if self._kv is None or self.exact_rows:
            return None
        m = self.manifest.model
        return RowBatch(self.session, set(self._inputs), self._past_names, m.num_kv_heads,
                        m.head_dim, m.vocab_size, max_batch, capacity, self._rope_positions)

    def forward_device(self, ids: np.ndarray, all_logits: bool = False) -> np.ndarray:
        """onnxruntime (CPU) has no device side: the host logits."""
        return self.forward(ids, all_logits)

    def verify(self, ids: np.ndarray) -> np.ndarray:
        """Feed ids [1, s] after the cached positions; the logits of every position [s, vocab]
        (speculative decoding's check of drafted tokens): one run."""
        return self.forward(ids, all_logits=True)

    def decode_step(self, token: object) -> np.ndarray:
        return self.forward(np.array([[int(token)]], np.int64))  # type: ignore[call-overload]

    def end_profiling(self) -> str | None:
        try:
            return self.session.end_profiling()
        except Exception:  # profiling was not enabled
            return None

    def describe(self) -> dict[str, object]:
        return {
            "engine": self.name,
            "providers": self.session.get_providers(),
            "accuracy_level": self.accuracy_level,
            "graph_optimization": self.optimization,
            "threads": self.session.get_session_options().intra_op_num_threads,
            "lowering": self.lowering,
            "exact_rows": self.exact_rows,
        }
