"""Token selection on host logits (the same code for both engines, so their tokens compare).

A row's step on the host is two parts: `process_logits` (the logits processors: repetition
penalty, OpenAI's presence and frequency penalties, logit_bias: they change what the model's
distribution is taken to be) and the choice from the processed logits (greedy, or temperature,
top-k, min-p and top-p, then a draw). Logprobs (`token_logprobs`) are the log-softmax of the
processed logits: after the penalties and the bias, before temperature and truncation. That is
the distribution OpenAI's logit_bias and penalties are defined on (its reported logprobs move
with logit_bias, not with temperature), vLLM's "processed" choice and mlx-lm's (its logprobs
come after its logits processors, before its sampler); every alternative stays finite (top-k
or top-p would set them to -inf, which JSON cannot carry)."""

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
    # OpenAI's: minus presence_penalty for a token generated before, minus frequency_penalty
    # times how often it was generated (the reply's tokens only, not the prompt's)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
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
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise RuntimeUserError(f"{name.replace('_', ' ')} must be in [-2, 2] (0 = off), "
                                       f"got {getattr(self, name)}")
        for token, bias in self.logit_bias:
            if token < 0:
                raise RuntimeUserError(f"logit bias: token id {token} is negative")
            if not -100 <= bias <= 100:
                raise RuntimeUserError(f"logit bias of token {token} must be in [-100, 100], "
                                       f"got {bias}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise RuntimeUserError(f"seed must be in [0, 2**63), got {self.seed}")

    def check_vocab(self, vocab_size: int) -> None:
        """Every logit_bias id must index the model's vocabulary."""
        bad = next((t for t, _ in self.logit_bias if t >= vocab_size), None)
        if bad is not None:
            raise RuntimeUserError(f"logit bias: token id {bad} is outside the model's "
                                   f"vocabulary [0, {vocab_size})")

    @property
    def processed(self) -> bool:
        """Whether a logits processor is on (it needs the history on the host)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0
                or self.frequency_penalty != 0 or bool(self.logit_bias))

    def overridden(self, **given: float | int | None) -> SamplingOptions:
        """These options (a model's defaults) with each value a caller gave (not None) in
        place: how run, chat, the Python API and the server resolve a request's sampling."""
        return replace(self, **{k: v for k, v in given.items() if v is not None})

    def describe(self) -> dict[str, Any]:
        """The options as plain JSON values (what only a request sets left out: the seed,
        the OpenAI penalties and logit_bias, which no generation_config.json holds)."""
        out = asdict(self)
        for key in ("seed", "presence_penalty", "frequency_penalty", "logit_bias"):
            out.pop(key)
        return out


def parse_logit_bias(given: dict[str, float] | dict[int, float] | None
                     ) -> tuple[tuple[int, float], ...] | None:
    """OpenAI's logit_bias ({"token id": bias}, ids as JSON strings) as SamplingOptions holds
    it (None stays None: the default); an id that is not an integer is refused."""
    if given is None:
        return None
    out = []
    for key, bias in given.items():
        text = str(key).strip()
        if isinstance(key, bool) or not text.lstrip("-").isdigit():
            raise RuntimeUserError(f"logit bias: {key!r} is not a token id (an integer)")
        if isinstance(bias, bool) or not isinstance(bias, int | float):
            raise RuntimeUserError(f"logit bias of token {text} must be a number, got {bias!r}")
        out.append((int(text), float(bias)))
    return tuple(sorted(out))


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


def process_logits(logits: np.ndarray, history: Sequence[int], generated: Sequence[int],
                   opts: SamplingOptions) -> np.ndarray:
    """The logits processors, in order: HF's repetition penalty over `history` (prompt and
    reply), OpenAI's presence and frequency penalties over `generated` (the reply's tokens:
    logit[j] -= presence * (count[j] > 0) + frequency * count[j]), then logit_bias added.
    float32 in, float32 out (a new array when anything changed)."""
    out = apply_repetition_penalty(logits, history, opts.repetition_penalty)
    if (opts.presence_penalty or opts.frequency_penalty) and len(generated):
        ids, counts = np.unique(np.asarray(generated, np.int64), return_counts=True)
        out = out.copy() if out is logits else out
        out[ids] -= np.float32(opts.presence_penalty) + np.float32(
            opts.frequency_penalty) * counts.astype(np.float32)
    if opts.logit_bias:
        ids = np.array([t for t, _ in opts.logit_bias], np.int64)
        if ids.max() >= out.size:
            SamplingOptions(logit_bias=opts.logit_bias).check_vocab(out.size)
        out = out.copy() if out is logits else out
        out[ids] += np.array([b for _, b in opts.logit_bias], np.float32)
    return out


def log_softmax(z: np.ndarray) -> np.ndarray:
    top = z.max()
    return (z - (top + np.log(np.exp(z - top).sum()))).astype(np.float32)


MAX_TOP_LOGPROBS = 20  # OpenAI's limit on alternatives per token


@dataclass(frozen=True)
class TokenLogprobs:
    """One chosen token's logprob and the `top` likeliest alternatives (id, logprob), likeliest
    first: of the processed logits (see the module's docstring)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


_TOP_BLOCK = 256  # token_logprobs' block of the vocabulary


def token_logprobs(processed: np.ndarray, token: int, top: int) -> TokenLogprobs:
    """`token`'s logprob and the `top` likeliest, from the processed logits. The alternatives
    come from blocks of 256 logits: each pick is the argmax of the blocks' maxima, then of its
    block, whose maximum is then taken again without it. No partition or sort of the whole
    vocabulary (a millisecond and more at 150k tokens on a CPU), no pass over it per pick; ties
    go to the lower id."""
    z = np.asarray(processed, np.float32)
    peak = z.max()
    work = np.subtract(z, peak)
    lse = float(peak) + float(np.log(np.exp(work, out=work).sum(dtype=np.float64)))
    alts = []
    top = min(top, z.size)
    if top > 0:
        blocks = np.full(-(-z.size // _TOP_BLOCK) * _TOP_BLOCK, -np.inf, np.float32)
        blocks[:z.size] = z
        blocks = blocks.reshape(-1, _TOP_BLOCK)
        maxima = blocks.max(axis=1)
        for _ in range(top):
            b = int(np.argmax(maxima))
            j = int(np.argmax(blocks[b]))
            alts.append((b * _TOP_BLOCK + j, float(blocks[b, j]) - lse))
            blocks[b, j] = -np.inf
            maxima[b] = blocks[b].max()
    return TokenLogprobs(int(token), float(z[token]) - lse, tuple(alts))


class TokenSampler:
    """The host sampler of one sequence: `sampler(logits, history)` -> token id. The first
    call's history is the prompt; later calls' history is the prompt and the tokens this
    sampler chose (the reply, which OpenAI's penalties count). `processed` holds the last
    call's processed logits (what logprobs are taken from)."""

    def __init__(self, opts: SamplingOptions) -> None:
        opts.validate()
        self.opts = opts
        self.rng = np.random.default_rng(opts.seed)
        self.prompt_len: int | None = None
        self.processed: np.ndarray | None = None

    def __call__(self, logits: np.ndarray, history: Sequence[int]) -> int:
        opts = self.opts
        check_finite(logits)
        if self.prompt_len is None:
            self.prompt_len = len(history)
        z = process_logits(logits.astype(np.float32), history, history[self.prompt_len:], opts)
        self.processed = z
        if opts.temperature == 0:
            return int(np.argmax(z))
        z = z / np.float32(opts.temperature)
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
        return int(self.rng.choice(p.size, p=p))


def make_sampler(opts: SamplingOptions) -> TokenSampler:
    return TokenSampler(opts)


DeviceSampler = Callable[[object], object]  # mx.array logits [vocab] -> mx.array token id


def make_device_sampler(opts: SamplingOptions) -> DeviceSampler | None:
    """The same selection as `make_sampler`, on device (MLX), so decode never waits on the host.

    Greedy picks the same token as the host sampler. Random draws come from MLX's generator
    (seeded by opts.seed), so sampled tokens differ from the host sampler's numpy draws. The
    logits processors (penalties, logit_bias) need the history on the host: None is returned
    for them."""
    import mlx.core as mx

    opts.validate()
    if opts.processed:
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
