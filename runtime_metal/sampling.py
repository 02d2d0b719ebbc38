"""Token selection on host logits (the same code for both engines, so their tokens compare)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from fuselm.runtime_metal.errors import NonFiniteLogitsError, RuntimeUserError

Sampler = Callable[[np.ndarray, Sequence[int]], int]


@dataclass(frozen=True)
class SamplingOptions:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off: tokens less likely than min_p x the likeliest are dropped
    repetition_penalty: float = 1.0  # 1 = off (HF's CTRL-style penalty)
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        """The argmax of the raw logits (temperature 0, no penalty): what the device argmax
        and speculative decoding reproduce exactly."""
        return self.temperature == 0 and self.repetition_penalty == 1.0

    def validate(self) -> None:
        # Written so that NaN fails every check (every comparison with NaN is False).
        if not (0 <= self.temperature < math.inf):
            raise RuntimeUserError(
                f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise RuntimeUserError(f"top-k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise RuntimeUserError(f"top-p must be in (0, 1] (1 = off), got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise RuntimeUserError(f"min-p must be in [0, 1] (0 = off), got {self.min_p}")
        if not (0 < self.repetition_penalty < math.inf):
            raise RuntimeUserError(
                f"repetition penalty must be a finite number > 0 (1 = off), got "
                f"{self.repetition_penalty}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise RuntimeUserError(f"seed must be in [0, 2**63), got {self.seed}")

    def overridden(self, **given: float | int | None) -> SamplingOptions:
        """These options (a model's defaults) with each value a caller gave (not None) in
        place: how run, chat, the Python API and the server resolve a request's sampling."""
        return replace(self, **{k: v for k, v in given.items() if v is not None})

    def describe(self) -> dict[str, Any]:
        """The options as plain JSON values (the seed left out: it is per request)."""
        out = asdict(self)
        out.pop("seed")
        return out


# transformers' GenerationConfig values for what generation_config.json leaves out when it sets
# do_sample true (top_k 50 included: HF samples from the 50 likeliest tokens by default).
HF_SAMPLING = {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "min_p": 0.0}


def sampling_defaults(gen_config: dict[str, Any]) -> SamplingOptions:
    """The sampling a model's generation_config.json asks for, read as transformers reads it:
    greedy unless do_sample is true; the repetition penalty applies either way. Without a
    config (or without do_sample) this is greedy, the conservative default of `fuselm run`,
    `fuselm chat` and `fuselm serve` alike."""
    def number(key: str, default: float) -> float:
        value = gen_config.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise RuntimeUserError(f"generation_config.json's {key} must be a number, got "
                                   f"{value!r}")
        return value

    penalty = number("repetition_penalty", 1.0)
    opts = SamplingOptions(repetition_penalty=penalty)
    if gen_config.get("do_sample") is True:
        top_k = number("top_k", HF_SAMPLING["top_k"])
        if top_k != int(top_k):
            raise RuntimeUserError(f"generation_config.json's top_k must be an integer, got "
                                   f"{top_k!r}")
        opts = SamplingOptions(temperature=number("temperature", HF_SAMPLING["temperature"]),
                               top_k=int(top_k), top_p=number("top_p", HF_SAMPLING["top_p"]),
                               min_p=number("min_p", HF_SAMPLING["min_p"]),
                               repetition_penalty=penalty)
    try:
        opts.validate()
    except RuntimeUserError as e:
        raise RuntimeUserError(f"generation_config.json: {e}") from None
    return opts


def check_finite(logits: np.ndarray) -> None:
    """Stop on NaN/Inf logits: the weights or the computation broke, and sampling from them
    would pick token 0 forever (argmax) or fail deep inside numpy."""
    if not np.isfinite(logits).all():
        bad = "NaN" if np.isnan(logits).any() else "infinite"
        raise NonFiniteLogitsError(
            f"the model produced {bad} logits, so no token can be chosen; the weights hold "
            "NaN/Inf or overflow this dtype (re-convert with --dtype float32, or check the "
            "checkpoint)")


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
        check_finite(logits)
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
        if opts.min_p > 0:  # relative to the likeliest token, after temperature (llama.cpp's)
            p = np.where(p >= opts.min_p * p.max(), p, 0.0)
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


DeviceSampler = Callable[[object], object]  # mx.array logits [vocab] -> mx.array token id


def make_device_sampler(opts: SamplingOptions) -> DeviceSampler | None:
    """The same selection as `make_sampler`, on device (MLX), so decode never waits on the host.

    Greedy picks the same token as the host sampler. Random draws come from MLX's generator
    (seeded by opts.seed), so sampled tokens differ from the host sampler's numpy draws. The
    repetition penalty needs the history on the host: None is returned for it."""
    import mlx.core as mx

    opts.validate()
    if opts.repetition_penalty != 1.0:
        return None
    if opts.temperature == 0:
        return lambda logits: mx.argmax(logits, axis=-1)
    state = {"key": mx.random.key(opts.seed if opts.seed is not None else
                                  int(np.random.default_rng().integers(2**31)))}
    inv_t = 1.0 / opts.temperature

    def sample(logits):  # noqa: ANN001, ANN202
        z = logits * inv_t
        if opts.top_k and opts.top_k < z.shape[-1]:
            kth = mx.topk(z, opts.top_k, axis=-1).min(axis=-1, keepdims=True)
            z = mx.where(z < kth, -mx.inf, z)
        if opts.min_p > 0:  # p >= min_p * p_max, in log space: z >= z_max + log(min_p)
            floor = z.max(axis=-1, keepdims=True) + math.log(opts.min_p)
            z = mx.where(z < floor, -mx.inf, z)
        if opts.top_p < 1.0:
            order = mx.argsort(-z, axis=-1)
            p = mx.softmax(mx.take_along_axis(z, order, axis=-1), axis=-1)
            cum = mx.cumsum(p, axis=-1)
            # keep the smallest prefix whose mass reaches top_p (the host rule: searchsorted)
            keep_sorted = (cum - p) < opts.top_p
            keep = mx.zeros_like(keep_sorted)
            keep = mx.put_along_axis(keep, order, keep_sorted, axis=-1)
            z = mx.where(keep, z, -mx.inf)
        state["key"], sub = mx.random.split(state["key"])
        return mx.random.categorical(z, axis=-1, key=sub)

    return sample
