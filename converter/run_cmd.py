"""`fuselm run`, `fuselm chat`, `fuselm validate`: thin click layers over runtime_metal."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from fuselm.runtime_metal.errors import RuntimeUserError

_ENGINE = click.option("--engine", type=click.Choice(["auto", "mlx", "onnxruntime"]),
                       default="auto", show_default=True,
                       help="auto: mlx where MLX has a GPU (Metal/CUDA), onnxruntime otherwise")
_ACC = click.option("--accuracy-level", type=click.IntRange(0, 4), default=4, show_default=True,
                    help="onnxruntime Q4 activation precision: 4 = int8 (fast), 0 = float (exact)")
_CHUNK = click.option("--prefill-chunk", type=click.IntRange(1), default=512, show_default=True,
                      help="prompt tokens per prefill step")


def _sampling(temperature: float, top_k: int, top_p: float, repetition_penalty: float,
              seed: int | None):  # noqa: ANN202
    from fuselm.runtime_metal.sampling import SamplingOptions

    opts = SamplingOptions(temperature, top_k, top_p, repetition_penalty, seed)
    opts.validate()
    return opts


def _open(out_dir: str, engine: str, accuracy_level: int, profile: bool = False):  # noqa: ANN202
    from fuselm.runtime_metal.artifact import read_manifest
    from fuselm.runtime_metal.engine import make_engine, resolve_engine
    from fuselm.runtime_metal.profile import Profiler

    manifest = read_manifest(out_dir)
    name = resolve_engine(engine)
    profiler = Profiler() if profile else None
    if name == "onnxruntime":
        if profile:
            raise RuntimeUserError("--profile times the MLX engine's nodes; add --engine mlx")
        return manifest, make_engine(out_dir, name, accuracy_level=accuracy_level), None
    return manifest, make_engine(out_dir, name, profiler=profiler), profiler


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise RuntimeUserError(
            f"--prompt-ids wants comma-separated integers, got {text!r}") from None
    if not ids:
        raise RuntimeUserError("--prompt-ids is empty")
    return ids


def _sampling_options(f):  # noqa: ANN001, ANN202
    for opt in reversed([
        click.option("--temperature", type=float, default=0.0, show_default=True,
                     help="0 = greedy"),
        click.option("--top-k", type=int, default=0, show_default=True, help="0 = off"),
        click.option("--top-p", type=float, default=1.0, show_default=True, help="1 = off"),
        click.option("--repetition-penalty", type=float, default=1.0, show_default=True),
        click.option("--seed", type=int, default=None),
    ]):
        f = opt(f)
    return f


@click.command("run")
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--prompt", default=None, help="text; the chat template is applied if present")
@click.option("--prompt-ids", default=None, help="token ids as given, e.g. 1,2,3")
@click.option("--raw", is_flag=True, help="do not apply the chat template to --prompt")
@click.option("-n", "--max-new-tokens", type=click.IntRange(1), default=64, show_default=True)
@_sampling_options
@click.option("--stop", multiple=True, help="stop string (repeatable)")
@_ENGINE
@_ACC
@_CHUNK
@click.option("--json", "as_json", is_flag=True, help="stdout: one JSON object only")
@click.option("--profile", is_flag=True, help="per-node time table (MLX engine), warm-up skipped")
@click.option("--device-sampling", is_flag=True,
              help="MLX: sample on device with MLX's generator (greedy always runs on device)")
def run(out_dir: str, prompt: str | None, prompt_ids: str | None, raw: bool, max_new_tokens: int,
        temperature: float, top_k: int, top_p: float, repetition_penalty: float,
        seed: int | None, stop: tuple[str, ...], engine: str, accuracy_level: int,
        prefill_chunk: int, as_json: bool, profile: bool, device_sampling: bool) -> None:
    """Generate text from a converted model in OUT_DIR."""
    from fuselm.runtime_metal.generate import generate
    from fuselm.runtime_metal.tokenizer import (
        encode_prompt,
        eos_ids,
        generation_config,
        load_tokenizer,
    )

    if (prompt is None) == (prompt_ids is None):
        raise click.UsageError("give exactly one of --prompt and --prompt-ids")
    sampling = _sampling(temperature, top_k, top_p, repetition_penalty, seed)
    manifest, eng, profiler = _open(out_dir, engine, accuracy_level, profile)
    gen_cfg = generation_config(out_dir)
    tok = None
    if prompt is not None:
        tok = load_tokenizer(out_dir)
        ids = encode_prompt(tok, prompt, raw=raw)
    else:
        ids = _parse_ids(prompt_ids or "")
        vocab = manifest.model.vocab_size
        if any(i < 0 or i >= vocab for i in ids):
            raise RuntimeUserError(f"--prompt-ids must be in [0, {vocab})")
        if (Path(out_dir) / "tokenizer.json").is_file():
            tok = load_tokenizer(out_dir)
    decode = (lambda t: tok.decode(t, skip_special_tokens=True)) if tok is not None else None
    stream = sys.stderr if as_json else sys.stdout

    def on_text(piece: str) -> None:
        stream.write(piece)
        stream.flush()

    result = generate(eng, ids, max_new_tokens=max_new_tokens, sampling=sampling,
                      eos_ids=eos_ids(manifest, gen_cfg, tok), stop_strings=stop,
                      decode=decode, on_text=on_text, prefill_chunk=prefill_chunk,
                      context_length=manifest.model.context_length,
                      device_sampling=True if device_sampling else None)
    stream.write("\n")
    if as_json:
        out = {"tokens": result.tokens, "text": result.text, "pp": result.pp, "tg": result.tg,
               "prompt_tokens": result.prompt_tokens, "stop_reason": result.stop_reason,
               "engine": result.engine}
        if profiler is not None:
            out["profile"] = profiler.by_op()
        click.echo(json.dumps(out))
    else:
        click.echo(f"[{result.engine['engine']}] prompt {result.prompt_tokens} tok, "
                   f"pp {result.pp:.1f} tok/s, tg {result.tg:.1f} tok/s, "
                   f"stop: {result.stop_reason}", err=True)
    if profiler is not None and not as_json:
        click.echo(profiler.table(), err=True)


@click.command("chat")
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("-n", "--max-new-tokens", type=click.IntRange(1), default=256, show_default=True)
@_sampling_options
@_ENGINE
@_ACC
@click.option("--system", default=None, help="system prompt")
def chat(out_dir: str, max_new_tokens: int, temperature: float, top_k: int, top_p: float,
         repetition_penalty: float, seed: int | None, engine: str, accuracy_level: int,
         system: str | None) -> None:
    """Interactive chat with OUT_DIR (history kept; /reset clears it, /quit or Ctrl-D ends)."""
    from fuselm.runtime_metal.generate import generate
    from fuselm.runtime_metal.tokenizer import (
        encode_prompt,
        eos_ids,
        generation_config,
        load_tokenizer,
    )

    sampling = _sampling(temperature, top_k, top_p, repetition_penalty, seed)
    manifest, eng, _ = _open(out_dir, engine, accuracy_level)
    tok = load_tokenizer(out_dir)
    eos = eos_ids(manifest, generation_config(out_dir), tok)
    history: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    while True:
        try:
            line = input(">>> ")
        except EOFError:
            click.echo()
            return
        if line.strip() in ("/quit", "/exit"):
            return
        if line.strip() == "/reset":
            history = history[:1] if system else []
            continue
        ids = encode_prompt(tok, line, history=history)

        def on_text(piece: str) -> None:
            sys.stdout.write(piece)
            sys.stdout.flush()

        # The whole conversation is re-encoded each turn (templates may rewrite earlier
        # turns), so the cache restarts; simple and always right.
        result = generate(eng, ids, max_new_tokens=max_new_tokens, sampling=sampling,
                          eos_ids=eos, decode=lambda t: tok.decode(t, skip_special_tokens=True),
                          on_text=on_text, context_length=manifest.model.context_length)
        sys.stdout.write("\n")
        history += [{"role": "user", "content": line},
                    {"role": "assistant", "content": result.text}]


@click.command("validate")
@click.argument("model_dir", type=click.Path(file_okay=False))
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("-n", "--tokens", type=click.IntRange(1), default=32, show_default=True,
              help="greedy tokens compared per prompt")
@click.option("--prompt", "prompts", multiple=True, help="text prompt (repeatable)")
@click.option("--engine", "engines", multiple=True, type=click.Choice(["onnxruntime", "mlx"]),
              help="rungs to run (default both)")
@_CHUNK
@click.option("--text", "ppl_text", type=click.Path(dir_okay=False), default=None,
              help="PPL of each rung on this text (default: the bundled English prose)")
@click.option("--context", "ppl_context", type=click.IntRange(4), default=256,
              show_default=True, help="PPL chunk size (see `fuselm perplexity --help`)")
@click.option("--no-ppl", is_flag=True, help="skip the PPL of each rung")
@click.option("--json", "as_json", is_flag=True)
def validate(model_dir: str, out_dir: str, tokens: int, prompts: tuple[str, ...],
             engines: tuple[str, ...], prefill_chunk: int, ppl_text: str | None,
             ppl_context: int, no_ppl: bool, as_json: bool) -> None:
    """Check a conversion: HF transformers -> onnxruntime -> MLX on a few prompts."""
    from fuselm.runtime_metal.artifact import read_manifest
    from fuselm.runtime_metal.tokenizer import load_tokenizer
    from fuselm.runtime_metal.validate import validate as run_ladder

    manifest = read_manifest(out_dir)
    if not Path(model_dir, "config.json").is_file():
        raise RuntimeUserError(f"{model_dir} has no config.json; pass the HF model folder")
    texts = list(prompts) or ["Hello world, the quick brown fox", "Rotary embeddings rotate"]
    ppl_tokens = None
    try:
        tok = load_tokenizer(out_dir)
        ids = [tok.encode(t) for t in texts]
        if not no_ppl:
            from fuselm.runtime_metal.perplexity import SAMPLE_TEXT, read_text, text_tokens

            ppl_tokens = text_tokens(tok, read_text(ppl_text or SAMPLE_TEXT))
    except RuntimeUserError:  # no tokenizer: fixed id prompts spread over the vocabulary
        v = manifest.model.vocab_size
        ids = [[(7 * i + 3) % v for i in range(12)], [(13 * i + 5) % v for i in range(20)]]
    report = run_ladder(model_dir, out_dir, ids, tokens, prefill_chunk,
                        tuple(engines) or ("onnxruntime", "mlx"), ppl_tokens, ppl_context)
    if as_json:
        click.echo(json.dumps(report.to_dict()))
        return
    click.echo(f"{'rung':<14}{'rel vs above':>14}{'rel vs HF':>12}{'greedy = HF':>14}")
    for r in report.rungs[1:]:
        click.echo(f"{r.name:<14}{max(r.logits_rel):>14.2e}{max(r.logits_rel_hf):>12.2e}"
                   f"{min(r.greedy_agree):>9}/{tokens}")
    for r in report.rungs:
        if r.perplexity:
            p = r.perplexity
            click.echo(f"PPL {r.name:<14}{p['ppl']:.4f} ± {p['ppl_stderr']:.4f} "
                       f"(context {p['context']}, {p['scored_tokens']} tokens scored)")
