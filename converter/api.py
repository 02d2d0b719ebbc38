"""The public Python API (`import fuselm`): convert a checkpoint, load an artifact, generate.

A thin layer over converter.pipeline and the runtime's one loaded model (runtime_metal/
loaded_model.py: engine, tokenizer, generation loop, text stream);
`fuselm/__init__.py` re-exports these names lazily so `import fuselm` stays light.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fuselm.converter.errors import UserError

if TYPE_CHECKING:
    from fuselm.runtime_metal.sampling import SamplingOptions

Messages = Sequence[dict[str, str]]


def _stop_strings(stop: str | Sequence[str]) -> tuple[str, ...]:
    """`stop` as OpenAI's takes it: one string or a list of them (a bare string iterated
    would stop at each of its characters)."""
    return (stop,) if isinstance(stop, str) else tuple(stop)


def _check_max_tokens(max_tokens: int) -> None:
    """At least one token: mlx-lm reads -1 as "no limit", which fuselm does not offer; an
    empty reply would hide the mistake."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int | np.integer) \
            or max_tokens < 1:
        raise UserError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")


def convert(src: str | Path, out: str | Path, **options: Any) -> Path:
    """Convert an HF checkpoint folder (or hub id ORG/NAME) into a fused ONNX artifact at `out`.

    Options as ConvertOptions.from_flags takes them: dtype ("auto" | "float32" | "float16" |
    "bfloat16"), passes, optimize, keep_intermediate, allow_nonfinite, adapter (a PEFT LoRA
    folder merged into the weights), and quant (None | "none" | "q4" | "q6" | "q8" | "mixed", or a
    QuantOptions) with its flags beside it (q_bits=8, block_size=64, symmetric=True, ...: the
    keywords of passes/quant/options.py's `quant_options`). A quantized GGUF, AWQ or GPTQ
    checkpoint keeps its blocks unless quant="none". Returns the artifact folder."""
    from fuselm.converter.models.hub import resolve_source
    from fuselm.converter.pipeline import ConvertOptions
    from fuselm.converter.pipeline import convert as run_convert

    opts = ConvertOptions.from_flags(**options)
    return run_convert(resolve_source(src), out, opts).out_dir


@dataclass
class Generation:
    """One reply: its text and token ids, why it stopped, and speed figures."""

    text: str
    tokens: list[int]
    stop_reason: str  # eos | stop_string | length
    stats: dict[str, Any] = field(default_factory=dict)
    stop: str | None = None  # the stop string that ended the text


@dataclass
class GenerationResponse:
    """One step of `stream_generate`, with mlx-lm's GenerationResponse fields.

    text: what this token added to the reply ("" while a character cut between tokens or a
    possible stop string is held back); token: the id chosen; logprobs (when asked for: None
    otherwise, so that MLX keeps its device loop): log-softmax of that step's logits over the
    vocabulary, after the penalties and logit_bias, before temperature (mlx-lm's and the
    server's choice: runtime_metal/sampling.py); prompt_tps and
    generation_tps: tokens/s so far; peak_memory: GB (MLX's peak, else the process's max RSS);
    finish_reason: None until the last response, then "stop" (EOS or a stop string) or
    "length". As in mlx-lm, the last response repeats the last token (the EOS id when the
    model stopped) and carries the text held back until the end."""

    text: str
    token: int
    logprobs: np.ndarray | None
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float
    finish_reason: str | None = None
    from_draft: bool = False  # mlx-lm's field; fuselm does not mark a drafted token


class Model:
    """A loaded artifact. `generate`/`stream` take a prompt string (the chat template is applied
    when the tokenizer has one), a list of chat messages ({"role", "content"}) or token ids.

    Unpacks as `model, tokenizer = fuselm.load(path)`, the shape mlx-lm's `load` returns."""

    def __init__(self, out_dir: str | Path, engine: str = "auto", *,
                 draft: str | Path | None = None, draft_lookup: bool = False,
                 num_draft: int | None = None, draft_ngram: int | None = None,
                 **engine_options: Any) -> None:
        from fuselm.converter.model_path import resolve_model
        from fuselm.runtime_metal.drafting import speculative_engine_options, speculative_options
        from fuselm.runtime_metal.engine import resolve_engine
        from fuselm.runtime_metal.loaded_model import open_model

        target = speculative_engine_options(  # exact rows under drafting on onnxruntime
            resolve_engine(engine, engine_options.get("parallel")), engine_options,
            draft is not None or draft_lookup)
        self.runtime = open_model(resolve_model(out_dir), engine, **target)
        # speculative decoding's generation options (greedy generations use them)
        self._speculative = speculative_options(
            self.runtime, draft=draft, lookup=draft_lookup, num_draft=num_draft,
            max_ngram=draft_ngram, **engine_options)
        self.path = self.runtime.path
        self.manifest = self.runtime.manifest
        self.engine = self.runtime.engine
        self.tokenizer = self.runtime.tokenizer
        self.eos_ids = self.runtime.eos_ids
        # Successive calls that share a prefix (a growing conversation) reuse the KV cache.
        self._session = self.runtime.session()
        self._session.defaults.update(self._speculative)

    def __iter__(self) -> Iterator[Any]:
        """`model, tokenizer = fuselm.load(...)`: this model and its tokenizer."""
        return iter((self, self.tokenizer))

    def encode(self, prompt: str | Messages | Sequence[int], raw: bool = False) -> list[int]:
        from fuselm.runtime_metal.tokenizer import encode_prompt

        if isinstance(prompt, str):
            return encode_prompt(self.tokenizer, prompt, raw=raw)
        items = list(prompt)
        if items and all(isinstance(i, int | np.integer) for i in items):
            return [int(i) for i in items]  # token ids, as given
        if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in items):
            raise UserError("a prompt is a string, a list of token ids (ints) or a list of chat "
                            "messages ({'role': ..., 'content': ...} dicts)")
        if not items or items[-1]["role"] != "user":
            raise UserError("messages must end with a user message")
        if not isinstance(items[-1].get("content"), str):
            raise UserError("the last message of the prompt, the user's, needs its text as "
                            "'content' (a string)")
        return encode_prompt(self.tokenizer, items[-1]["content"], history=items[:-1])

    def sampling(self, temperature: float | None = None, top_p: float | None = None,
                 top_k: int | None = None, min_p: float | None = None,
                 repetition_penalty: float | None = None, seed: int | None = None,
                 presence_penalty: float | None = None, frequency_penalty: float | None = None,
                 logit_bias: dict[int, float] | None = None) -> SamplingOptions:
        """The options given over the model's generation_config.json (greedy without
        do_sample), as in `fuselm run` and `serve`. logit_bias: {token id: -100..100}."""
        from fuselm.runtime_metal.sampling import parse_logit_bias

        sampling = self.runtime.sampling_defaults.overridden(
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
            repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty, logit_bias=parse_logit_bias(logit_bias),
            seed=seed)
        sampling.validate()
        sampling.check_vocab(self.manifest.model.vocab_size)
        return sampling

    def stream(self, prompt: str | Messages | Sequence[int], *, max_tokens: int = 256,
               temperature: float | None = None, top_p: float | None = None,
               top_k: int | None = None, min_p: float | None = None,
               repetition_penalty: float | None = None, seed: int | None = None,
               presence_penalty: float | None = None, frequency_penalty: float | None = None,
               logit_bias: dict[int, float] | None = None,
               stop: str | Sequence[str] = (), raw: bool = False,
               result: list[Generation] | None = None,
               json_schema: dict[str, Any] | str | None = None) -> Iterator[str]:
        """Yield the reply's text piece by piece; the finished Generation is appended to
        `result` when given. A sampling option left None is the model's
        generation_config.json's (greedy without do_sample), as in `fuselm run` and `serve`.
        presence_penalty, frequency_penalty (-2..2) and logit_bias ({token id: -100..100})
        are OpenAI's. json_schema (a dict or its JSON text): the reply is JSON valid against it
        (constrained decoding). stop: one string or several."""
        _check_max_tokens(max_tokens)
        sampling = self.sampling(temperature, top_p, top_k, min_p, repetition_penalty, seed,
                                 presence_penalty, frequency_penalty, logit_bias)
        shape = self._shape(json_schema)
        ids = self.encode(prompt, raw=raw)
        done = yield from self._session.stream(ids, max_new_tokens=max_tokens, sampling=sampling,
                                               stop_strings=_stop_strings(stop), **shape)
        if result is not None:
            result.append(Generation(done.text, done.tokens, done.stop_reason, {
                "prompt_tokens": len(ids), "prefilled_tokens": done.prompt_tokens,
                "cached_tokens": self._session.reused, "new_tokens": len(done.tokens),
                "prefill_tokens_per_s": done.pp, "decode_tokens_per_s": done.tg,
                "engine": done.engine.get("engine")}, done.stop))

    def generate(self, prompt: str | Messages | Sequence[int], *, max_tokens: int = 256,
                 temperature: float | None = None, top_p: float | None = None,
                 top_k: int | None = None, min_p: float | None = None,
                 repetition_penalty: float | None = None, seed: int | None = None,
                 presence_penalty: float | None = None, frequency_penalty: float | None = None,
                 logit_bias: dict[int, float] | None = None,
                 stop: str | Sequence[str] = (), raw: bool = False,
                 json_schema: dict[str, Any] | str | None = None) -> Generation:
        """The whole reply at once; options as `stream`'s."""
        out: list[Generation] = []
        for _ in self.stream(prompt, max_tokens=max_tokens, temperature=temperature,
                             top_p=top_p, top_k=top_k, min_p=min_p,
                             repetition_penalty=repetition_penalty, seed=seed,
                             presence_penalty=presence_penalty,
                             frequency_penalty=frequency_penalty, logit_bias=logit_bias,
                             stop=stop, raw=raw, result=out, json_schema=json_schema):
            pass
        return out[0]

    def _shape(self, json_schema: dict[str, Any] | str | None) -> dict[str, Any]:
        """The generation option that makes the reply follow `json_schema` (none without)."""
        if json_schema is None:
            return {}
        from fuselm.runtime_metal.constraint import json_schema_grammar

        return {"constraint": self.runtime.constraint(json_schema_grammar(json_schema))}

    def responses(self, prompt: str | Messages | Sequence[int], max_tokens: int,
                  sampling: SamplingOptions, stop: str | Sequence[str],
                  logprobs: bool = False, json_schema: dict[str, Any] | str | None = None
                  ) -> Iterator[GenerationResponse]:
        """`stream_generate`'s responses: one per token, then the closing one. logprobs:
        each response carries its step's (sampling then runs on the host). A bad json_schema
        or max_tokens fails here, at the call, not at the first response."""
        _check_max_tokens(max_tokens)
        return self._responses(prompt, max_tokens, sampling, _stop_strings(stop), logprobs,
                               self._shape(json_schema))

    def _responses(self, prompt: str | Messages | Sequence[int], max_tokens: int,
                   sampling: SamplingOptions, stop: tuple[str, ...], logprobs: bool,
                   shape: dict[str, Any]) -> Iterator[GenerationResponse]:
        from fuselm.runtime_metal.bench import peak_memory
        from fuselm.runtime_metal.sampling import log_softmax

        ids = self.encode(prompt)
        steps: list[tuple[int, float]] = []  # token, when it came
        lps: list[np.ndarray] = []  # its logprobs (when asked for)

        def record(token: int) -> None:
            steps.append((token, time.perf_counter()))

        def record_logprobs(processed: np.ndarray, token: int) -> None:
            lps.append(log_softmax(processed))

        eos = set(self.eos_ids)
        t0 = time.perf_counter()
        sent = 0

        def response(k: int, text: str, finish: str | None = None) -> GenerationResponse:
            token, when = steps[k]
            first = steps[0][1]
            return GenerationResponse(
                text, token, lps[k] if logprobs else None, len(ids),
                len(ids) / max(first - t0, 1e-9), k + 1,
                k / (when - first) if k and when > first else 0.0,
                peak_memory(self.runtime.engine_name)[0] / 1e9, finish)

        pieces = self._session.stream(ids, max_new_tokens=max_tokens, sampling=sampling,
                                      stop_strings=stop, on_token=record,
                                      on_logits=record_logprobs if logprobs else None,
                                      **shape)
        held = ""
        while True:
            try:
                piece = next(pieces)
            except StopIteration as done:
                result = done.value
                break
            # Tokens chosen so far, but an EOS (it ends the reply: never part of it).
            upto = len(steps) - (1 if steps and steps[-1][0] in eos else 0)
            if upto == sent:  # text released at the end (held back until then)
                held += piece
                continue
            for k in range(sent, upto):
                yield response(k, piece if k == upto - 1 else "")
            sent = upto
        for k in range(sent, len(result.tokens)):
            yield response(k, "")
        yield response(len(steps) - 1, held,
                       "length" if result.stop_reason == "length" else "stop")


def load(path: str | Path, engine: str = "auto", **options: Any) -> Model:
    """Open a model: an artifact folder, or a .gguf file or HF checkpoint folder (converted
    once into fuselm's cache, the folder printed on stderr). engine: "auto" (MLX on a GPU,
    onnxruntime otherwise), "mlx" or "onnxruntime"; the other options go to the engine (e.g.
    accuracy_level=0 or exact_rows=True for onnxruntime; kv_bits=8 or 4, kv_group_size=64 for
    MLX's quantized KV cache), but speculative decoding's, which every greedy generation then uses:
    draft_lookup=True (prompt lookup) or draft=OUT_DIR (a smaller artifact of the same
    tokenizer), num_draft, draft_ngram (as the CLI's flags; on onnxruntime they turn exact_rows
    on unless it is given). `model, tokenizer = load(path)`
    unpacks as mlx-lm's does."""
    return Model(path, engine, **options)


def _own_tokenizer(model: Model, tokenizer: Any) -> None:
    if tokenizer is not None and tokenizer is not model.tokenizer:
        raise UserError("pass the tokenizer fuselm.load returned with this model (or None): "
                        "fuselm encodes with the model's own")


def stream_generate(model: Model, tokenizer: Any, prompt: str | Messages | Sequence[int], *,
                    max_tokens: int = 256, temperature: float | None = None,
                    top_p: float | None = None, top_k: int | None = None,
                    min_p: float | None = None, repetition_penalty: float | None = None,
                    seed: int | None = None, presence_penalty: float | None = None,
                    frequency_penalty: float | None = None,
                    logit_bias: dict[int, float] | None = None,
                    stop: str | Sequence[str] = (), logprobs: bool = False,
                    json_schema: dict[str, Any] | str | None = None
                    ) -> Iterator[GenerationResponse]:
    """mlx-lm's `stream_generate`: a GenerationResponse per token (text, token, timing; with
    logprobs=True its logprobs over the vocabulary, else None: asking for them moves sampling
    to the host), the last with finish_reason. `prompt`: a string (chat template applied when
    the tokenizer has one), chat messages, or token ids as given. A sampling option left None
    is the model's generation_config.json's (greedy without do_sample); presence_penalty,
    frequency_penalty (-2..2) and logit_bias ({token id: -100..100}) are OpenAI's. json_schema:
    the reply is JSON valid against it (constrained decoding)."""
    _own_tokenizer(model, tokenizer)
    sampling = model.sampling(temperature, top_p, top_k, min_p, repetition_penalty, seed,
                              presence_penalty, frequency_penalty, logit_bias)
    return model.responses(prompt, max_tokens, sampling, stop, logprobs, json_schema)


def generate(model: Model, tokenizer: Any, prompt: str | Messages | Sequence[int], *,
             max_tokens: int = 256, temperature: float | None = None,
             top_p: float | None = None, top_k: int | None = None, min_p: float | None = None,
             repetition_penalty: float | None = None, seed: int | None = None,
             presence_penalty: float | None = None, frequency_penalty: float | None = None,
             logit_bias: dict[int, float] | None = None, stop: str | Sequence[str] = (),
             verbose: bool = False, json_schema: dict[str, Any] | str | None = None) -> str:
    """mlx-lm's `generate`: the reply's text. verbose: the text as it comes, then the prompt
    and generation tokens/s and peak memory, on stdout (as mlx-lm prints them)."""
    _own_tokenizer(model, tokenizer)
    text = []
    last = None
    for last in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens,
                                temperature=temperature, top_p=top_p, top_k=top_k,
                                min_p=min_p, repetition_penalty=repetition_penalty, seed=seed,
                                presence_penalty=presence_penalty,
                                frequency_penalty=frequency_penalty, logit_bias=logit_bias,
                                stop=stop, json_schema=json_schema):
        text.append(last.text)
        if verbose:
            print(last.text, end="", flush=True)
    if verbose and last is not None:
        print(f"\n==========\nPrompt: {last.prompt_tokens} tokens, {last.prompt_tps:.3f} "
              f"tokens-per-sec\nGeneration: {last.generation_tokens} tokens, "
              f"{last.generation_tps:.3f} tokens-per-sec\nPeak memory: {last.peak_memory:.3f} GB")
    return "".join(text)
