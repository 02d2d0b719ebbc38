"""Options several commands share in the spellings users know from mlx-lm and llama.cpp."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import click

from fuselm.config import RuntimeConfig, resolve
from fuselm.runtime_metal.errors import RuntimeUserError

MODEL_HELP = ("the model: an artifact folder, or a .gguf file or HF checkpoint folder "
              "(converted once into the cache; the folder is printed)")


def model_argument(f: Callable[..., Any]) -> Callable[..., Any]:
    """MODEL as a positional argument or as `-m/--model` (mlx-lm / llama.cpp spelling): an
    artifact folder, a GGUF file or an HF folder (converter/model_path.py resolves it)."""
    f = click.option("-m", "--model", "model_opt", default=None, metavar="MODEL",
                     type=click.Path(), help=f"{MODEL_HELP}; same as the MODEL argument")(f)
    f = click.argument("out_dir", metavar="MODEL", required=False, type=click.Path())(f)

    @functools.wraps(f)
    def wrapper(*args: Any, out_dir: str | None = None, model_opt: str | None = None,
                **kwargs: Any) -> Any:
        if (out_dir is None) == (model_opt is None):
            raise click.UsageError("give the model once: MODEL or -m/--model")
        given = out_dir if out_dir is not None else model_opt
        assert given is not None
        if not given.strip():  # `fuselm bench ""`: an empty path names no model
            raise click.UsageError("MODEL is empty; give an artifact folder, a .gguf file or "
                                   "an HF folder")
        from fuselm.converter.model_path import resolve_model

        return f(*args, out_dir=str(resolve_model(given)), **kwargs)

    return wrapper


# onnxruntime's intra-op pool spins its threads: more of them than the host has logical CPUs
# only slows it down, and 100,000 of them never finish starting.
MAX_THREADS = os.cpu_count() or 1


def threads_option(f: Callable[..., Any]) -> Callable[..., Any]:
    """-t/--threads (llama.cpp's spelling): onnxruntime's intra-op threads."""
    return click.option("-t", "--threads", type=click.IntRange(1, MAX_THREADS), default=None,
                        help="onnxruntime: intra-op threads, at most the logical CPUs "
                        f"({MAX_THREADS} here)  [default: one per physical core]")(f)


# onnxruntime's default: int8 activations for the Q4 matmuls (MatMulNBits' fast path)
DEFAULT_ACCURACY_LEVEL = 4


def accuracy_option(f: Callable[..., Any]) -> Callable[..., Any]:
    """--accuracy-level: onnxruntime's Q4 activation precision (None when not given, so that
    the MLX engine can refuse it by name)."""
    return click.option("--accuracy-level", type=click.IntRange(0, 4), default=None,
                        help="onnxruntime Q4 activation precision: 4 = int8 (fast), 0 = float "
                        f"(exact)  [default: {DEFAULT_ACCURACY_LEVEL}]")(f)


def ort_options(engine_name: str, accuracy_level: int | None, threads: int | None,
                exact_rows: bool | None = None, drafting: bool = False) -> dict[str, object]:
    """The engine options the shared flags give: accuracy level, threads and
    --exact-rows/--no-exact-rows for onnxruntime (neither: on with a drafter, `drafting`,
    drafting.py speculative_engine_options), none for MLX (which schedules its own work and
    computes in float; --accuracy-level, --threads or --[no-]exact-rows there is a mistake,
    said so)."""
    from fuselm.runtime_metal.drafting import speculative_engine_options

    if engine_name != "onnxruntime":
        for flag, what, given in (("--accuracy-level", "Q4 activation precision",
                                   accuracy_level is not None),
                                  ("--threads", "threads", threads is not None),
                                  ("--exact-rows" if exact_rows else "--no-exact-rows",
                                   "attention rows", exact_rows is not None)):
            if given:
                raise RuntimeUserError(f"{flag} sets onnxruntime's {what}; the MLX engine takes "
                                       "none (drop it, or add --engine onnxruntime)")
        return {}
    level = DEFAULT_ACCURACY_LEVEL if accuracy_level is None else accuracy_level
    options = {"accuracy_level": level, **({"threads": threads} if threads else {}),
               **({"exact_rows": exact_rows} if exact_rows is not None else {})}
    return speculative_engine_options(engine_name, options, drafting)


def kv_cache_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """--kv-bits / --kv-group-size (mlx-lm's spellings): the MLX engine's KV cache stored
    quantized (runtime_metal/kv_cache.py KVQuant)."""
    f = click.option("--kv-group-size", type=click.Choice(["32", "64", "128"]), default=None,
                     help="values per scale and bias of a quantized KV cache  [default: 64]")(f)
    return click.option("--kv-bits", type=click.Choice(["4", "8"]), default=None,
                        help="MLX: keep the KV cache quantized to 8 or 4 bits (about 0.53 / "
                        "0.28 of float16's memory)  [default: the activation dtype]")(f)


def kv_options(engine_name: str, kv_bits: str | None, kv_group_size: str | None
               ) -> dict[str, object]:
    """The engine options --kv-bits / --kv-group-size give (none when neither is given); for
    onnxruntime a refusal (make_engine's), before anything loads. The MLX engine refuses a
    group size without bits or one that does not divide the head dim."""
    from fuselm.runtime_metal.engine import check_kv_options

    out: dict[str, object] = {}
    if kv_bits is not None:
        out["kv_bits"] = int(kv_bits)
    if kv_group_size is not None:
        out["kv_group_size"] = int(kv_group_size)
    check_kv_options(engine_name, out)
    return out


def verbose_option(f: Callable[..., Any]) -> Callable[..., Any]:
    """--verbose: the resolved runtime configuration on stderr, each value with its source."""
    return click.option("--verbose", is_flag=True,
                        help="print the runtime settings in use and where each came from "
                        "(default, environment, option)")(f)


def runtime_config(verbose: bool = False, **options: object) -> RuntimeConfig:
    """The runtime configuration for this command: the environment, and the CLI options
    (engine, threads) the user typed; an option left at its default is not an option's
    value. Printed to stderr with --verbose."""
    ctx = click.get_current_context()
    typed = {k: v for k, v in options.items()
             if ctx.get_parameter_source(k) != click.core.ParameterSource.DEFAULT}
    config = resolve(**typed)
    if verbose:
        click.echo("runtime configuration:", err=True)
        for line in config.lines():
            click.echo(f"  {line}", err=True)
    return config


def parallel_option(f: Callable[..., Any]) -> Callable[..., Any]:
    """--parallel: one model over the ranks mlx.launch started (MLX engine)."""
    return click.option(
        "--parallel", type=click.Choice(["tensor", "pipeline"]), default=None,
        help="run over the processes `mlx.launch -n N --backend ring|jaccl|nccl -- fuselm ...` "
        "started, each holding its share of the weights: tensor (heads and MLP columns split, "
        "one all-reduce after o_proj / down_proj) or pipeline (contiguous layer ranges); MLX "
        "engine; rank 0 prints")(f)


def join_parallel(parallel: str | None) -> dict[str, object]:
    """The engine option --parallel gives; joins the process group first and silences stdout
    on ranks other than 0."""
    if not parallel:
        return {}
    from fuselm.runtime_metal.parallel import join, quiet_followers

    quiet_followers(join(parallel))
    return {"parallel": parallel}


def draft_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """Speculative decoding (runtime_metal/drafting.py): --draft-lookup (llama.cpp's lookup
    decoding, HF's prompt lookup) or --draft OUT_DIR (a smaller artifact of the same
    tokenizer), --num-draft N (llama.cpp's --draft-max), --draft-ngram N, and
    --exact-rows/--no-exact-rows (onnxruntime's exact_rows engine option: ort_engine/engine.py;
    neither: on when drafting)."""
    for opt in reversed([
        click.option("--draft-lookup", is_flag=True,
                     help="speculative decoding, drafts from the prompt and the reply so far "
                     "(n-gram lookup; no second model); greedy requests only"),
        click.option("--draft", "draft", default=None, metavar="OUT_DIR", type=click.Path(),
                     help="speculative decoding with a smaller fuselm artifact of the same "
                     "tokenizer as the draft model; greedy requests only"),
        click.option("--num-draft", "--draft-max", "num_draft", type=click.IntRange(1, 64),
                     default=None, help="most tokens drafted a step  [default: 8]"),
        click.option("--draft-ngram", type=click.IntRange(1, 16), default=None,
                     help="--draft-lookup: longest n-gram matched  [default: 3]"),
        click.option("--exact-rows/--no-exact-rows", default=None,
                     help="onnxruntime: every step computes each position as a one-token step "
                     "does (one more attention row a step), so a drafted reply is one fixed "
                     "greedy decoding whatever was drafted, the one plain decoding gives with "
                     "--exact-rows; on with --draft-lookup/--draft (it costs their steps "
                     "nothing; serve: with --max-batch 1 only, as rows then decode one after "
                     "another, not batched), off for plain decoding (+10% to +30% a decode "
                     "step)  [default: on when drafting]"),
    ]):
        f = opt(f)
    return f


def refuse_parallel_draft(parallel: str | None, draft: str | None, draft_lookup: bool) -> None:
    """--parallel with speculative decoding: refused by name (the ranks would each need the
    drafter, in step with rank 0's; not built)."""
    if parallel and (draft or draft_lookup):
        from fuselm.runtime_metal.errors import RuntimeUserError

        flag = "--draft" if draft else "--draft-lookup"
        raise RuntimeUserError(f"--parallel and {flag} do not go together: speculative "
                               "decoding runs on one process only")
