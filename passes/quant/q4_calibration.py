"""Activation statistics for activation-aware 4-bit quantization (`--calibration FILE`).

A short text is run through the FLOAT graph (the fused model before quantization, through
onnxruntime at float compute), and for every activation that feeds a weight to be quantized
(input 0 of its MatMul / FusedQKV / FusedGateUp) we keep, over all tokens,

- `sq`:   the mean of x_k^2 per input channel k (llama.cpp's importance matrix: how much each
          row of the weight matters to the output), and
- `gram`: the mean of x x^T ([K, K]), the second moment GPTQ-style error feedback needs
          (passes/quant/q4_gptq.py).

Tokens are cut into chunks of `context` (each from an empty cache, batch 1); a chunk shorter
than MIN_CHUNK is dropped. Sums are float64 in a fixed order: deterministic. The graph runs
in segments (passes/quant/q4_segments.py): one slice of the float weights in memory at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from fuselm.input_files import check_regular
from fuselm.passes.quant import q4_segments

MIN_CHUNK = 16
# The roles the built-in text's error feedback is for (Calibration.feedback_roles): measured on
# SmolLM2-135M with its ~1,700 tokens, error feedback on the LM head took PPL from +10.9 % to
# +10.0 % over the importance-weighted search, and on the layers' projections too it gave
# +10.5 %: too few tokens for [K, K] statistics that hold beyond the text (BENCHMARKS.md
# 'Quantization quality').
HEAD_ROLES = ("lm_head", "tied_embedding_lm_head")


@dataclass
class Moments:
    """Second moments of one activation over `count` tokens."""

    sq: np.ndarray  # float64 [K]: mean x_k^2
    gram: np.ndarray | None  # float64 [K, K]: mean x x^T
    count: int


def read_calibration(path: str | Path) -> str:
    """The calibration text (UTF-8); raises ValueError with the fix when unusable."""
    p = Path(path)
    check_regular(p)  # a FIFO or folder is named as what it is
    if not p.is_file():
        raise ValueError(f"--calibration {p} does not exist; pass a UTF-8 text file")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"--calibration {p} is not UTF-8 text ({e})") from e
    if not text.strip():
        raise ValueError(f"--calibration {p} is empty; pass a text of a few hundred words")
    return text


def _feeds(model: onnx.ModelProto, ids: np.ndarray) -> dict[str, np.ndarray]:
    """Graph inputs for one prefill of `ids` from an empty cache (docs/DESIGN.md's I/O contract)."""
    t = ids.shape[1]
    feeds: dict[str, np.ndarray] = {}
    for inp in model.graph.input:
        name = inp.name
        tt = inp.type.tensor_type
        dtype = helper.tensor_dtype_to_np_dtype(tt.elem_type)
        if name == "input_ids":
            feeds[name] = ids.astype(dtype)
        elif name == "attention_mask":
            feeds[name] = np.ones((1, t), dtype)
        elif name == "position_ids":
            feeds[name] = np.arange(t, dtype=dtype)[None]
        else:  # past key/value: [batch, kv_heads, past = 0, head_dim]
            dims = [d.dim_value if d.HasField("dim_value") else 0 for d in tt.shape.dim]
            if dims:
                dims[0] = 1
            feeds[name] = np.zeros(dims, dtype)
    return feeds


def collect(
    model: onnx.ModelProto,
    load: Callable[[TensorProto], np.ndarray],
    tokens: Sequence[int],
    activations: dict[str, int],
    context: int = 512,
    gram: bool = True,
    segment_bytes: int | None = None,
) -> dict[str, Moments]:
    """Moments of each activation in `activations` (name -> its float TensorProto type).

    `model` may hold data-less stand-ins: `load(t)` gives any initializer's values. The graph
    runs in segments of about `segment_bytes` of weights (None: passes/quant/q4_segments.py's
    default for the model's size), so the float weights are never all in memory at once.
    """
    chunks = []
    for c0 in range(0, len(tokens), context):
        ids = np.asarray(tokens[c0:c0 + context], np.int64)[None]
        if ids.shape[1] >= MIN_CHUNK:
            chunks.append(ids)
    if not chunks:
        raise ValueError(
            f"the calibration text has {len(tokens)} tokens, fewer than {MIN_CHUNK}; "
            "pass a longer text")
    model, load = q4_segments.float32_view(model, load)
    count = sum(c.shape[1] for c in chunks)
    sq: dict[str, np.ndarray] = {}
    gr: dict[str, np.ndarray] = {}

    def add(name: str, _chunk: int, x: np.ndarray) -> None:
        # called chunk by chunk, in order, for each name: a fixed summation order
        x2 = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
        sq[name] = sq.get(name, 0) + np.einsum("tk,tk->k", x2, x2)
        if gram:
            gr[name] = gr.get(name, 0) + x2.T @ x2

    q4_segments.run(model, load, [_feeds(model, c) for c in chunks], list(activations), add,
                    segment_bytes)
    return {
        n: Moments(sq[n] / count, gr[n] / count if gram else None, count) for n in activations
    }


@dataclass(frozen=True)
class Calibration:
    """What `--calibration FILE` gives the quantize pass: the text's tokens and how to use them.

    `gram=True` keeps [K, K] second moments for error feedback (quant/q4_gptq.py) on the
    weights of `feedback_roles` (None: every weight); the others, and every weight with
    `gram=False`, take the per-channel importance only (the importance-weighted search).
    """

    tokens: tuple[int, ...]
    context: int = 512
    gram: bool = True
    source: str = ""  # the file, for fuselm.json
    feedback_roles: tuple[str, ...] | None = None

    def moments(
        self,
        model: onnx.ModelProto,
        load: Callable[[TensorProto], np.ndarray],
        activations: dict[str, int],
        gram: bool | None = None,
    ) -> dict[str, Moments]:
        """The activations' moments; `gram=False` skips the [K, K] matrices this once."""
        return collect(model, load, self.tokens, activations, self.context,
                       self.gram if gram is None else gram)

    def feedback(self, role: str) -> bool:
        """Whether a weight of this role (quantize.py's: "linear", "lm_head", ...) is rounded
        with error feedback (else the importance-weighted search)."""
        return self.gram and (self.feedback_roles is None or role in self.feedback_roles)

    def record(self) -> dict[str, object]:
        return {"file": self.source, "tokens": len(self.tokens), "context": self.context,
                "method": ("importance-weighted search" if not self.gram
                           else "gptq" if self.feedback_roles is None
                           else f"gptq for {'/'.join(self.feedback_roles)}, importance-weighted "
                                "search for the others")}
