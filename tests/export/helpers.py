"""Shared by the exporter tests: HF ground truth and a plain onnxruntime past/present loop."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from fuselm.runtime_metal import validate
from fuselm.runtime_metal.validate import hf_model  # noqa: F401 - the suite's ground truth, re-exported


def session(path: Path) -> ort.InferenceSession:
    so = ort.SessionOptions()
    # ORT's own fusions off: the graph as written is what gets checked.
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


class OrtLoop:
    """Feeds `present` back as `past`, one sequence, like a generation loop would."""

    def __init__(self, path: Path) -> None:
        self.sess = session(path)
        inputs = {i.name: i for i in self.sess.get_inputs()}
        key = inputs["past_key_values.0.key"]
        self.layers = sum(1 for n in inputs if n.endswith(".key"))
        self.kv_heads, self.head_dim = key.shape[1], key.shape[3]
        self.dtype = np.float16 if "float16" in key.type else np.float32

    def empty_past(self, batch: int = 1) -> list[np.ndarray]:
        shape = (batch, self.kv_heads, 0, self.head_dim)
        return [np.zeros(shape, self.dtype) for _ in range(2 * self.layers)]

    def step(
        self,
        ids: np.ndarray,
        past: list[np.ndarray],
        mask: np.ndarray | None = None,
        positions: np.ndarray | None = None,
    ) -> tuple[np.ndarray, list[np.ndarray]]:
        b, s = ids.shape
        start = past[0].shape[2]
        if mask is None:
            mask = np.ones((b, start + s), np.int64)
        if positions is None:
            positions = np.broadcast_to(np.arange(start, start + s), (b, s))
        feeds = {
            "input_ids": ids.astype(np.int64),
            "attention_mask": mask.astype(np.int64),
            "position_ids": np.ascontiguousarray(positions, dtype=np.int64),
        }
        for i in range(self.layers):
            feeds[f"past_key_values.{i}.key"] = past[2 * i]
            feeds[f"past_key_values.{i}.value"] = past[2 * i + 1]
        out = self.sess.run(None, feeds)
        return out[0], out[1:]

    def prefill_then_decode(self, ids: np.ndarray, prefill: int) -> np.ndarray:
        """Logits for every position: one prefill of `prefill` tokens, then single steps."""
        logits, past = self.step(ids[:, :prefill], self.empty_past(ids.shape[0]))
        chunks = [logits]
        for t in range(prefill, ids.shape[1]):
            logits, past = self.step(ids[:, t : t + 1], past)
            chunks.append(logits)
        return np.concatenate(chunks, axis=1).astype(np.float32)

    def greedy(self, prompt: np.ndarray, n: int) -> list[int]:
        logits, past = self.step(prompt, self.empty_past())
        tokens = []
        for _ in range(n):
            tok = int(np.argmax(logits[0, -1]))
            tokens.append(tok)
            logits, past = self.step(np.array([[tok]]), past)
        return tokens


def hf_logits(model, ids: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:  # noqa: ANN001
    with torch.no_grad():
        kwargs = {} if mask is None else {"attention_mask": torch.tensor(mask)}
        return model(torch.tensor(ids), **kwargs).logits.float().numpy()


def hf_greedy(model, prompt: np.ndarray, n: int) -> list[int]:  # noqa: ANN001
    """HF's greedy tokens after a [1, s] prompt (fuselm validate's ground truth)."""
    return validate.hf_greedy(model, prompt[0].tolist(), n)


def hf_incremental_logits(model, ids: np.ndarray, prefill: int) -> np.ndarray:  # noqa: ANN001
    """HF's logits computed the way generation runs: a prefill, then one token at a time with
    its KV cache. (Dynamic NTK depends on this: HF rescales as the sequence grows.)"""
    with torch.no_grad():
        out = model(torch.tensor(ids[:, :prefill]), use_cache=True)
        chunks, cache = [out.logits], out.past_key_values
        for t in range(prefill, ids.shape[1]):
            out = model(torch.tensor(ids[:, t : t + 1]), past_key_values=cache, use_cache=True)
            chunks.append(out.logits)
            cache = out.past_key_values
    return torch.cat(chunks, dim=1).float().numpy()


def convert_with_env(name: str, value: str, src: Path, out: Path, **options: object) -> Path:
    """`convert` src -> out with environment variable `name` set to `value` for the call only
    (the exporter switch FUSELM_EXPORT)."""
    import os

    from fuselm.converter.pipeline import ConvertOptions, convert

    old = os.environ.get(name)
    os.environ[name] = value
    try:
        convert(src, out, ConvertOptions.from_flags(**options))
    finally:
        if old is None:
            os.environ.pop(name)
        else:
            os.environ[name] = old
    return out


def exact_engines(out: Path) -> list[object]:
    """Both engines on `out` at float compute (onnxruntime's accuracy level 0), for comparisons
    against a float reference."""
    from fuselm.runtime_metal.engine import make_engine

    return [make_engine(out, "onnxruntime", accuracy_level=0), make_engine(out, "mlx")]


def assert_engines_match(out: Path, prompt: list[int], ref: np.ndarray, ref_tokens: list[int],
                         steps: int) -> None:
    """Both engines' logits on `prompt` within 1e-4 of `ref` and their greedy tokens equal to
    `ref_tokens`."""
    from fuselm.runtime_metal.generate import generate

    for engine in exact_engines(out):
        got = validate.engine_logits(engine, prompt, 8)
        assert validate.rel(got, ref) <= 1e-4, (engine.name, validate.rel(got, ref))
        assert generate(engine, prompt, max_new_tokens=steps).tokens == ref_tokens, engine.name
