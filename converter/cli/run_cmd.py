"""`fuselm run`, `fuselm chat`, `fuselm validate`: thin click layers over runtime_metal."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from fuselm.config import RuntimeConfig
from fuselm.converter.cli.options import (
    accuracy_option,
    draft_options,
    join_parallel,
    kv_cache_options,
    kv_options,
    model_argument,
    ort_options,
    parallel_option,
    refuse_parallel_draft,
    runtime_config,
    threads_option,
    verbose_option,
)
from fuselm.runtime_metal.errors import RuntimeUserError

_ENGINE = click.option("--engine", type=click.Choice(["auto", "mlx", "onnxruntime"]),
                       default="auto", show_default=True,
                       help="auto: mlx where MLX has a GPU (Metal/CUDA), onnxruntime otherwise")
_CHUNK = click.option("--prefill-chunk", type=click.IntRange(1), default=None,
                      help="prompt tokens per prefill step  [default: 2048 with MLX on CUDA, "
                      "else 512]")


def _sampling(out_dir: str, temperature: float | None, top_k: int | None, top_p: float | None,
              repetition_penalty: float | None, seed: int | None,
              min_p: float | None = None, presence_penalty: float | None = None,
              frequency_penalty: float | None = None,
              logit_bias: tuple[str, ...] = ()):  # noqa: ANN202
    """The flags given over the model's generation_config.json defaults (greedy without one),
    the defaults `fuselm serve` uses for a request that sets nothing. logit_bias: the
    --logit-bias ID=BIAS values."""
    from fuselm.runtime_metal.sampling import parse_logit_bias, sampling_defaults
    from fuselm.runtime_metal.tokenizer import generation_config

    bias: dict[str, float] = {}
    for item in logit_bias:
        key, sep, value = item.partition("=")
        try:
            bias[key.strip()] = float(value)
        except ValueError:
            sep = ""
        if not sep:
            raise RuntimeUserError(f"--logit-bias wants ID=BIAS (e.g. 42=-100), got {item!r}")
    opts = sampling_defaults(generation_config(out_dir)).overridden(
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
        repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
        logit_bias=parse_logit_bias(bias) if bias else None, seed=seed)
    opts.validate()
    return opts


def _open(out_dir: str, engine: str, accuracy_level: int | None, profile: bool = False,  # noqa: ANN202
          threads: int | None = None, config: RuntimeConfig | None = None,
          parallel: str | None = None, kv_bits: str | None = None,
          kv_group_size: str | None = None, exact_rows: bool | None = None,
          drafting: bool = False, device_sampling: bool = False):
    """The loaded model for these flags (runtime_metal/loaded_model.py), and its profiler;
    `drafting`: speculative decoding will run on it (ort_options); `device_sampling`:
    --device-sampling, the MLX engine's only."""
    from fuselm.runtime_metal.engine import resolve_engine
    from fuselm.runtime_metal.loaded_model import open_model
    from fuselm.runtime_metal.mlx_engine.profile import Profiler

    name = resolve_engine(engine, parallel)
    if device_sampling and name != "mlx":
        raise RuntimeUserError("--device-sampling samples with MLX's generator on the device; "
                               "onnxruntime samples on the host (drop it, or add --engine mlx)")
    options = {**ort_options(name, accuracy_level, threads, exact_rows, drafting),
               **kv_options(name, kv_bits, kv_group_size)}
    if name == "onnxruntime":
        if profile:
            raise RuntimeUserError("--profile times the MLX engine's nodes; add --engine mlx")
        return open_model(out_dir, name, config=config, **options), None
    profiler = Profiler() if profile else None
    model = open_model(out_dir, name, defer_engine=True, config=config,
                       profiler=profiler, **options, **join_parallel(parallel))
    warn_mlx_on_cpu(model.manifest, engine)  # before the slow part: building the engine
    model.engine  # noqa: B018
    return model, profiler


def warn_mlx_on_cpu(manifest: Any, engine: str) -> None:
    """An explicit --engine mlx without a GPU: say how slow it will be and what is faster."""
    from fuselm.runtime_metal.engine import mlx_has_gpu
    from fuselm.runtime_metal.model_size import mlx_cpu_warning

    if engine == "mlx" and not mlx_has_gpu():
        message = mlx_cpu_warning(manifest.model)
        if message:
            click.echo(message, err=True)


def _parse_ids(text: str) -> list[int]:
    """Comma-separated integers (spaces allowed around them). An empty entry ("1,,2", a
    trailing comma) is refused, not skipped: the ids would not be the ones written."""
    if not text.strip():
        raise RuntimeUserError("--prompt-ids is empty")
    pieces = [t.strip() for t in text.split(",")]
    if "" in pieces:
        raise RuntimeUserError(
            f"--prompt-ids {text!r} has an empty entry (entry {pieces.index('') + 1}); give "
            "comma-separated integers, e.g. 1,2,3")
    try:
        return [int(t) for t in pieces]
    except ValueError:
        raise RuntimeUserError(
            f"--prompt-ids wants comma-separated integers, got {text!r}") from None


_FROM_CONFIG = ("[default: the model's generation_config.json (greedy unless it sets "
                "do_sample), else greedy]")


def _sampling_options(f):  # noqa: ANN001, ANN202
    for opt in reversed([
        click.option("--temperature", "--temp", type=float, default=None,
                     help=f"0 = greedy  {_FROM_CONFIG}"),
        click.option("--top-k", type=int, default=None, help=f"0 = off  {_FROM_CONFIG}"),
        click.option("--top-p", type=float, default=None, help=f"1 = off  {_FROM_CONFIG}"),
        click.option("--min-p", type=float, default=None,
                     help="keep tokens at least this fraction as likely as the likeliest, "
                     f"0 = off  {_FROM_CONFIG}"),
        click.option("--repetition-penalty", type=float, default=None,
                     help=f"1 = off  {_FROM_CONFIG}"),
        click.option("--presence-penalty", type=float, default=None,
                     help="OpenAI's: minus this for a token already in the reply, -2..2 "
                     "[default: 0]"),
        click.option("--frequency-penalty", type=float, default=None,
                     help="OpenAI's: minus this per time a token is in the reply, -2..2 "
                     "[default: 0]"),
        click.option("--logit-bias", multiple=True, metavar="ID=BIAS",
                     help="add BIAS (-100..100) to token ID's logit (repeatable)"),
        click.option("--seed", type=int, default=None),
    ]):
        f = opt(f)
    return f


@click.command("run")
@model_argument
@click.option("-p", "--prompt", default=None,
              help="text; the chat template is applied if present; `-` reads stdin  "
              "[default: stdin when it is not a terminal]")
@click.option("--system", default=None, help="a system message before the prompt (chat "
              "template)")
@click.option("--prompt-ids", default=None, help="token ids as given, e.g. 1,2,3")
@click.option("--raw", is_flag=True, help="do not apply the chat template to --prompt")
@click.option("-n", "--max-new-tokens", "--max-tokens", type=click.IntRange(1), default=64,
              show_default=True)
@click.option("-c", "--ctx-size", "--max-kv-size", "ctx_size", type=click.IntRange(2),
              default=None, help="tokens of context (prompt + reply) at most; the reply stops "
              "where it is full  [default: the model's context length]")
@_sampling_options
@click.option("--stop", multiple=True, help="stop string (repeatable)")
@_ENGINE
@accuracy_option
@threads_option
@kv_cache_options
@_CHUNK
@click.option("--json", "as_json", is_flag=True, help="stdout: one JSON object only")
@click.option("--logprobs", "top_logprobs", type=click.IntRange(0, 20), default=None,
              metavar="N", help="each token's logprob and its N likeliest alternatives (stderr, "
              "or \"logprobs\" in --json); samples on the host")
@click.option("--json-schema", "json_schema", type=click.Path(dir_okay=False), default=None,
              help="the reply is JSON valid against the JSON schema in this file (constrained "
              "decoding)")
@click.option("--json-object", is_flag=True, help="the reply is a JSON object (any)")
@click.option("--profile", is_flag=True, help="per-node time table (MLX engine), warm-up skipped")
@click.option("--device-sampling", is_flag=True,
              help="MLX: sample on device with MLX's generator (greedy always runs on device)")
@click.option("--verify", "verify_files", is_flag=True,
              help="hash the artifact's files against fuselm.json before loading")
@parallel_option
@draft_options
@verbose_option
def run(out_dir: str, prompt: str | None, prompt_ids: str | None, raw: bool, max_new_tokens: int,
        temperature: float | None, top_k: int | None, top_p: float | None,
        repetition_penalty: float | None, seed: int | None, stop: tuple[str, ...],
        engine: str, accuracy_level: int | None, threads: int | None,
        prefill_chunk: int | None,
        as_json: bool, profile: bool, device_sampling: bool,
        verify_files: bool = False, verbose: bool = False, system: str | None = None,
        ctx_size: int | None = None, min_p: float | None = None,
        presence_penalty: float | None = None, frequency_penalty: float | None = None,
        logit_bias: tuple[str, ...] = (), top_logprobs: int | None = None,
        json_schema: str | None = None, json_object: bool = False,
        parallel: str | None = None, draft_lookup: bool = False,
        draft: str | None = None, num_draft: int | None = None,
        draft_ngram: int | None = None, kv_bits: str | None = None,
        kv_group_size: str | None = None, exact_rows: bool | None = None) -> None:
    """Generate text with MODEL (an artifact folder, a .gguf file or an HF folder)."""
    refuse_parallel_draft(parallel, draft, draft_lookup)
    from fuselm.runtime_metal.tokenizer import check_text, encode_prompt

    prompt = prompt_text(prompt, prompt_ids)
    if (prompt is None) == (prompt_ids is None):
        raise click.UsageError("give exactly one of --prompt and --prompt-ids")
    if system is not None and (prompt is None or raw):
        raise click.UsageError("--system goes into the chat template: give it with --prompt, "
                               "without --raw")
    host = ("--logprobs" if top_logprobs is not None else "--json-schema" if json_schema
            else "--json-object" if json_object else None)
    if device_sampling and host:  # generate.py samples on the host for these
        raise RuntimeUserError(f"--device-sampling and {host} do not go together: {host} "
                               "samples on the host, from its logits there")
    sampling = _sampling(out_dir, temperature, top_k, top_p, repetition_penalty, seed, min_p,
                         presence_penalty, frequency_penalty, logit_bias)
    grammar = reply_grammar(json_schema, json_object)
    config = runtime_config(verbose, engine=engine, threads=threads)
    if verify_files:
        from fuselm.converter.cli.verify_cmd import verify_artifact

        verify_artifact(out_dir)
    model, profiler = _open(out_dir, engine, accuracy_level, profile, threads, config, parallel,
                            kv_bits, kv_group_size, exact_rows,
                            drafting=draft_lookup or draft is not None,
                            device_sampling=device_sampling)
    sampling.check_vocab(model.manifest.model.vocab_size)
    from fuselm.runtime_metal.drafting import speculative_options

    speculative = speculative_options(
        model, draft=draft, lookup=draft_lookup, num_draft=num_draft, max_ngram=draft_ngram,
        **ort_options(model.engine_name, accuracy_level, threads, exact_rows), config=config)
    if prompt is not None:
        check_text(prompt)
        history = None
        if system is not None:
            if not getattr(model.tokenizer, "chat_template", None):
                raise RuntimeUserError("--system needs a chat template, and this model's "
                                       "tokenizer has none")
            check_text(system)
            history = [{"role": "system", "content": system}]
        ids = encode_prompt(model.tokenizer, prompt, raw=raw, history=history)
    else:
        ids = _parse_ids(prompt_ids or "")
        vocab = model.manifest.model.vocab_size
        if any(i < 0 or i >= vocab for i in ids):
            raise RuntimeUserError(f"--prompt-ids must be in [0, {vocab})")
    stream = sys.stderr if as_json else sys.stdout

    def on_text(piece: str) -> None:
        stream.write(piece)
        stream.flush()

    context = model.manifest.model.context_length
    if ctx_size is not None and ctx_size > context:
        raise RuntimeUserError(f"--ctx-size {ctx_size} is over the model's context ({context}); "
                               f"give at most {context}")
    if ctx_size is not None and len(ids) >= ctx_size:
        raise RuntimeUserError(f"the prompt has {len(ids)} tokens but --ctx-size is {ctx_size}; "
                               "shorten the prompt or raise -c")
    records: list[Any] = []
    on_logits = None
    if top_logprobs is not None:
        from fuselm.runtime_metal.sampling import token_logprobs

        def on_logits(processed: Any, token: int) -> None:
            records.append(token_logprobs(processed, token, top_logprobs))

    result = model.generate(ids, on_text=on_text, max_new_tokens=max_new_tokens,
                            context_length=ctx_size or context,
                            sampling=sampling, stop_strings=stop, prefill_chunk=prefill_chunk,
                            device_sampling=True if device_sampling else None,
                            on_logits=on_logits,
                            constraint=model.constraint(grammar) if grammar else None,
                            **speculative)
    stream.write("\n")
    logprobs = _logprobs_json(model, records[:len(result.tokens)]) if records else None
    if as_json:
        out = {"tokens": result.tokens, "text": result.text, "pp": result.pp, "tg": result.tg,
               "prompt_tokens": result.prompt_tokens, "stop_reason": result.stop_reason,
               "engine": result.engine,
               **({"drafted": result.drafted, "accepted": result.accepted}
                  if speculative else {})}
        if logprobs is not None:
            out["logprobs"] = logprobs
        if profiler is not None:
            out["profile"] = profiler.by_op()
        click.echo(json.dumps(out))
    else:
        click.echo(f"[{result.engine['engine']}] prompt {result.prompt_tokens} tok, "
                   f"pp {result.pp:.1f} tok/s, tg {result.tg:.1f} tok/s, "
                   f"stop: {result.stop_reason}", err=True)
        for item in logprobs or []:
            alts = ", ".join(f"{a['text']!r} {a['logprob']:.3f}" for a in item["top_logprobs"])
            click.echo(f"{item['text']!r} {item['logprob']:.3f}" + (f"  | {alts}" if alts else ""),
                       err=True)
    if profiler is not None and not as_json:
        click.echo(profiler.table(), err=True)


def _logprobs_json(model: Any, records: list[Any]) -> list[dict[str, Any]]:
    """--logprobs: per reply token its id, text (as it decodes alone), logprob and the
    alternatives (sampling.TokenLogprobs)."""
    from fuselm.runtime_metal.text_stream import token_text

    decode = model.decoder() if model.has_tokenizer else None

    def entry(token: int, logprob: float) -> dict[str, Any]:
        text = token_text(decode, token) if decode is not None else ""
        return {"token": token, "text": text, "logprob": logprob}

    return [{**entry(r.token, r.logprob), "top_logprobs": [entry(t, lp) for t, lp in r.top]}
            for r in records]


def reply_grammar(json_schema: str | None, json_object: bool) -> str | None:
    """The grammar --json-schema FILE / --json-object ask the reply to follow (checked before
    the model loads: a bad schema is one error line)."""
    from fuselm.runtime_metal.constraint import json_object_grammar, json_schema_grammar

    if json_schema is not None and json_object:
        raise click.UsageError("give --json-schema or --json-object, not both")
    if json_object:
        return json_object_grammar()
    if json_schema is None:
        return None
    try:
        text = Path(json_schema).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise RuntimeUserError(f"--json-schema {json_schema}: cannot read it ({e})") from None
    return json_schema_grammar(text, f"--json-schema {json_schema}")


def prompt_text(prompt: str | None, prompt_ids: str | None) -> str | None:
    """The prompt: `-p TEXT`; `-p -` reads stdin; no prompt at all reads stdin when it is not
    a terminal (`echo hi | fuselm run M`), as llama.cpp and mlx-lm do."""
    if prompt == "-" or (prompt is None and prompt_ids is None and not sys.stdin.isatty()):
        text = sys.stdin.read()
        if not text.strip():
            raise click.UsageError("the prompt read from stdin is empty; give -p TEXT")
        return text.rstrip("\n")
    return prompt


# Shared with chat_cmd (same options, one definition).
sampling_from = _sampling
open_artifact = _open
sampling_options = _sampling_options
JSON_SCHEMA_OPTION = click.option(
    "--json-schema", "json_schema", type=click.Path(dir_okay=False), default=None,
    help="each reply is JSON valid against the JSON schema in this file")
ENGINE_OPTION = _ENGINE
CHUNK_OPTION = _CHUNK
