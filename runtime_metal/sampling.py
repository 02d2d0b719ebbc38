"""Token selection on host logits (the same code for both engines, so their tokens compare)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from runtime_metal.errors import RuntimeUserError

Sampler = Callable[[np.ndarray, Sequence[int]], int]


@dataclass(frozen=True)
class SamplingOptions:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    repetition_penalty: float = 1.0  # 1 = off (HF's CTRL-style penalty)
    seed: int | None = None

    def validate(self) -> None:
        if self.temperature < 0:
            raise RuntimeUserError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise RuntimeUserError(f"top-k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise RuntimeUserError(f"top-p must be in (0, 1], got {self.top_p}")
        if self.repetition_penalty <= 0:
            raise RuntimeUserError("repetition penalty must be > 0")


def apply_repetition_penalty(logits: np.ndarray, history: Sequence[int], penalty: float
                             ) -> np.ndarray:
    if penalty == 1.0 or not len(history):
        return logits
    out = logits.copy()
    ids = np.unique(np.asarray(history, np.int64))
    vals = out[ids]
    out[ids] = np.where(vals > 0, vals / penalty, vals * penalty)
    return out


def make_sampler(opts: SamplingOptions) -> Sampler:
    opts.validate()
    rng = np.random.default_rng(opts.seed)

    def sample(logits: np.ndarray, history: Sequence[int]) -> int:
        logits = apply_repetition_penalty(logits.astype(np.float32), history,
                                          opts.repetition_penalty)
        if opts.temperature == 0:
            return int(np.argmax(logits))
        z = logits / np.float32(opts.temperature)
        if opts.top_k and opts.top_k < z.size:
            kth = np.partition(z, -opts.top_k)[-opts.top_k]
            z = np.where(z < kth, -np.inf, z)
        p = np.exp(z - z.max())
        p /= p.sum()
        if opts.top_p < 1.0:
            order = np.argsort(-p)
            cum = np.cumsum(p[order])
            keep = order[: int(np.searchsorted(cum, opts.top_p)) + 1]
            mask = np.zeros_like(p, bool)
            mask[keep] = True
            p = np.where(mask, p, 0.0)
            p /= p.sum()
        return int(rng.choice(p.size, p=p))

    return sample
