"""`fuselm serve`: an OpenAI-compatible HTTP server over a converted model (Starlette + uvicorn)."""

from __future__ import annotations

import logging
from pathlib import Path

import click

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
    threads_option,
)
from fuselm.runtime_metal.errors import RuntimeUserError

DEFAULT_CONTEXT = 4096  # a 40k-context model at batch 8 would reserve GBs of KV cache
# The one place the server reads its key from the environment (a key on the command line shows
# in every user's process list).
API_KEY_ENV = "FUSELM_API_KEY"


def _need_serve_extra() -> None:
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise RuntimeUserError(
            "`fuselm serve` needs the serve extra: pip install 'fuselm[serve]'") from None


def make_decoder(engine, max_batch: int, max_context: int,  # noqa: ANN001, ANN201
                 prefill_chunk: int | None, kv_tokens: int | None = None,
                 **speculative: object):
    """The batch decoder the scheduler drives for this engine (speculative: its drafter and
    num_draft)."""
    from fuselm.converter.serve.decoder import ServeDecoder

    return ServeDecoder(engine, max_batch, max_context, prefill_chunk=prefill_chunk,
                        kv_tokens=kv_tokens, **speculative)


@click.command("serve")
@model_argument
@click.option("--host", default="127.0.0.1", show_default=True,
              help="address to listen on; one beyond this machine (0.0.0.0, a LAN address) "
              "needs --api-key or --insecure-no-auth")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True)
@click.option("--engine", type=click.Choice(["auto", "mlx", "onnxruntime"]), default="auto",
              show_default=True,
              help="auto: mlx where MLX has a GPU (Metal/CUDA), onnxruntime otherwise")
@accuracy_option
@threads_option
@kv_cache_options
@click.option("--max-batch", type=click.IntRange(1, 1024), default=8, show_default=True,
              help="sequences decoded together")
@click.option("--max-queue", type=click.IntRange(1), default=64, show_default=True,
              help="requests allowed to wait for a slot; more get HTTP 503")
@click.option("--max-context", type=click.IntRange(2), default=None,
              help="tokens per sequence (prompt + completion); KV memory is reserved for "
              f"max-batch x max-context  [default: the model's context, at most {DEFAULT_CONTEXT}]")
@click.option("--max-kv-tokens", type=click.IntRange(1), default=None,
              help="KV cache budget in tokens, all requests together: a request reserves its "
              "prompt + max_tokens when it starts, waits while that does not fit, and gets "
              "HTTP 503 if it never can  [default: max-batch x max-context]")
@click.option("--memory-limit", type=click.FloatRange(0, min_open=True), default=None,
              metavar="GB", help="the KV cache budget in GB (10^9 bytes) instead of tokens, "
              "turned into tokens by this model's KV bytes per token")
@click.option("--queue-timeout", type=click.FloatRange(0, min_open=True), default=None,
              metavar="SECONDS", help="a request that waits longer than this to start gets "
              "HTTP 503  [default: no limit]")
@click.option("--default-max-tokens", type=click.IntRange(1), default=2048, show_default=True,
              help="completion length when a chat request gives no max_tokens")
@click.option("--prefill-chunk", type=click.IntRange(1), default=None,
              help="prompt tokens per prefill step  [default: 2048 with MLX on CUDA, else 512]")
@click.option("--model-name", default=None, help="the model id clients send; default: "
              "MODEL's name")
@click.option("--max-body", type=click.IntRange(1024), default=2 * 1024 * 1024,
              show_default=True, help="largest request body in bytes (HTTP 413 above)")
@click.option("--api-key", envvar=API_KEY_ENV, show_envvar=True, default=None,
              help="require `Authorization: Bearer KEY` on every path but /health (HTTP 401 "
              "otherwise); prefer the environment variable, which other users cannot see")
@click.option("--insecure-no-auth", is_flag=True,
              help="allow a --host beyond this machine without an API key")
@click.option("--allowed-host", "allowed_hosts", multiple=True, metavar="HOST",
              help="a Host header to answer besides localhost, 127.0.0.1, [::1] and --host "
              "(NAME, NAME:PORT or '*'; repeatable); other names get HTTP 421, so a page "
              "reaching the server by DNS rebinding is refused")
@click.option("--cors-origin", "cors_origins", multiple=True, metavar="ORIGIN",
              help="a web origin (scheme://host[:port], or '*') whose pages may call the API "
              "(repeatable); requests from other origins get HTTP 403  [default: none]")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]),
              default="info", show_default=True)
@parallel_option
@draft_options
def serve(out_dir: str, host: str, port: int, engine: str, accuracy_level: int | None,
          threads: int | None, max_batch: int,
          max_queue: int, max_context: int | None, max_kv_tokens: int | None,
          memory_limit: float | None, queue_timeout: float | None, default_max_tokens: int,
          prefill_chunk: int | None,
          model_name: str | None, max_body: int, api_key: str | None, insecure_no_auth: bool,
          allowed_hosts: tuple[str, ...], cors_origins: tuple[str, ...], log_level: str,
          parallel: str | None = None, draft_lookup: bool = False,
          draft: str | None = None, num_draft: int | None = None,
          draft_ngram: int | None = None, kv_bits: str | None = None,
          kv_group_size: str | None = None, exact_rows: bool | None = None) -> None:
    """Serve MODEL over the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models,
    /health), decoding up to --max-batch requests together.

    Sampling a request leaves out (temperature, top_p, and the extensions top_k, min_p and
    repetition_penalty) comes from the model's generation_config.json as transformers reads it
    (greedy unless it sets do_sample), else greedy, as in `fuselm run`; /v1/models shows it.
    seed, stop, n, logprobs, presence/frequency penalties, logit_bias, response_format
    (json_object, json_schema) and tools / tool_choice are honoured (the reply constrained by
    a grammar where it must follow one); OpenAI parameters fuselm does not implement (echo,
    best_of, suffix, audio, ...) and unknown ones get HTTP 400 naming the parameter.

    Only this machine, and no web page from another origin, can use it by default; /health
    stays open without the API key.

    With --parallel (ranks started by mlx.launch) rank 0 listens and the other ranks follow
    its batch schedule; a rank that dies stops the job: /health answers 503 naming it.

    --draft-lookup or --draft: speculative decoding with batching kept on; greedy requests
    verify their drafts in the batch's step, sampled ones decode plainly beside them. On
    onnxruntime a drafted row is checked alone (drafts are made while one request decodes),
    and exact rows (see --exact-rows) are on by default only with --max-batch 1: they would
    decode the rows one after another."""
    _need_serve_extra()
    from fuselm.converter.serve.access import AccessRules, check_bind

    access = AccessRules.build(host, allowed_hosts, cors_origins, api_key)
    check_bind(host, api_key, insecure_no_auth)

    from fuselm.converter.serve.app import ServeState, create_app
    from fuselm.converter.serve.http_server import serve
    from fuselm.converter.serve.scheduler import Scheduler
    from fuselm.runtime_metal.engine import resolve_engine
    from fuselm.runtime_metal.kv_budget import budget_tokens, describe_budget, kv_token_bytes
    from fuselm.runtime_metal.loaded_model import open_model

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: "
                        "%(message)s")
    refuse_parallel_draft(parallel, draft, draft_lookup)
    name = resolve_engine(engine, parallel)
    # exact rows under drafting only where requests decode one at a time: with them
    # onnxruntime's rows are not batched (at 4 streams 0.57x plain's aggregate tokens/s;
    # BENCHMARKS.md 'Speculative decoding'), so --max-batch > 1 keeps its rows batched
    options = {**ort_options(name, accuracy_level, threads, exact_rows,
                             drafting=(draft_lookup or draft is not None) and max_batch == 1),
               **join_parallel(parallel),
               **kv_options(name, kv_bits, kv_group_size)}
    # The engine is built on the engine thread (build), where it runs: MLX binds its streams
    # to the thread that makes them.
    model = open_model(out_dir, name, defer_engine=True, **options)
    manifest = model.manifest
    context = manifest.model.context_length
    if max_context is not None and max_context > context:
        raise RuntimeUserError(f"--max-context {max_context} is over the model's context "
                               f"({context}); give at most {context}")
    max_context = max_context or min(context, DEFAULT_CONTEXT)
    token_bytes = kv_token_bytes(manifest, name, int(kv_bits) if kv_bits else None,
                                 int(kv_group_size) if kv_group_size else None)
    kv_tokens = budget_tokens(max_kv_tokens, memory_limit, token_bytes)
    described: dict[str, object] = {}
    if parallel:
        from fuselm.runtime_metal.parallel import join

        rank = join(parallel).rank
    else:
        rank = 0
    if rank:  # a follower: no HTTP, rank 0's schedule until it stops
        from fuselm.converter.serve.ranks import follow

        follow(make_decoder(model.engine, max_batch, max_context, prefill_chunk, kv_tokens),
               rank)
        return
    leader = None

    def build():  # noqa: ANN202 - on the engine thread (the draft model's engine too)
        from fuselm.runtime_metal.drafting import speculative_options

        nonlocal leader
        speculative = speculative_options(model, draft=draft, lookup=draft_lookup,
                                          num_draft=num_draft, max_ngram=draft_ngram,
                                          **options)
        decoder = make_decoder(model.engine, max_batch, max_context, prefill_chunk, kv_tokens,
                               **speculative)
        described.update(model.engine.describe())  # the batch decoder's: /health, live
        if parallel:
            from fuselm.converter.serve.ranks import LeaderDecoder

            decoder = leader = LeaderDecoder(decoder)
        return decoder

    # Two tokenizers: the handlers encode with their own while the engine thread's text
    # streams decode with the model's (a fast tokenizer is not safe to share across threads).
    tok_handlers = model.new_tokenizer()
    scheduler = Scheduler(build, model.decoder(), model.eos_ids, max_batch=max_batch,
                          max_queue=max_queue, queue_timeout=queue_timeout)
    scheduler.start()
    assert scheduler.decoder is not None
    from fuselm.converter.model_path import model_name as shown_name

    state = ServeState(scheduler, tok_handlers, model_name or shown_name(Path(out_dir)),
                       max_context, manifest.model.vocab_size, default_max_tokens,
                       max_body, described, sampling=model.sampling_defaults,
                       kv_window=scheduler.decoder.kv_window)
    app = create_app(state, access)
    log = logging.getLogger("fuselm.serve")
    log.info("serving %r (%s engine, max batch %d, context %d) on http://%s:%d", state.model_id,
             name, scheduler.max_batch, state.max_context, host, port)
    log.info("KV budget: %s%s; chats are cut to %d tokens", describe_budget(
        scheduler.decoder.kv_budget, token_bytes), "" if kv_tokens is not None else
        " (max batch x context: --max-kv-tokens or --memory-limit sets it)",
        scheduler.decoder.kv_window)
    log.info("sampling a request does not set: %s (%s)", state.sampling.describe(),
             "from generation_config.json" if model.generation_config else "greedy: the model "
             "has no generation_config.json")
    log.info("API key: %s; cross-origin pages allowed: %s", "required" if api_key else "none",
             ", ".join(sorted(access.cors_origins)) or "none")
    if insecure_no_auth and not api_key:
        log.warning("--insecure-no-auth: anyone who reaches %s:%d can use the model", host, port)
    try:
        serve(app, scheduler, host, port, log_level)
    finally:
        scheduler.stop()
        if leader is not None:
            leader.stop()
