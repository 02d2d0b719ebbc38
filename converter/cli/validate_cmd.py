"""`fuselm validate`: the verification ladder (HF float32 -> onnxruntime -> MLX) with a verdict
per rung and a non-zero exit on FAIL."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import click

from fuselm.converter.cli.run_cmd import CHUNK_OPTION
from fuselm.runtime_metal.errors import RuntimeUserError

DEFAULT_PROMPTS = ("Hello world, the quick brown fox", "Rotary embeddings rotate")
# The fields that make two models the same network (ModelInfo's names).
SAME_MODEL = ("architecture", "vocab_size", "num_layers", "hidden_size", "num_heads",
              "num_kv_heads", "head_dim", "intermediate_size")


def check_same_model(model_dir: str, manifest: object, spec: object = None) -> None:
    """Refuse, before any compute, an HF folder (or GGUF, `spec` given) and an artifact of
    different models."""
    from fuselm.export.registry import decoder_spec

    if spec is None:
        if not Path(model_dir, "config.json").is_file():
            raise RuntimeUserError(f"{model_dir} has no config.json; pass the HF model folder "
                                   "or the .gguf file the artifact was converted from")
        spec = decoder_spec(model_dir)
    info = manifest.model  # type: ignore[attr-defined]
    diff = [f"{k}: {getattr(spec, k)} in {model_dir} vs {getattr(info, k)} in the artifact"
            for k in SAME_MODEL if getattr(spec, k) != getattr(info, k)]
    if diff:
        what = "vocabularies" if diff[0].startswith("vocab_size") and len(diff) == 1 \
            else "models"
        raise RuntimeUserError(
            f"the checkpoint and the artifact are different {what} ({'; '.join(diff)}); "
            "pass the folder the artifact was converted from")


def _dequantized_reference(model_dir: str) -> Any:
    """An AWQ / GPTQ folder's reference: its dequantized weights in transformers' float32 model
    (export/quantized/reference.py); None for every other HF folder (transformers loads it)."""
    from fuselm.converter.gguf_reference import Reference
    from fuselm.export.open_checkpoint import open_checkpoint
    from fuselm.export.quantized.checkpoint import QuantizedCheckpoint
    from fuselm.export.registry import decoder_spec

    if not Path(model_dir, "config.json").is_file():
        return None
    ckpt = open_checkpoint(model_dir, requantize=True)  # act-order: its float values
    if not isinstance(ckpt, QuantizedCheckpoint):
        return None
    from fuselm.export.quantized.reference import dequantized_model

    return Reference(Path(model_dir), decoder_spec(model_dir), dequantized_model(ckpt))


@click.command("validate")
@click.argument("model_dir", type=click.Path(exists=True))
@click.argument("out_dir", required=False, type=click.Path(file_okay=False))
@click.option("-n", "--tokens", type=click.IntRange(1), default=32, show_default=True,
              help="greedy tokens compared per prompt")
@click.option("--prompt", "prompts", multiple=True, help="text prompt (repeatable)")
@click.option("--engine", "engines", multiple=True, type=click.Choice(["onnxruntime", "mlx"]),
              help="rungs to run (default: onnxruntime, and MLX where it has a GPU)")
@click.option("--mlx", "want_mlx", is_flag=True,
              help="also run the MLX rung on a CPU-only host (slow: MLX's CPU backend)")
@CHUNK_OPTION
@click.option("--text", "ppl_text", type=click.Path(dir_okay=False), default=None,
              help="PPL of each rung on this text (default: the bundled English prose)")
@click.option("--context", "ppl_context", type=click.IntRange(4), default=256,
              show_default=True, help="PPL chunk size (see `fuselm perplexity --help`)")
@click.option("--no-ppl", is_flag=True, help="skip the PPL of each rung")
@click.option("--json", "as_json", is_flag=True)
def validate(model_dir: str, out_dir: str | None, tokens: int, prompts: tuple[str, ...],
             engines: tuple[str, ...], want_mlx: bool, prefill_chunk: int | None,
             ppl_text: str | None, ppl_context: int, no_ppl: bool, as_json: bool) -> None:
    """Check a conversion: HF transformers float32 -> onnxruntime -> MLX on a few prompts,
    with a PASS / WARN / FAIL verdict per rung (exit 1 on FAIL).

    MODEL_DIR is the HF folder or the .gguf file OUT_DIR was converted from; for a GGUF the
    reference is transformers holding the file's own dequantized weights in float32. Without
    OUT_DIR, the conversion `fuselm run MODEL_DIR` uses (the cache's) is checked.

    Thresholds on rel = max|a-b| / max|b| of the logits vs HF: float32 pass <= 1e-4, fail >
    1e-3; float16 pass <= 1e-2, fail > 5e-2; bfloat16 pass <= 2e-2, fail > 5e-2; Q4 pass <=
    0.2, fail > 0.5, or with the PPL measured (the default) on its increase over the
    reference: pass <= +25 %, fail > +50 % (why: see runtime_metal/verdict.py). NaN/Inf
    anywhere fails."""
    from fuselm.converter.model_path import resolve_model, source_kind

    ctx = click.get_current_context()
    for name, flag in (("ppl_text", "--text"), ("ppl_context", "--context")):
        if no_ppl and ctx.get_parameter_source(name) != click.core.ParameterSource.DEFAULT:
            raise RuntimeUserError(f"{flag} sets the PPL phase, which --no-ppl skips; give "
                                   "one of them")
    kind = source_kind(Path(model_dir))
    if kind == "artifact":
        raise click.UsageError(f"{model_dir} is a converted artifact; give the HF folder or the "
                               ".gguf file it came from, then the artifact: validate MODEL_DIR "
                               "OUT_DIR")
    if out_dir is None:
        if kind is None:
            raise click.UsageError(f"{model_dir} is neither an HF folder nor a .gguf file")
        out_dir = str(resolve_model(model_dir))
    with contextlib.ExitStack() as stack:
        reference = None
        if kind == "gguf":
            from fuselm.converter.gguf_reference import gguf_reference
            from fuselm.runtime_metal.artifact import read_manifest

            manifest = read_manifest(out_dir)

            def same_model(spec: object) -> None:
                check_same_model(model_dir, manifest, spec)
                click.echo(f"reading {model_dir}'s weights as the float32 reference", err=True)

            reference = stack.enter_context(gguf_reference(model_dir, same_model))
        else:
            reference = _dequantized_reference(model_dir)
        _ladder(model_dir, out_dir, reference, tokens, prompts, engines, want_mlx, prefill_chunk,
                ppl_text, ppl_context, no_ppl, as_json)


def _ladder(model_dir: str, out_dir: str, reference: Any, tokens: int,  # noqa: PLR0913
            prompts: tuple[str, ...], engines: tuple[str, ...], want_mlx: bool,
            prefill_chunk: int | None, ppl_text: str | None, ppl_context: int, no_ppl: bool,
            as_json: bool) -> None:
    from fuselm.runtime_metal.artifact import read_manifest
    from fuselm.runtime_metal.engine import mlx_has_gpu
    from fuselm.runtime_metal.loaded_model import open_model
    from fuselm.runtime_metal.validate import validate as run_ladder
    from fuselm.runtime_metal.verdict import THRESHOLDS, judge, precision

    manifest = read_manifest(out_dir)
    check_same_model(model_dir, manifest, reference.spec if reference else None)
    say = (lambda m: click.echo(m, err=True)) if as_json else click.echo
    rungs = list(engines) or ["onnxruntime", "mlx"]
    if "mlx" in rungs and not engines and not want_mlx and not mlx_has_gpu():
        rungs.remove("mlx")
        say("MLX rung skipped: this host has no GPU for MLX and its CPU backend is slow "
            "(add --mlx to run it)")
    elif want_mlx and "mlx" not in rungs:
        rungs.append("mlx")
    texts = list(prompts) or list(DEFAULT_PROMPTS)
    ppl_tokens = None
    # The artifact's tokenizer (the ladder opens each rung's engine itself).
    model = open_model(out_dir, rungs[0], defer_engine=True)
    if model.has_tokenizer or prompts:
        tok = model.tokenizer
        ids = [tok.encode(t) for t in texts]
        shown = [repr(t) for t in texts]
        if not no_ppl:
            from fuselm.runtime_metal.perplexity import SAMPLE_TEXT, read_text, text_tokens

            ppl_tokens = text_tokens(tok, read_text(ppl_text or SAMPLE_TEXT))
    else:  # no tokenizer: fixed id prompts spread over the vocabulary
        v = manifest.model.vocab_size
        ids = [[(7 * i + 3) % v for i in range(12)], [(13 * i + 5) % v for i in range(20)]]
        shown = [f"ids {p[:4]}... (no tokenizer)" for p in ids]
    if any(not p for p in ids):
        raise RuntimeUserError("a prompt encodes to no tokens; give a longer --prompt")
    longest, context = max(len(p) for p in ids), manifest.model.context_length
    if longest + tokens > context:  # past it HF's greedy loop runs on (10**9 tokens: forever)
        raise RuntimeUserError(
            f"-n {tokens} after a {longest}-token prompt needs {longest + tokens} positions but "
            f"the model's context is {context}; give -n <= {context - longest}")
    key = precision(manifest.dtype, manifest.quantization)
    what = "its dequantized weights in HF float32" if reference else "HF float32"
    say(f"validating {out_dir} ({key}) against {model_dir} ({what}): "
        f"{len(ids)} prompts, {tokens} greedy tokens each, rungs: {', '.join(rungs)}")
    t0 = time.perf_counter()

    def progress(i: int) -> None:
        say(f"  [{i + 1}/{len(ids)}] {shown[i]} ({len(ids[i])} tokens) "
            f"done at {time.perf_counter() - t0:.1f}s")
        sys.stdout.flush()

    from fuselm.converter.progress import stage_progress

    with stage_progress(not as_json) as bar:
        def on_ppl(rung: str, done: int, total: int, ppl: float) -> None:
            bar(f"PPL {rung}", done, total, f"{ppl:.4f}")

        report = run_ladder(model_dir, out_dir, ids, tokens, prefill_chunk, tuple(rungs),
                            ppl_tokens, ppl_context, on_prompt=progress,
                            reference=reference.model if reference else None,
                            on_ppl=on_ppl if bar else None)
    reference_ppl = (report.rungs[0].perplexity or {}).get("ppl")

    def increase(rung: Any) -> float | None:
        if not reference_ppl or not rung.perplexity:
            return None
        return rung.perplexity["ppl"] / reference_ppl - 1

    verdicts = {r.name: judge(r.logits_rel_hf, r.nonfinite, key, increase(r))
                for r in report.rungs[1:]}
    if any(report.rungs[0].nonfinite):
        for v in verdicts.values():
            v.status, v.reason = "FAIL", "the HF checkpoint itself gives NaN/Inf logits"
    if as_json:
        out = report.to_dict()
        out["verdicts"] = {k: v.__dict__ for k, v in verdicts.items()}
        out["thresholds"] = {key: THRESHOLDS[key]}
        click.echo(json.dumps(out))
    else:
        click.echo(f"{'rung':<14}{'rel vs above':>14}{'rel vs HF':>12}{'greedy = HF':>14}"
                   f"  verdict")
        for r in report.rungs[1:]:
            v = verdicts[r.name]
            click.echo(f"{r.name:<14}{max(r.logits_rel):>14.2e}{max(r.logits_rel_hf):>12.2e}"
                       f"{min(r.greedy_agree):>9}/{tokens}     {v.status}: {v.reason}")
        for r in report.rungs:
            if r.perplexity:
                p = r.perplexity
                click.echo(f"PPL {r.name:<14}{p['ppl']:.4f} ± {p['ppl_stderr']:.4f} "
                           f"(context {p['context']}, {p['scored_tokens']} tokens scored)")
    worst = "FAIL" if any(v.status == "FAIL" for v in verdicts.values()) else (
        "WARN" if any(v.status == "WARN" for v in verdicts.values()) else "PASS")
    say(f"verdict: {worst}")
    if worst == "FAIL":
        sys.exit(1)
