"""`fuselm convert` and `fuselm demo`."""

from __future__ import annotations

import json
from pathlib import Path

import click

from fuselm.converter.errors import UserError

# The pipeline, the quantization options and the progress display import onnx, numpy and the
# exporters: imported in the command bodies, so that `fuselm --help` and argument errors answer
# without them.


DTYPES = ("auto", "float32", "float16", "bfloat16")


def _dtype(dtype: str) -> str:
    if dtype not in DTYPES:
        raise click.BadParameter(f"{dtype!r} is not one of {', '.join(map(repr, DTYPES))}",
                                 param_hint="--dtype")
    return dtype


def _passes(value: str | None) -> list[str] | None:
    return [p.strip() for p in value.split(",") if p.strip()] if value else None


@click.command("convert")
@click.argument("model_dir", type=click.Path(path_type=Path))
@click.option(
    "-o",
    "--out",
    "out_dir",
    required=True,
    type=click.Path(path_type=Path),
    help="Output directory (model.onnx, model.onnx.data, fuselm.json, tokenizer).",
)
@click.option(
    "--dtype",
    metavar="[auto|float32|float16|bfloat16]",
    default="auto",
    show_default=True,
    callback=lambda _ctx, _param, v: _dtype(v),
    help="Graph dtype; auto keeps the checkpoint's (bf16 → float16). bfloat16 runs in "
    "float32 on a CPU (onnxruntime upcasts its weights at load).",
)
@click.option(
    "--quant",
    type=click.Choice(["none", "q4", "q6", "q8", "mixed"]),
    default=None,
    help="q4 / q6 / q8: 4-, 6- or 8-bit block weights (DequantizeLinear + MatMul / fused ops); "
    "mixed: 4, 6 or 8 bits per tensor by measured error per added bit, under --bits-budget (5.75). "
    "Default: none, except a quantized GGUF (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, K-quant, IQ4, "
    "IQ3 or IQ2_XXS blocks), which keeps its blocks.",
)
@click.option(
    "--block-size",
    "--q-group-size",
    type=int,
    default=None,
    help="Q4 block size along the reduction axis (32, 64 or 128) for every tensor. Default: "
    "32, or 32 or 64 per tensor under --bits-budget.",
)
@click.option("--bits-budget", type=float, default=None, metavar="BITS",
              help="Q4 mean bits per weight (4.3125-4.625, e.g. 4.45): 32 or 64 per tensor, "
              "chosen by measured error. Default: none (block 32 everywhere, 4.625 bits). With "
              "--quant mixed: the mean of its 4/6/8-bit choice (4.625-8.75; default 5.75).")
@click.option("-q", "--quantize", is_flag=True,
              help="mlx-lm's spelling: quantize, to 4 bits (--quant q4) unless --q-bits says "
              "otherwise.")
@click.option("--q-bits", type=click.Choice(["4", "6", "8"]), default=None,
              help="mlx-lm's spelling: --q-bits 4 is --quant q4, 6 --quant q6, 8 --quant q8.")
@click.option("--sym", is_flag=True, help="Symmetric Q4 (fixed zero point).")
@click.option(
    "--quant-lm-head/--no-quant-lm-head",
    default=None,
    help="Quantize the LM head (and a tied embedding table with it); on with --quant q4.",
)
@click.option("--quant-embeddings", is_flag=True, help="Also quantize an untied embedding table.")
@click.option(
    "--quant-method",
    type=click.Choice(["search", "minmax"]),
    default="search",
    show_default=True,
    help="Q4 scale/zero-point choice: error-minimizing search, or plain min/max.",
)
@click.option("--calibration", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="Q4: a text (a few hundred words or more, not your evaluation text) run "
              "through the float model; every weight is rounded with error feedback on its "
              "activations (GPTQ-style). Slower convert. Default: a built-in text, error "
              "feedback on the LM head, per-channel importance elsewhere.")
@click.option("--no-calibration", is_flag=True,
              help="Q4 without the built-in calibration text: data-free (block 32, norm-weighted).")
@click.option("--report", is_flag=True, help="Print the Q4 per-tensor error report (quant-report).")
@click.option("--adapter", type=click.Path(path_type=Path), default=None, metavar="PEFT_DIR",
              help="A PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) "
              "merged into the float weights before quantization.")
@click.option("--passes", "passes", default=None, help="Comma-separated passes (default: all).")
@click.option("--no-optimize", is_flag=True, help="Skip the graph passes (raw export).")
@click.option("--keep-intermediate", is_flag=True, help="Keep raw.onnx beside the output.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary on stdout.")
@click.option("--quiet", is_flag=True, help="No progress output.")
@click.option("--allow-nonfinite", is_flag=True,
              help="Convert NaN/Inf weights instead of refusing (recorded in fuselm.json).")
def convert_command(
    model_dir: Path,
    out_dir: Path,
    dtype: str,
    quant: str | None,
    block_size: int | None,
    bits_budget: float | None,
    q_bits: str | None,
    quantize: bool,
    sym: bool,
    quant_lm_head: bool | None,
    quant_embeddings: bool,
    quant_method: str,
    calibration: str | None,
    no_calibration: bool,
    report: bool,
    adapter: Path | None,
    passes: str | None,
    no_optimize: bool,
    keep_intermediate: bool,
    as_json: bool,
    quiet: bool,
    allow_nonfinite: bool,
) -> None:
    """Convert an HF decoder checkpoint (MODEL_DIR, or a hub id ORG/NAME) into a fused ONNX
    artifact."""
    from fuselm.converter import pipeline
    from fuselm.converter.models.hub import resolve_source
    from fuselm.converter.pipeline import ConvertOptions
    from fuselm.converter.progress import stage_progress, stderr
    from fuselm.passes.quant.options import quant_options

    if quantize and quant is None and q_bits is None:  # -q --q-bits N: mlx-lm's N-bit
        quant = "q4"
    if no_optimize and passes:
        raise UserError("--passes picks among the graph passes, which --no-optimize skips; give "
                        "one of them")
    model_dir = resolve_source(model_dir)
    quant_opts = quant_options(quant, q_bits=None if q_bits is None else int(q_bits),
                               block_size=block_size, bits_budget=bits_budget,
                               symmetric=sym, quant_lm_head=quant_lm_head,
                               quant_embeddings=quant_embeddings, quant_method=quant_method,
                               calibration=calibration, default_calibration=not no_calibration)
    opts = ConvertOptions(
        dtype=dtype,
        optimize=not no_optimize,
        passes=_passes(passes),
        quant=quant_opts,
        source_quant=quant != "none",
        keep_intermediate=keep_intermediate,
        allow_nonfinite=allow_nonfinite,
        adapter=adapter,
    )
    with stage_progress(not quiet and not as_json) as progress:
        result = pipeline.convert(model_dir, out_dir, opts, progress)
    if result.report is not None and not quiet:
        stderr.print(result.report.render())
    if result.manifest.source.get("nonfinite_tensors"):  # allowed, but never silently
        bad = result.manifest.source["nonfinite_tensors"]
        stderr.print(f"[yellow]warning:[/] {len(bad)} tensor(s) hold NaN/Inf: {', '.join(bad[:4])}")
    summary = {
        "out_dir": str(result.out_dir),
        "architecture": result.manifest.model.architecture,
        "dtype": result.manifest.dtype,
        "steps": result.manifest.steps,
        "quantization": result.manifest.quantization,
        "seconds": {k: round(v, 3) for k, v in result.seconds.items()},
        "passes": result.manifest.passes,
    }
    if as_json:
        click.echo(json.dumps(summary, indent=2))
    elif not quiet:
        stderr.print(f"[green]wrote[/] {result.out_dir} in {result.seconds['total']:.1f}s")
    if report and not as_json:
        from fuselm.converter.cli.quant_report_cmd import render

        click.echo(render(result.manifest.quantization))


convert = convert_command


@click.command("demo")
@click.option(
    "-o",
    "--out",
    "out_dir",
    type=click.Path(path_type=Path),
    default=None,
    help="Where to write the converted model  [default: smollm2-q4 in fuselm's cache folder, "
    "$XDG_CACHE_HOME/fuselm or ~/.cache/fuselm]",
)
@click.option("--prompt", default="What is the capital of France?", show_default=True)
@click.option("-n", "max_new_tokens", type=click.IntRange(1), default=64, show_default=True)
@click.option(
    "--engine",
    type=click.Choice(["auto", "mlx", "onnxruntime"]),
    default="auto",
    show_default=True,
    help="auto: mlx where MLX has a GPU (Metal/CUDA), onnxruntime otherwise",
)
def demo(out_dir: Path | None, prompt: str, max_new_tokens: int, engine: str) -> None:
    """Convert the bundled SmolLM2-135M-Instruct GGUF (its Q4_1 blocks kept) and answer a
    question with it."""
    from fuselm.config import cache_folder
    from fuselm.converter import out_dir as out_dir_safety
    from fuselm.converter import pipeline
    from fuselm.converter.cli.run_cmd import run
    from fuselm.converter.models.smollm2 import bundled_gguf
    from fuselm.converter.pipeline import ConvertOptions
    from fuselm.converter.progress import stage_progress, stderr
    if out_dir is not None:  # before any output: a refused -o is one error line
        out_dir_safety.check_target(out_dir)
    gguf = bundled_gguf()
    artifact_dir = out_dir or cache_folder() / "demo" / "smollm2-q4"
    stderr.print(f"converting {gguf.name} (GGUF) → {artifact_dir}, keeping its Q4_1 blocks")
    with stage_progress() as progress:
        result = pipeline.convert(gguf, artifact_dir, ConvertOptions(), progress)
    if result.report is not None:
        stderr.print(result.report.render())
    stderr.print(f"[green]converted[/] in {result.seconds['total']:.1f}s → {artifact_dir}")
    stderr.print(f"[bold]>>> {prompt}[/]  (chat template applied)")
    click.get_current_context().invoke(
        run, out_dir=str(artifact_dir), prompt=prompt, max_new_tokens=max_new_tokens,
        engine=engine
    )
    click.echo(next_steps(gguf, artifact_dir), err=True)  # plain: rich wraps long paths


def own_command() -> str:
    """How the user can call this fuselm again: `fuselm` when that name on PATH is this
    executable, else this executable's path (relative to the working folder when inside it).
    The README's setup installs into .venv/bin, which is not on PATH, so a bare `fuselm` in the
    demo's next steps would not be found."""
    import shutil
    import sys

    me = Path(sys.argv[0])
    if me.name != "fuselm":  # `python -m fuselm` or an embedding: no script path to give
        return "fuselm"
    found = shutil.which("fuselm")
    if found is not None and Path(found).resolve() == me.resolve():
        return "fuselm"
    try:
        return str(me.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(me.resolve())


def next_steps(gguf: Path, artifact: Path) -> str:
    """What to try after the demo, with its own paths."""
    f = own_command()
    return "\n".join([
        f"the model is in {artifact}; next, try:",
        f"  {f} chat {artifact}                      # talk to it",
        f"  {f} run {artifact} -p \"Tell me a joke\" -n 64",
        f"  {f} serve {artifact}                     # an OpenAI-compatible server",
        f"  {f} validate {gguf} {artifact}   # check it against the GGUF's own weights",
        f"  {f} bench {artifact}                     # prefill / decode tokens/s",
        f"  {f} run {gguf} -p Hello             # a GGUF runs directly (converted once)",
    ])
