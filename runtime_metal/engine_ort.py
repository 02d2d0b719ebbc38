"""The onnxruntime engine: the same artifact through an ORT session with past/present feeds.

The reference for the MLX engine, and the fast path on CPU-only hosts. The Q4 activation
precision is chosen here, explicitly: ORT fuses DequantizeLinear + MatMul into MatMulNBits and
`session.qdq_matmulnbits_accuracy_level` picks its compute (4 = int8 activations, fast, ~5e-3
per matmul; 0 = float, exact).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fuselm.runtime_metal.artifact import Manifest, model_path
from fuselm.runtime_metal.errors import RuntimeUserError
from fuselm.runtime_metal.graph_io import PAST, present_for
from fuselm.runtime_metal.ort_session import OPTIMIZATION_LEVELS, make_session


class OrtEngine:
    name = "onnxruntime"
    device_loop = False

    def __init__(self, out_dir: str | Path, manifest: Manifest, accuracy_level: int = 4,
                 optimization: str = "all", threads: int | None = None,
                 profile_dir: str | None = None) -> None:
        if accuracy_level not in (0, 1, 2, 3, 4):
            raise RuntimeUserError(f"accuracy_level must be 0..4, got {accuracy_level}")
        if optimization not in OPTIMIZATION_LEVELS:
            raise RuntimeUserError(
                f"optimization must be one of {', '.join(OPTIMIZATION_LEVELS)}")
        self.manifest = manifest
        self.accuracy_level = accuracy_level
        self.optimization = optimization
        path = model_path(out_dir)
        try:
            self.session, self.session_info = make_session(
                path, accuracy_level=accuracy_level, optimization=optimization,
                threads=threads or None,
                profile_prefix=str(Path(profile_dir) / "ort_profile") if profile_dir else None)
        except Exception as e:  # ORT raises its own exception types for unreadable models
            raise RuntimeUserError(f"onnxruntime cannot load {path}: {e}") from e
        self._inputs = {i.name: i for i in self.session.get_inputs()}
        self._outputs = [o.name for o in self.session.get_outputs()]
        self._past_names = sorted((n for n in self._inputs if PAST.match(n)),
                                  key=lambda n: (int(PAST.match(n).group(1)), n))
        self._float = np.float16 if manifest.dtype == "float16" else np.float32
        self.reset()

    @property
    def offset(self) -> int:
        return self._offset

    def reset(self) -> None:
        m = self.manifest.model
        empty = np.zeros((1, m.num_kv_heads, 0, m.head_dim), self._float)
        self._past = {n: empty for n in self._past_names}
        self._offset = 0

    def reserve(self, n: int) -> None:
        """Nothing to do: onnxruntime returns each call's present K/V as new tensors."""

    def forward(self, ids: np.ndarray, all_logits: bool = False) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64).reshape(1, -1)
        s, start = ids.shape[1], self._offset
        feeds = {
            "input_ids": ids,
            "attention_mask": np.ones((1, start + s), np.int64),
            "position_ids": np.arange(start, start + s, dtype=np.int64)[None, :],
            **self._past,
        }
        values = dict(zip(self._outputs, self.session.run(None, feeds), strict=True))
        for name in self._past_names:
            self._past[name] = values[present_for(name)]
        self._offset += s
        logits = values["logits"][0]
        return (logits if all_logits else logits[-1]).astype(np.float32)

    def swap_cache(self, state: tuple[dict[str, np.ndarray], int] | None = None
                   ) -> tuple[dict[str, np.ndarray], int]:
        """Install (past feeds, offset) from an earlier swap (None: empty); return the current."""
        old = (self._past, self._offset)
        if state is None:
            self.reset()
        else:
            self._past, self._offset = dict(state[0]), state[1]
        return old

    def batch_program(self) -> None:
        """None: batch.py serves onnxruntime one sequence at a time."""
        return None

    def forward_device(self, ids: np.ndarray, all_logits: bool = False) -> np.ndarray:
        """onnxruntime (CPU) has no device side: the host logits."""
        return self.forward(ids, all_logits)

    def decode_step(self, token: object) -> np.ndarray:
        return self.forward(np.array([[int(token)]], np.int64))  # type: ignore[call-overload]

    def trim(self, n: int) -> None:
        """Forget the last n cached positions."""
        n = min(n, self._offset)
        if n:
            self._past = {k: v[:, :, : v.shape[2] - n] for k, v in self._past.items()}
            self._offset -= n

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
        }
