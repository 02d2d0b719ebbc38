"""`fuselm bench`: llama-bench figures (pp, tg: median and spread of r runs after warm-up)."""

from __future__ import annotations

import json

import click

from fuselm.runtime_metal.errors import RuntimeUserError


@click.command("bench")
@click.argument("out_dir", type=click.Path(file_okay=False, exists=True))
@click.option("-p", "--prompt-tokens", "p", type=click.IntRange(1), default=512,
              show_default=True, help="prompt length for pp")
@click.option("-n", "--new-tokens", "n", type=click.IntRange(2), default=128, show_default=True,
              help="new tokens for tg")
@click.option("-r", "--repetitions", "r", type=click.IntRange(1), default=5, show_default=True,
              help="timed runs (after one warm-up run)")
@click.option("--engine", type=click.Choice(["auto", "mlx", "onnxruntime"]), default="auto",
              show_default=True, help="auto: mlx where MLX has a GPU, onnxruntime otherwise")
@click.option("--accuracy-level", type=click.IntRange(0, 4), default=4, show_default=True,
              help="onnxruntime Q4 activation precision: 4 = int8 (fast), 0 = float (exact)")
@click.option("--no-compile", is_flag=True, help="MLX: decode node by node (the executor)")
@click.option("--prefill-chunk", type=click.IntRange(1), default=512, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="stdout: one JSON object only")
@click.option("--profile", is_flag=True, help="also a per-op time table (MLX executor)")
def bench(out_dir: str, p: int, n: int, r: int, engine: str, accuracy_level: int,
          no_compile: bool, prefill_chunk: int, as_json: bool, profile: bool) -> None:
    """Benchmark OUT_DIR: prefill (pp) and decode (tg) tokens/s, device, peak memory."""
    from fuselm.runtime_metal.bench import run_bench, table
    from fuselm.runtime_metal.engine import resolve_engine

    name = resolve_engine(engine)
    if profile and name != "mlx":
        raise RuntimeUserError("--profile times the MLX engine's nodes; add --engine mlx")
    options: dict[str, object] = (
        {"accuracy_level": accuracy_level} if name == "onnxruntime" else {"fast": not no_compile})
    res = run_bench(out_dir, p, n, r, name, profile=profile, prefill_chunk=prefill_chunk,
                    **options)
    if as_json:
        click.echo(json.dumps(res.to_dict()))
        return
    click.echo(table(res))
    if res.profile:
        click.echo(f"\n{'op':<28}{'calls':>8}{'total ms':>12}{'%':>8}")
        for row in res.profile:
            click.echo(f"{row['op']:<28}{row['calls']:>8}{row['total_ms']:>12.2f}"
                       f"{row['percent']:>8.1f}")
