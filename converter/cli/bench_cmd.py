"""`fuselm bench`: llama-bench figures (pp, tg: median and spread of r runs after warm-up),
one value or a grid (`-p 128,512 -n 64,128`)."""

from __future__ import annotations

import json
import sys

import click

from fuselm.converter.cli.bench_grid import Row, int_list, model_columns, progress_bar, run_grid
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


@click.command("bench")
@model_argument
@click.option("-p", "--prompt-tokens", "--n-prompt", "p", default="512", show_default=True,
              callback=int_list, help="prompt length(s) for pp, e.g. 128,512")
@click.option("-n", "--new-tokens", "--n-gen", "n", default="128", show_default=True,
              callback=int_list, help="new tokens for tg, e.g. 64,128")
@click.option("-r", "--repetitions", "r", type=click.IntRange(1, 1000), default=5,
              show_default=True, help="timed runs (after one warm-up run), at most 1000")
@click.option("--engine", type=click.Choice(["auto", "mlx", "onnxruntime"]), default="auto",
              show_default=True, help="auto: mlx where MLX has a GPU, onnxruntime otherwise")
@accuracy_option
@threads_option
@kv_cache_options
@click.option("--no-compile", is_flag=True, help="MLX: decode node by node (the executor)")
@click.option("--prefill-chunk", type=click.IntRange(1), default=None,
              help="prompt tokens per prefill step  [default: 2048 with MLX on CUDA, else 512]")
@click.option("--json", "as_json", is_flag=True, help="stdout: one JSON object only")
@click.option("--profile", is_flag=True, help="also a per-op time table (MLX executor)")
@parallel_option
@draft_options
@verbose_option
def bench(out_dir: str, p: list[int], n: list[int], r: int, engine: str,
          accuracy_level: int | None,
          threads: int | None, no_compile: bool, prefill_chunk: int | None, as_json: bool,
          profile: bool, verbose: bool = False, parallel: str | None = None,
          draft_lookup: bool = False, draft: str | None = None, num_draft: int | None = None,
          draft_ngram: int | None = None, kv_bits: str | None = None,
          kv_group_size: str | None = None, exact_rows: bool | None = None) -> None:
    """Benchmark MODEL: prefill (pp) and decode (tg) tokens/s, device, peak memory.
    With --draft-lookup or --draft, tg is speculative decoding's (the prompt is random ids:
    what prompt lookup finds there is little; benchmarks/spec_bench.py measures a workload
    that repeats its input)."""
    refuse_parallel_draft(parallel, draft, draft_lookup)
    from fuselm.converter.cli.run_cmd import warn_mlx_on_cpu
    from fuselm.runtime_metal.artifact import read_manifest
    from fuselm.runtime_metal.bench import check_fits, run_bench
    from fuselm.runtime_metal.engine import resolve_engine

    config = runtime_config(verbose, engine=engine, threads=threads)
    manifest = read_manifest(out_dir)
    name = resolve_engine(engine, parallel)
    if profile and name != "mlx":
        raise RuntimeUserError("--profile times the MLX engine's nodes; add --engine mlx")
    if no_compile and name != "mlx":
        raise RuntimeUserError("--no-compile runs the MLX engine's decode node by node; "
                               "onnxruntime has no compiled step to turn off (drop it, or add "
                               "--engine mlx)")
    warn_mlx_on_cpu(manifest, engine)
    options = {**(ort_options(name, accuracy_level, threads, exact_rows,
                              drafting=draft_lookup or draft is not None)
                  or {"fast": not no_compile}),
               "config": config, **join_parallel(parallel),
               **kv_options(name, kv_bits, kv_group_size)}
    cols = model_columns(out_dir, manifest)
    grid = len(p) > 1 or len(n) > 1
    speculative: dict[str, object] = {}
    if draft_lookup or draft is not None or num_draft is not None or draft_ngram is not None:
        if grid:
            raise RuntimeUserError("speculative decoding takes one -p and one -n value")
        from fuselm.runtime_metal.drafting import speculative_options
        from fuselm.runtime_metal.loaded_model import open_model

        speculative = speculative_options(
            open_model(out_dir, name, defer_engine=True), draft=draft, lookup=draft_lookup,
            num_draft=num_draft, max_ngram=draft_ngram, **options)
    if grid and profile:
        raise RuntimeUserError("--profile takes one -p and one -n value")
    # every row checked against the context before the first one runs (a grid's rows are
    # ppP with 2 new tokens and tgN after a 1-token prompt: bench_grid.run_grid)
    for rp, rn in ([(x, 2) for x in p] + [(1, x) for x in n]) if grid else [(p[0], n[0])]:
        check_fits(rp, rn, manifest.model.context_length)
    show = sys.stderr.isatty() and not as_json
    with progress_bar(show, len(p) + len(n) if grid else 1) as start:
        if grid:
            rows = run_grid(out_dir, p, n, r, name, start, prefill_chunk=prefill_chunk,
                            **options)
        else:
            res = run_bench(out_dir, p[0], n[0], r, name, profile=profile,
                            prefill_chunk=prefill_chunk, on_run=start(f"pp{p[0]} + tg{n[0]}"),
                            speculative=speculative, **options)
            rows = [Row(f"pp{p[0]}", res.pp_stats.median, res.pp_stats.stdev),
                    Row(f"tg{n[0]}", res.tg_stats.median, res.tg_stats.stdev)]
    from fuselm.converter.cli.bench_grid import table

    if as_json:
        if grid:
            click.echo(json.dumps({**cols, "engine": name, "repetitions": r,
                                   "results": [row.__dict__ for row in rows]}))
        else:
            click.echo(json.dumps({**res.to_dict(), **cols}))
        return
    click.echo(table(cols, name, rows))
    if grid:
        click.echo(f"{r} runs after warm-up per row; ppP: a P-token prompt; tgN: N tokens after "
                   "a 1-token prompt")
        return
    e, d = res.engine, res.device
    click.echo(f"{r} runs after warm-up; decode {res.ms_per_token:.3f} ms/token; peak memory "
               f"{res.peak_memory_bytes / 2**20:.1f} MiB ({res.peak_memory_source}); "
               f"{e.get('decode', e.get('engine'))} on "
               f"{d.get('gpu') or d.get('device_name') or d.get('mlx_device')}")
    if res.speculative:
        sp = res.speculative
        click.echo(f"speculative decoding ({sp['drafter']}, up to {sp['num_draft']} drafts a "
                   f"step): {sp.get('accepted', 0)} of {sp.get('drafted', 0)} drafted tokens "
                   "kept over the timed runs")
    if res.profile:
        click.echo(f"\n{'op':<28}{'calls':>8}{'total ms':>12}{'%':>8}")
        for row in res.profile:
            click.echo(f"{row['op']:<28}{row['calls']:>8}{row['total_ms']:>12.2f}"
                       f"{row['percent']:>8.1f}")
