"""`fuselm perplexity`: PPL of a text file under a converted model, llama-perplexity style."""

from __future__ import annotations

import json

import click

from fuselm.converter.cli.options import (
    accuracy_option,
    join_parallel,
    kv_cache_options,
    kv_options,
    model_argument,
    ort_options,
    parallel_option,
    threads_option,
)

_RULE = ("The text is tokenized without special tokens and cut into consecutive chunks of "
         "--context tokens (a last partial chunk is dropped); each chunk runs from an empty "
         "cache and only its second half is scored, so every scored token sees at least "
         "context/2 tokens. PPL = exp(mean NLL), ± its standard error.")


@click.command("perplexity", help=f"Perplexity of a text under MODEL. {_RULE}")
@model_argument
@click.option("-f", "--file", "--text", "text_file", type=click.Path(dir_okay=False), default=None,
              help="UTF-8 text file [default: a bundled ~2.5k-token English prose passage]")
@click.option("--context", type=click.IntRange(4), default=512, show_default=True,
              help="tokens per chunk (even)")
@click.option("--engine", type=click.Choice(["auto", "mlx", "onnxruntime"]), default="auto",
              show_default=True,
              help="auto: mlx where MLX has a GPU (Metal/CUDA), onnxruntime otherwise")
@accuracy_option
@threads_option
@kv_cache_options
@click.option("--json", "as_json", is_flag=True, help="stdout: one JSON object only")
@parallel_option
def perplexity(out_dir: str, text_file: str | None, context: int, engine: str,
               accuracy_level: int | None, threads: int | None, as_json: bool,
               parallel: str | None = None, kv_bits: str | None = None,
               kv_group_size: str | None = None) -> None:
    from fuselm.converter.progress import stage_progress
    from fuselm.runtime_metal.engine import resolve_engine
    from fuselm.runtime_metal.perplexity import SAMPLE_TEXT, read_text
    from fuselm.runtime_metal.perplexity import perplexity as run_ppl

    text = read_text(text_file or SAMPLE_TEXT)
    name = resolve_engine(engine, parallel)
    options = {**ort_options(name, accuracy_level, threads), **join_parallel(parallel),
               **kv_options(name, kv_bits, kv_group_size)}
    with stage_progress(not as_json) as bar:
        def on_chunk(done: int, total: int, ppl: float) -> None:
            bar("chunks", done, total, f"PPL {ppl:.4f}")

        result = run_ppl(out_dir, text, context=context, engine=name,
                         on_chunk=on_chunk if bar else None, **options)
    if as_json:
        click.echo(json.dumps({**result.to_dict(), "text": str(text_file or SAMPLE_TEXT)}))
        return
    click.echo(f"[{result.engine}] PPL = {result.ppl:.4f} ± {result.ppl_stderr:.4f}  "
               f"({result.chunks} chunks × {result.context} tokens, {result.scored_tokens} "
               f"scored, {result.tokens_per_s:.1f} tok/s)")
