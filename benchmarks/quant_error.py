"""Weight reconstruction error: the search against plain min/max; prints one JSON object.

    PYTHONPATH=. .venv/bin/python benchmarks/quant_error.py [--hf HF_DIR] [--bits 4|8]

Relative RMS error sqrt(sum (w' - w)^2 / sum w^2), stored exactly as the artifact stores it
(float16 scales, uint4 codes and zero points), per block size: on a heavy-tailed synthetic
tensor (Student-t, df 3, [1024, 3072]) and, with --hf, on every 2-D weight of a real checkpoint
(quantized along the input axis, as the converter does), summed over all of them and per tensor
(median and worst ratio), the search also without its grid steps (`search_nogrid`), and per
kind of weight (the name's last part: q_proj, down_proj, embed_tokens, ...). `--bits 8`: 8-bit
blocks, min/max against min/max + the grid steps (passes/quant/grid_steps.py). Random weights
say nothing about model quality; this measures only how close the stored weights are.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from fuselm.passes.quant.q4_math import quantize_array
from fuselm.passes.quant.q8_math import quantize_wide

BITS = 4  # set by --bits


def _err(w: np.ndarray, block: int, method: str) -> tuple[float, float, float]:
    """(sum of squared errors, sum of squares, seconds) for a [K, N] weight."""
    t0 = time.perf_counter()
    q = (quantize_wide(w, block, grid=method == "search") if BITS == 8
         else quantize_array(w, block, method=method.removesuffix("_nogrid"),
                             grid=method == "search"))
    dt = time.perf_counter() - t0
    ssw = float(np.vdot(w, w))
    return (q.rel_rms_error or 0.0) ** 2 * ssw, ssw, dt


def synthetic(block: int) -> dict[str, Any]:
    w = (np.random.default_rng(0).standard_t(3, (1024, 3072)) * 0.02).astype(np.float32)
    out = {}
    for method in ("minmax", "search"):
        sse, ssw, dt = _err(w, block, method)
        out[method] = {"rel_rms": round(float(np.sqrt(sse / ssw)), 5), "seconds": round(dt, 3)}
    out["ratio"] = round(out["search"]["rel_rms"] / out["minmax"]["rel_rms"], 4)
    return out


def real(hf_dir: Path, block: int) -> dict[str, Any]:
    from safetensors.numpy import load_file

    tensors: dict[str, np.ndarray] = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    methods = ("minmax", "search") if BITS == 8 else ("minmax", "search_nogrid", "search")
    tot = {m: [0.0, 0.0] for m in methods}
    ratios, worst = [], (0.0, "")
    kinds: dict[str, dict[str, list[float]]] = {}
    for name, w in tensors.items():
        if w.ndim != 2:
            continue
        kn = np.ascontiguousarray(w.astype(np.float32).T)  # [out, in] -> [K=in, N=out]
        errs = {}
        for method in methods:
            sse, ssw, _ = _err(kn, block, method)
            tot[method][0] += sse
            tot[method][1] += ssw
            errs[method] = np.sqrt(sse / ssw) if ssw else 0.0
            kind = name.removesuffix(".weight").rsplit(".", 1)[-1]
            acc = kinds.setdefault(kind, {m: [0.0, 0.0] for m in methods})[method]
            acc[0] += sse
            acc[1] += ssw
        r = errs["search"] / errs["minmax"] if errs["minmax"] else 1.0
        ratios.append(r)
        worst = max(worst, (float(errs["search"]), name))
    rel = {m: float(np.sqrt(a / b)) for m, (a, b) in tot.items()}
    return {
        "tensors": len(ratios),
        "rel_rms_minmax": round(rel["minmax"], 5),
        "rel_rms_search": round(rel["search"], 5),
        **({"rel_rms_search_nogrid": round(rel["search_nogrid"], 5)} if BITS == 4 else {}),
        "ratio_overall": round(rel["search"] / rel["minmax"], 4),
        "ratio_per_tensor_median": round(statistics.median(ratios), 4),
        "ratio_per_tensor_worst": round(max(ratios), 4),
        "worst_tensor_search": {"name": worst[1], "rel_rms": round(worst[0], 5)},
        "by_kind": {k: {m: round(float(np.sqrt(a / b)), 6) if b else 0.0
                        for m, (a, b) in v.items()} for k, v in sorted(kinds.items())},
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf", type=Path, default=None)
    ap.add_argument("--bits", type=int, choices=(4, 8), default=4)
    ap.add_argument("--blocks", default="32,64", help="block sizes, comma-separated")
    args = ap.parse_args()
    global BITS
    BITS = args.bits
    report: dict[str, Any] = {"bits": BITS}
    for block in map(int, args.blocks.split(",")):
        report[f"student_t3_block{block}"] = synthetic(block)
        if args.hf:
            report[f"real_block{block}"] = real(args.hf, block)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
