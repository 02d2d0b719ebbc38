"""One generation loop over either engine: chunked prefill, sampling, stop rules, streaming."""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from fuselm.runtime_metal.constraint import TokenConstraint, constrained
from fuselm.runtime_metal.engine import Engine
from fuselm.runtime_metal.errors import RuntimeUserError
from fuselm.runtime_metal.sampling import (
    DeviceSampler,
    Sampler,
    SamplingOptions,
    check_finite,
    make_device_sampler,
    make_sampler,
)
from fuselm.runtime_metal.text_stream import TextStream


@dataclass
class GenerationResult:
    tokens: list[int]
    text: str
    prompt_tokens: int
    stop_reason: str  # eos | stop_string | length
    prefill_seconds: float
    decode_seconds: float
    engine: dict[str, object] = field(default_factory=dict)
    stop: str | None = None  # the stop string that ended the text (stop_reason stop_string)
    drafted: int = 0  # speculative decoding: drafted tokens checked
    accepted: int = 0  # and those kept

    @property
    def pp(self) -> float:
        """Prefill tokens/s."""
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def tg(self) -> float:
        """Decode tokens/s: the first new token comes from the prefill, so n - 1 steps."""
        steps = max(len(self.tokens) - 1, 0)
        return steps / self.decode_seconds if self.decode_seconds and steps else 0.0


DEFAULT_PREFILL_CHUNK = 512
# MLX on CUDA: 2,048-token chunks prefilled 2,048- and 8,192-token prompts at 2.1-2.3x the
# tokens/s of 512-token chunks on an H200, at about twice the peak memory (BENCHMARKS.md
# 'Long prompts'); mlx-lm's prefill step is 2,048 tokens too.
CUDA_PREFILL_CHUNK = 2048
# Speculative decoding: tokens drafted a step (HF's prompt lookup default is 10; a step of
# 1 + 8 tokens costs the CPU engine about what a few single-token steps do).
DEFAULT_NUM_DRAFT = 8


def prefill_chunk_for(engine: Engine, chunk: int | None) -> int:
    """Prompt tokens per prefill step: `chunk` when given, else CUDA_PREFILL_CHUNK for the MLX
    engine on MLX's CUDA backend and DEFAULT_PREFILL_CHUNK elsewhere (Metal and CPU: not
    measured larger)."""
    if chunk is None:
        from fuselm.runtime_metal.cuda_kernels.selection import cuda_device

        return CUDA_PREFILL_CHUNK if engine.name == "mlx" and cuda_device() else (
            DEFAULT_PREFILL_CHUNK)
    if chunk <= 0:
        raise RuntimeUserError(f"prefill chunk must be > 0, got {chunk}")
    return chunk


def prefill(engine: Engine, prompt: Sequence[int], chunk: int | None = None) -> np.ndarray:
    """Feed the prompt in chunks of `chunk` tokens (bounded activation memory for long
    prompts; None: prefill_chunk_for's default); return the last position's logits."""
    chunk = prefill_chunk_for(engine, chunk)
    ids = np.asarray(prompt, np.int64)
    logits = None
    for start in range(0, ids.size, chunk):
        logits = engine.forward(ids[None, start:start + chunk])
    assert logits is not None
    return logits


def generate_steps(engine: Engine, prompt: Sequence[int], *, max_new_tokens: int,
                   sampler: Sampler, prefill_chunk: int | None = None,
                   timings: dict[str, float] | None = None,
                   device_sampler: DeviceSampler | None = None,
                   cached: Sequence[int] = (), drafter: Drafter | None = None,
                   num_draft: int = DEFAULT_NUM_DRAFT) -> Iterator[int]:
    """Yield new token ids (mlx-lm's generate_step shape). The caller stops when it likes.

    An engine with a device decode step (MLX) and a `device_sampler` runs the pipelined loop:
    token i+1 is queued (`mx.async_eval`) before token i is handed to the caller, so the device
    never waits for Python. Otherwise each step returns host logits to `sampler`, whose history
    is `cached` (the tokens before `prompt` that the engine's cache holds), the prompt and the
    tokens so far. With a `drafter` (greedy `sampler` only: the caller's choice), speculative
    decoding: each step checks up to `num_draft` drafted tokens at once
    (`_speculative_steps`)."""
    if not len(prompt):
        raise RuntimeUserError("the prompt is empty; give at least one token")
    # One capacity for the whole generation: growing the cache mid-decode would copy it and
    # trace a new shape, and the next generation's prefill would meet yet another capacity.
    engine.reserve(engine.offset + len(prompt) + max_new_tokens)
    if drafter is not None:
        yield from _speculative_steps(engine, prompt, max_new_tokens, sampler, drafter,
                                      num_draft, prefill_chunk, timings)
        return
    if device_sampler is not None and engine.device_loop:
        yield from _pipelined_steps(engine, prompt, max_new_tokens, device_sampler,
                                    prefill_chunk, timings)
        return
    history = [*cached, *prompt]
    t0 = time.perf_counter()
    logits = prefill(engine, prompt, prefill_chunk)
    token = sampler(logits, history)
    t1 = time.perf_counter()
    if timings is not None:
        timings["prefill"] = t1 - t0
    for i in range(max_new_tokens):
        yield token
        history.append(token)
        if i + 1 == max_new_tokens:
            break
        logits = np.asarray(engine.decode_step(token), np.float32)
        token = sampler(logits, history)
        if timings is not None:
            timings["decode"] = time.perf_counter() - t1


def _pipelined_steps(engine: Engine, prompt: Sequence[int], max_new_tokens: int,
                     sample: DeviceSampler, chunk: int | None,
                     timings: dict[str, float] | None) -> Iterator[int]:
    import mlx.core as mx

    chunk = prefill_chunk_for(engine, chunk)
    ids = np.asarray(prompt, np.int64)
    t0 = time.perf_counter()
    last = (ids.size - 1) // chunk * chunk
    for start in range(0, last, chunk):
        engine.forward(ids[None, start:start + chunk])
    logits = engine.forward_device(ids[None, last:])
    check_finite(np.array(logits))  # once per generation: the prefill already waits for it
    y = sample(logits)
    mx.async_eval(y)
    t1 = t0
    fed_ahead = 0  # tokens fed to the cache but not yet handed to the caller
    try:
        for i in range(max_new_tokens):
            nxt = None
            if i + 1 < max_new_tokens:
                nxt = sample(engine.decode_step(y))
                mx.async_eval(nxt)
                fed_ahead = 1
            token = int(y.item())
            now = time.perf_counter()
            if timings is not None:
                if i == 0:
                    timings["prefill"] = now - t0
                    t1 = now
                else:
                    timings["decode"] = now - t1
            yield token
            fed_ahead = 0
            y = nxt
    finally:
        if fed_ahead:  # the caller stopped early: forget the token it never saw
            engine.trim(fed_ahead)


class Drafter(Protocol):
    """Speculative decoding's guesser (drafting.py has the drafters): up to k token ids
    expected after `tokens` (everything the sequence holds, the token about to be fed last),
    for the sequence named `key` (a batch slot; 0 for one generation)."""

    name: str

    def propose(self, tokens: Sequence[int], k: int, key: int = 0) -> list[int]: ...


def accept_drafts(drafts: Sequence[int], picks: Sequence[int]) -> int:
    """How many drafted tokens greedy decoding confirms: picks[j] is the model's token after
    the fed token and drafts[:j], and drafts are taken while they equal it. The step's tokens
    are then drafts[:m] + [picks[m]]: exactly greedy decoding's."""
    m = 0
    while m < len(drafts) and m < len(picks) and drafts[m] == picks[m]:
        m += 1
    return m


class DraftBudget:
    """How many tokens to draft next for one sequence: HF's assisted decoding heuristic (two
    more after a step that kept every draft, one fewer after one that refused some, between 1
    and `most`), plus a pause after a step that kept none: the next 1, 2, 4, ... 16 steps
    draft nothing. A check of s tokens costs more than one token's step on a CPU (measured on
    SmolLM2-135M with onnxruntime: 1.2x for 2, 3x for 8), so a reply that shares little with
    its input (a chat) must pay for few wrong drafts."""

    def __init__(self, most: int) -> None:
        self.most = self.k = most
        self.pause = self.misses = 0

    def next(self) -> int:
        if self.pause:
            self.pause -= 1
            return 0
        return self.k

    def record(self, drafted: int, kept: int) -> None:
        if not drafted:
            return
        self.k = min(self.k + 2, self.most) if kept == drafted else max(self.k - 1, 1)
        self.misses = 0 if kept else self.misses + 1
        self.pause = min(2 ** (self.misses - 1), 16) if self.misses else 0


def _speculative_steps(engine: Engine, prompt: Sequence[int], max_new_tokens: int,
                       sampler: Sampler, drafter: Drafter, num_draft: int, chunk: int | None,
                       timings: dict[str, float] | None) -> Iterator[int]:
    """Speculative decoding for one sequence: the token to feed and up to `num_draft` drafted
    tokens go through the model in one step (Engine.verify: the logits of every position);
    the drafts are accepted while they equal the model's greedy pick (accept_drafts), the
    rejected positions are trimmed from the cache, and the pick after the last accepted draft
    is the next token to feed. A draft never reaches past max_new_tokens, so the cache stays
    inside what generate_steps reserved. The drafts' count adapts (DraftBudget)."""
    if num_draft < 1:
        raise RuntimeUserError(f"the number of drafted tokens must be >= 1, got {num_draft}")
    history = list(prompt)
    t0 = time.perf_counter()
    token = sampler(prefill(engine, prompt, chunk), history)
    t1 = time.perf_counter()
    if timings is not None:
        timings["prefill"] = t1 - t0
    queue = [token]  # tokens chosen, not yet handed to the caller; all but the last are fed
    produced = 0
    budget = DraftBudget(num_draft)
    try:
        while True:
            while queue:
                token = queue.pop(0)
                if timings is not None and produced:
                    timings["decode"] = time.perf_counter() - t1
                yield token
                history.append(token)
                produced += 1
                if produced == max_new_tokens:
                    return
            room = max_new_tokens - produced - 1  # tokens wanted after the one fed now
            k = min(budget.next(), room)
            drafts = drafter.propose(history, k) if k else []
            rows = engine.verify(np.array([[token, *drafts]], np.int64))
            picks: list[int] = []
            for row in rows:  # greedy: a pick past the first refusal is never used
                picks.append(sampler(row, history + picks))
                if len(picks) > len(drafts) or picks[-1] != drafts[len(picks) - 1]:
                    break
            m = accept_drafts(drafts, picks)
            engine.trim(len(drafts) - m)
            budget.record(len(drafts), m)
            if timings is not None:
                timings["drafted"] = timings.get("drafted", 0) + len(drafts)
                timings["accepted"] = timings.get("accepted", 0) + m
            queue = picks[:m + 1]
    finally:
        # the caller stopped early: forget the accepted drafts it never saw (they are fed)
        if queue:
            engine.trim(len(queue) - 1)


def check_token_ids(prompt: Sequence[int], vocab_size: int) -> None:
    """Every prompt id must index the model's vocabulary (a tokenizer from another model does
    not; MLX's gather would read row 0 and onnxruntime would fail deep inside)."""
    bad = next((int(t) for t in prompt if not 0 <= int(t) < vocab_size), None)
    if bad is not None:
        raise RuntimeUserError(
            f"token id {bad} is outside the model's vocabulary [0, {vocab_size}); the tokenizer "
            "does not belong to this model (copy the checkpoint's tokenizer files into the "
            "artifact, or re-convert)")


def check_context(prompt_len: int, max_new_tokens: int, context_length: int) -> int:
    """Refuse prompts that do not fit; cap new tokens at what the context leaves."""
    if prompt_len >= context_length:
        raise RuntimeUserError(
            f"the prompt has {prompt_len} tokens but the model's context is {context_length}; "
            "shorten the prompt")
    return min(max_new_tokens, context_length - prompt_len)


def generate(
    engine: Engine,
    prompt: Sequence[int],
    *,
    on_text: Callable[[str], None] | None = None,
    **options: Any,
) -> GenerationResult:
    """Generate after `prompt` (ids); text pieces go to `on_text`. Options: `iter_generate`'s."""
    pieces = iter_generate(engine, prompt, **options)
    while True:
        try:
            piece = next(pieces)
        except StopIteration as done:
            return done.value
        if on_text is not None:
            on_text(piece)


def iter_generate(
    engine: Engine,
    prompt: Sequence[int],
    *,
    max_new_tokens: int = 64,
    sampling: SamplingOptions | None = None,
    eos_ids: Sequence[int] = (),
    stop_strings: Sequence[str] = (),
    decode: Callable[[list[int]], str] | None = None,
    prefill_chunk: int | None = None,
    context_length: int | None = None,
    reset: bool = True,
    cached: Sequence[int] = (),
    device_sampling: bool | None = None,
    on_logits: Callable[[np.ndarray, int], None] | None = None,
    on_token: Callable[[int], None] | None = None,
    constraint: TokenConstraint | None = None,
    drafter: Drafter | None = None,
    num_draft: int = DEFAULT_NUM_DRAFT,
) -> Generator[str, None, GenerationResult]:
    """Generate after `prompt` (ids), yielding text pieces as they become final (with `decode`,
    through the one text stream: runtime_metal/text_stream.py) and returning the
    GenerationResult. The text ends before the first of `stop_strings` it contains.

    reset=False continues after the engine's cached positions (the caller's prompt is only
    what follows them; `cached`: their tokens, which the repetition penalty counts).
    device_sampling (engines with a device decode step, i.e. MLX): None =
    on device when greedy (the same tokens as the host, pipelined); True = also random sampling
    on device (MLX's generator: draws differ from the host's); False = always on the host.
    on_logits(logits, token): each step's processed host logits (sampling.process_logits:
    after the penalties and logit_bias, before temperature; with a constraint, masked) and the
    token chosen from them, in order (sampling then runs on the host; the logprobs of the
    Python API and `fuselm run`).
    on_token(token): each token as the loop receives it (an EOS included), before its text;
    sampling stays where it was. constraint: a grammar the tokens follow
    (runtime_metal/constraint.py; sampling then runs on the host, on masked logits).
    drafter: speculative decoding (drafting.py) with up to `num_draft` tokens a step, for
    plain greedy sampling (temperature 0, no penalty, no constraint, no on_logits); any other
    generation decodes plainly."""
    check_token_ids(prompt, engine.manifest.model.vocab_size)
    if reset:
        engine.reset()
    if context_length is not None:
        max_new_tokens = check_context(engine.offset + len(prompt), max_new_tokens,
                                       context_length)
    opts = sampling or SamplingOptions()
    token_sampler = make_sampler(opts)
    sampler: Callable[[np.ndarray, Sequence[int]], int] = token_sampler
    if constraint is not None:
        sampler = constrained(token_sampler, constraint)
        device_sampling = False
    if on_logits is not None:
        choose = sampler

        def sampler(logits: np.ndarray, history: Sequence[int]) -> int:
            token = choose(logits, history)
            assert token_sampler.processed is not None
            on_logits(token_sampler.processed, token)
            return token

        device_sampling = False
    if not opts.greedy or constraint is not None or on_logits is not None:
        # speculation is plain greedy only: the tokens stay greedy decoding's, and a verify
        # step's picks past the first refused draft are never chosen tokens (no logits to
        # report for them, no grammar to advance by them)
        drafter = None
    device_sampler = None
    if drafter is None and engine.device_loop and device_sampling is not False and (
            device_sampling or opts.temperature == 0):
        device_sampler = make_device_sampler(opts)
    timings: dict[str, float] = {}
    tokens: list[int] = []
    stop_reason = "length"
    text = TextStream(decode, stop_strings) if decode is not None else None
    eos = set(int(e) for e in eos_ids)
    steps = generate_steps(engine, prompt, max_new_tokens=max_new_tokens, sampler=sampler,
                           prefill_chunk=prefill_chunk, timings=timings,
                           device_sampler=device_sampler, cached=() if reset else cached,
                           drafter=drafter, num_draft=num_draft)
    try:
        for token in steps:
            if on_token is not None:
                on_token(token)
            if token in eos:
                stop_reason = "eos"
                break
            tokens.append(token)
            if text is None:
                continue
            piece = text.push(token)
            if piece:
                yield piece
            if text.stopped:
                stop_reason = "stop_string"
                break
    finally:
        steps.close()  # the pipelined loop forgets a token fed ahead, before anyone reads offset
    if text is not None:
        rest = text.finish()
        if rest:
            yield rest
        if text.stopped:  # the held tail completed a stop string
            stop_reason = "stop_string"
    return GenerationResult(tokens, text.text if text is not None else "", len(prompt),
                            stop_reason, timings.get("prefill", 0.0), timings.get("decode", 0.0),
                            engine.describe(), text.stop if text is not None else None,
                            int(timings.get("drafted", 0)), int(timings.get("accepted", 0)))
