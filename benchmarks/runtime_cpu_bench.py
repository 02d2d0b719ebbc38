"""pp / tg per fuselm engine and for mlx-lm on the same weights, llama-bench style, JSON out.

    python benchmarks/runtime_cpu_bench.py --shape qwen3-0.6b -p 128 -n 32 -r 3 [--quant q4]

Builds (or reuses) a random-weight checkpoint of the given shape, converts it, then runs each
engine: one warm-up, then the median of -r runs. mlx-lm loads the same HF weights (quantized
with its own 4-bit group-32 affine quantizer when --quant q4: same tensors, same format).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from fuselm.converter.models.builtin import QWEN3_0_6B, TINY, build_model
from fuselm.runtime_metal.engine import make_engine
from fuselm.runtime_metal.generate import generate

SHAPES = {"tiny": TINY, "qwen3-0.6b": QWEN3_0_6B}


def _fuselm(out_dir: Path, engine: str, prompt: list[int], n: int, runs: int) -> dict:
    eng = make_engine(out_dir, engine)
    results = [generate(eng, prompt, max_new_tokens=n, prefill_chunk=512)
               for _ in range(runs + 1)][1:]
    return {"pp": statistics.median(r.pp for r in results),
            "tg": statistics.median(r.tg for r in results), "engine": eng.describe()}


def _mlx_lm(hf_dir: Path, prompt: list[int], n: int, runs: int, quant: bool) -> dict:
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    model, _ = load(str(hf_dir))
    if quant:
        import mlx.nn as nn

        nn.quantize(model, group_size=32, bits=4)
    pps, tgs = [], []
    for _ in range(runs + 1):
        t0 = time.perf_counter()
        steps = generate_step(mx.array(prompt), model, max_tokens=n)
        next(steps)
        t1 = time.perf_counter()
        for _ in steps:
            pass
        t2 = time.perf_counter()
        pps.append(len(prompt) / (t1 - t0))
        tgs.append((n - 1) / (t2 - t1))
    return {"pp": statistics.median(pps[1:]), "tg": statistics.median(tgs[1:])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    ap.add_argument("--work", default="/tmp/fuselm_bench")
    ap.add_argument("-p", type=int, default=128)
    ap.add_argument("-n", type=int, default=32)
    ap.add_argument("-r", type=int, default=3)
    ap.add_argument("--quant", choices=["none", "q4"], default="none")
    ap.add_argument("--engines", default="onnxruntime,mlx,mlx-lm")
    args = ap.parse_args()
    work = Path(args.work) / args.shape
    hf = work / "hf"
    if not (hf / "config.json").is_file():
        build_model(hf, "qwen3", **{k: v for k, v in SHAPES[args.shape].items()})
    out = work / f"out_{args.quant}"
    if not (out / "fuselm.json").is_file():
        from fuselm.converter.pipeline import ConvertOptions, convert

        q = args.quant == "q4"
        convert(hf, out, ConvertOptions.from_flags(dtype="float32", quant="q4" if q else None,
                                                   quant_lm_head=q, quant_embeddings=q))
    vocab = json.loads((hf / "config.json").read_text())["vocab_size"]
    prompt = [int(i) for i in np.random.default_rng(0).integers(4, vocab, args.p)]
    report: dict = {"shape": args.shape, "quant": args.quant, "p": args.p, "n": args.n,
                    "r": args.r, "results": {}}
    for name in args.engines.split(","):
        if name == "mlx-lm":
            report["results"][name] = _mlx_lm(hf, prompt, args.n, args.r, args.quant == "q4")
        else:
            report["results"][name] = _fuselm(out, name, prompt, args.n, args.r)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
