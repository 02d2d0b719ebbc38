"""Q4 side by side on this machine: fuselm `convert --quant q4` vs onnxruntime-genai's builder.

    PYTHONPATH=. .venv/bin/python benchmarks/quant_bench.py [--shape qwen3-0.6b|tiny] [--work DIR]
        [--layers 8] [--rounds 3] [--reuse]

One random-weight checkpoint (Qwen3-0.6B's shapes, bf16; `--layers` overrides the depth) is
converted twice, default against default:
  fuselm:  converter.pipeline.convert(quant="q4", dtype float16): its defaults (LM head and the
           tied table quantized, error-minimizing search, the built-in calibration text's
           importance and a 4.45 bits budget: block 32 or 64 per tensor); `--block-size` forces
           one block size on every tensor
  builder: python -m onnxruntime_genai.models.builder -p int4 -e cpu  (int4 LM head, int8 act.)
and both run the same prompt: prefill (`-p` tokens) then greedy decode (`-n` tokens).
fuselm's model runs through its onnxruntime engine at the engine's defaults (accuracy level 4 =
int8 activations, what the builder's int4 CPU model uses; the CPU lowering of
runtime_metal/ort_engine/lowering.py, or the plain graph with `--no-lower`; intra-op threads
ort_session.default_threads()); the builder's through onnxruntime-genai (its default threads:
hardware threads / 2). Decode is n new tokens: n - 1 forward passes after the prompt's, on
both sides. Each side runs in its own process; `--rounds` alternates the two (fuselm,
builder, fuselm, ...), each round the median of `-r` runs after one warm-up; the report gives
the median over rounds and the spread (min, max), since other jobs may share the CPU. JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def _child(code: str, env_extra: dict[str, str] | None = None) -> dict[str, Any]:
    """Run Python `code` in a child; its wall time and peak RSS (the child's own)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env_extra or {})}
    wrapper = (
        "import resource, time, json, sys\n"
        "t0 = time.perf_counter()\n"
        f"{code}\n"
        "ru = resource.getrusage(resource.RUSAGE_SELF)\n"
        "print('@@' + json.dumps({'seconds': time.perf_counter() - t0, "
        "'cpu_seconds': ru.ru_utime + ru.ru_stime, "  # wall time lies on a shared CPU
        "'peak_rss_mb': ru.ru_maxrss / 1024, "
        "**globals().get('EXTRA', {})}))\n"
    )
    out = subprocess.run([sys.executable, "-c", wrapper], env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    line = next(x for x in out.stdout.splitlines()[::-1] if x.startswith("@@"))
    return json.loads(line[2:])


def _dir_mb(path: Path, suffixes: tuple[str, ...] = (".onnx", ".data")) -> float:
    return sum(p.stat().st_size for p in path.iterdir() if p.name.endswith(suffixes)) / 2**20


def build_checkpoint(work: Path, shape: str, layers: int | None = None) -> Path:
    ckpt = work / "ckpt"
    if (ckpt / "config.json").exists():
        return ckpt
    # tiny: head_dim 32, as onnxruntime's GroupQueryAttention needs a multiple of 16.
    overrides = "QWEN3_0_6B" if shape == "qwen3-0.6b" else "{'head_dim': 32}"
    if layers is not None:
        overrides = f"{{**{overrides}, 'num_hidden_layers': {layers}}}"
    _child(
        "from fuselm.converter.models.builtin import build_model, QWEN3_0_6B\n"
        f"build_model({str(ckpt)!r}, 'qwen3', dtype='bfloat16', **{overrides})"
    )
    return ckpt


def convert_fuselm(ckpt: Path, out: Path, block: int | None) -> dict[str, Any]:
    res = _child(
        "from fuselm.converter.pipeline import convert, ConvertOptions\n"
        f"r = convert({str(ckpt)!r}, {str(out)!r}, ConvertOptions.from_flags(dtype='float16', "
        f"quant='q4', block_size={block}))\n"
        "q = [e for e in r.report.entries if e.name == 'quantize_q4'][0]\n"
        "EXTRA = {'quantize_seconds': q.seconds, 'quantization': q.extra['quantization'],\n"
        "         'stage_seconds': r.seconds}\n"
    )
    info = res.pop("quantization")
    linear = [t for t in info["tensors"] if t["role"] != "embedding"]
    res["bits_per_linear_weight"] = info["bits_per_weight"]
    res["bits_per_weight_overall"] = info.get("bits_per_weight_overall")
    res["lm_head_q4"] = info.get("lm_head")
    res["quantized_tensors"] = len(linear)
    res["tied"] = info["tied"]
    res["artifact_mb"] = round(_dir_mb(out), 1)
    return res


def convert_builder(ckpt: Path, out: Path) -> dict[str, Any]:
    cache = out.parent / "builder_cache"
    res = _child(
        "import runpy, sys\n"
        f"sys.argv = ['builder', '-i', {str(ckpt)!r}, '-o', {str(out)!r}, '-p', 'int4', "
        f"'-e', 'cpu', '-c', {str(cache)!r}]\n"
        "runpy.run_module('onnxruntime_genai.models.builder', run_name='__main__')\n"
    )
    res["artifact_mb"] = round(_dir_mb(out), 1)
    return res


def _timed_runs(fn: Any, runs: int) -> list[tuple[float, float]]:
    fn()  # warm-up
    return [fn() for _ in range(runs)]


def bench_fuselm(
    out: Path, prompt: np.ndarray, n_new: int, runs: int, threads: int | None = None,
    lower: bool = True,
) -> dict[str, Any]:
    """fuselm's onnxruntime engine as `fuselm run` drives it: its defaults (accuracy level 4,
    the CPU lowering unless `lower` is False), the cache reserved for the whole generation."""
    from fuselm.runtime_metal.engine import make_engine

    engine = make_engine(out, "onnxruntime", threads=threads, lower=lower)

    def once() -> tuple[float, float]:
        engine.reset()
        engine.reserve(len(prompt) + n_new)
        t0 = time.perf_counter()
        nxt = int(np.argmax(engine.forward(prompt[None, :])))
        prefill_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        # n_new tokens take n_new - 1 forward passes after the prompt's (the first token comes
        # from the prompt's logits), as onnxruntime-genai's n_new generate_next_token calls do.
        for _ in range(n_new - 1):
            nxt = int(np.argmax(engine.decode_step(nxt)))
        return prefill_s, time.perf_counter() - t0

    times = _timed_runs(once, runs)
    return {**_rates(times, len(prompt), n_new), "engine": engine.describe()}


def _with_threads(out: Path, threads: int) -> Path:
    """A view of the builder's folder whose genai_config sets onnxruntime's intra-op threads."""
    view = out.parent / f"{out.name}_t{threads}"
    view.mkdir(exist_ok=True)
    for f in out.iterdir():
        if f.name != "genai_config.json" and not (view / f.name).exists():
            (view / f.name).symlink_to(f)
    cfg = json.loads((out / "genai_config.json").read_text())
    cfg["model"]["decoder"]["session_options"]["intra_op_num_threads"] = threads
    (view / "genai_config.json").write_text(json.dumps(cfg))
    return view


def bench_builder(
    out: Path, prompt: np.ndarray, n_new: int, runs: int, threads: int | None = None
) -> dict[str, Any]:
    import onnxruntime_genai as og

    model = og.Model(str(out if threads is None else _with_threads(out, threads)))

    def once() -> tuple[float, float]:
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(prompt) + n_new, do_sample=False)
        gen = og.Generator(model, params)
        t0 = time.perf_counter()
        gen.append_tokens(prompt[None, :].astype(np.int32))
        prefill_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(n_new):  # the first call samples the prompt's logits: no forward pass
            gen.generate_next_token()
        return prefill_s, time.perf_counter() - t0

    times = _timed_runs(once, runs)
    # onnxruntime-genai's default intra-op threads: hardware threads / 2 (at least 1, at most 16)
    default = min(max(1, (os.cpu_count() or 1) // 2), 16)
    return {**_rates(times, len(prompt), n_new), "version": og.__version__,
            "threads": threads or default}


def _rates(times: list[tuple[float, float]], n_prompt: int, n_new: int) -> dict[str, float]:
    pre = statistics.median(t[0] for t in times)
    dec = statistics.median(t[1] for t in times)
    return {"prefill_tok_s": round(n_prompt / pre, 1), "decode_tok_s": round(n_new / dec, 1)}


def _bench_child(kind: str, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Each engine runs in its own process, so one's memory and threads do not touch the other."""
    extra = ", lower=False" if kind == "fuselm" and args.no_lower else ""
    code = (
        "import numpy as np\n"
        "from benchmarks.quant_bench import bench_fuselm, bench_builder\n"
        f"prompt = np.random.default_rng(0).integers(10, {args.vocab}, {args.prompt})\n"
        f"EXTRA = bench_{kind}(__import__('pathlib').Path({str(out)!r}), prompt, {args.new}, "
        f"{args.runs}, {args.threads}{extra})\n"
    )
    res = _child(code)
    res.pop("seconds", None)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=["qwen3-0.6b", "tiny"], default="qwen3-0.6b")
    ap.add_argument("--work", type=Path, default=None, help="reuse this folder (checkpoint etc.)")
    ap.add_argument("-p", "--prompt", type=int, default=128)
    ap.add_argument("-n", "--new", type=int, default=64)
    ap.add_argument("-r", "--runs", type=int, default=3)
    ap.add_argument("--block-size", type=int, default=None,
                    help="Q4 block size on every tensor (default: the converter's default)")
    ap.add_argument("--layers", type=int, default=None, help="override the depth")
    ap.add_argument("--rounds", type=int, default=1, help="alternating rounds of both sides")
    ap.add_argument("--reuse", action="store_true", help="reuse conversions found in --work")
    ap.add_argument("--threads", type=int, default=None, help="intra-op threads, both sides")
    ap.add_argument("--no-lower", action="store_true",
                    help="fuselm on the plain graph (no CPU lowering), for comparison")
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="quant_bench_"))
    work.mkdir(parents=True, exist_ok=True)
    ckpt = build_checkpoint(work, args.shape, args.layers)
    cfg = json.loads((ckpt / "config.json").read_text())
    args.vocab = min(cfg["vocab_size"], 30000)
    ours, theirs = work / "fuselm_q4", work / "builder_int4"
    report: dict[str, Any] = {
        "checkpoint": {
            "shape": args.shape,
            "layers": cfg["num_hidden_layers"],
            "dtype": "bfloat16",
            "size_mb": round(_dir_mb(ckpt, (".safetensors",)), 1),
        },
        "prompt_tokens": args.prompt,
        "new_tokens": args.new,
        "runs": args.runs,
        "rounds": args.rounds,
        "threads": args.threads or "onnxruntime default",
        "cpu_count": os.cpu_count(),
        "load_average_before": os.getloadavg(),
    }
    import shutil

    done = (ours / "fuselm.json").is_file() and (theirs / "genai_config.json").is_file()
    if not (args.reuse and done):
        shutil.rmtree(ours, ignore_errors=True)
        shutil.rmtree(theirs, ignore_errors=True)
        report["convert"] = {
            "fuselm": convert_fuselm(ckpt, ours, args.block_size),
            "builder": convert_builder(ckpt, theirs),
        }
    rounds: dict[str, list[dict[str, Any]]] = {"fuselm": [], "builder": []}
    for _ in range(args.rounds):  # alternating: a burst of load hits both sides alike
        rounds["fuselm"].append(_bench_child("fuselm", ours, args))
        rounds["builder"].append(_bench_child("builder", theirs, args))
    report["speed"] = {}
    for side, rs in rounds.items():
        report["speed"][side] = {
            **{k: v for k, v in rs[0].items() if k not in ("prefill_tok_s", "decode_tok_s")},
            **{
                key: statistics.median(r[key] for r in rs)
                for key in ("prefill_tok_s", "decode_tok_s", "peak_rss_mb")
            },
            "spread": {
                key: [min(r[key] for r in rs), max(r[key] for r in rs)]
                for key in ("prefill_tok_s", "decode_tok_s")
            },
        }
    f, b = report["speed"]["fuselm"], report["speed"]["builder"]
    report["ratio_fuselm_over_builder"] = {
        "prefill": round(f["prefill_tok_s"] / b["prefill_tok_s"], 2),
        "decode": round(f["decode_tok_s"] / b["decode_tok_s"], 2),
        "per_round": [
            {
                "prefill": round(x["prefill_tok_s"] / y["prefill_tok_s"], 2),
                "decode": round(x["decode_tok_s"] / y["decode_tok_s"], 2),
            }
            for x, y in zip(rounds["fuselm"], rounds["builder"], strict=True)
        ],
    }
    report["load_average_after"] = os.getloadavg()
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
