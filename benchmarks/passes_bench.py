"""Graph-pass figures for the Qwen3-0.6B shape: nodes per layer before -> after each pass.

    .venv/bin/python benchmarks/passes_bench.py [--work DIR] [--layers 28] [--json OUT]

- ours: the project exporter's raw graph of a random bf16 checkpoint with Qwen3-0.6B's shapes
  (converter.builtin.QWEN3_0_6B), 28 layers;
- foreign: torch.onnx TorchScript export of the HF model itself. At full depth that export is
  slow and large, so it is measured on 2- and 4-layer models with 0.6B layer shapes (a stand-in:
  per-layer figures are exact, totals are not).

Nodes per layer are *marginal*: (nodes(L2) - nodes(L1)) / (L2 - L1) for two depths, so the
shared mask/embedding/head nodes do not count. Pipeline wall time and peak RSS are measured in
a fresh process that loads the 28-layer model (weights included) and runs the pipeline on it;
`pipeline_lazy` is the convert's own path: loaded without its weights, pipeline, then the
streaming writer (passes/writer.py) writes model.onnx + model.onnx.data.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "passes"))  # passes_foreign: the foreign exporter

FUSED = ("FusedQKV", "FusedGateUp", "FusedRoPE", "Attention", "RMSNormalization")


def _per_layer(small: list[tuple[str, int]], big: list[tuple[str, int]], dl: int) -> list:
    return [{"after": a[0], "nodes_per_layer": round((b[1] - a[1]) / dl, 2),
             "nodes_total_small": a[1], "nodes_total_big": b[1]}
            for a, b in zip(small, big, strict=True)]


def _build(work: Path, name: str, layers: int, dtype: str) -> Path:
    from fuselm.converter.models.builtin import QWEN3_0_6B, build_model

    d = work / name
    if not (d / "config.json").exists():
        build_model(d, "qwen3", dtype=dtype, tokenizer=False, **{**QWEN3_0_6B,
                                                                 "num_hidden_layers": layers})
    return d


def _ours(work: Path, layers: int) -> Path:
    from fuselm.export.onnx_export import export_model

    path = work / f"ours_L{layers}" / "raw.onnx"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        export_model(_build(work, f"ckpt_L{layers}", layers, "bfloat16"), path)
    return path


def _foreign(work: Path, layers: int) -> Path:
    from passes_foreign import export_foreign

    path = work / f"ts_L{layers}" / "model.onnx"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        export_foreign(_build(work, f"ckpt_L{layers}", layers, "bfloat16"), path,
                       dynamo=False, opset=17, with_cache=True)
    return path


def measure_pipeline(path: Path, lazy: bool = False) -> dict:
    """In this process: load (with weights unless lazy), run the pipeline (lazy: and write the
    result); nodes after each pass, time, RSS."""
    from collections import Counter

    import onnx

    from fuselm.passes.manager import run_pipeline

    t0 = time.perf_counter()
    model = onnx.load(str(path), load_external_data=not lazy)
    t1 = time.perf_counter()
    deferred: dict | None = {} if lazy else None
    out, report = run_pipeline(model, base_dir=path.parent if lazy else None, deferred=deferred)
    t2 = time.perf_counter()
    extra = {}
    if lazy:
        from fuselm.passes.writer import write_model

        with tempfile.TemporaryDirectory() as d:
            write_model(out, Path(d) / "model.onnx", base_dir=path.parent, deferred=deferred)
        extra["write_s"] = round(time.perf_counter() - t2, 2)
    steps = [("raw", report.entries[0].nodes_before)]
    steps += [(e.name, e.nodes_after) for e in report.entries]
    return {"load_s": round(t1 - t0, 2), "pipeline_s": round(t2 - t1, 2), **extra,
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            "per_pass_s": [(e.name, e.seconds) for e in report.entries],
            "steps": steps, "final_counts": dict(Counter(n.op_type for n in out.graph.node))}


def _measure(path: Path, lazy: bool = False) -> dict:
    """measure_pipeline in a fresh process, so peak RSS is the pipeline's own."""
    flag = ["--lazy"] if lazy else []
    proc = subprocess.run([sys.executable, __file__, "--measure", str(path), *flag],
                          capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--measure", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--lazy", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure:
        print(json.dumps(measure_pipeline(args.measure, args.lazy)))
        return
    work = args.work or Path(tempfile.mkdtemp(prefix="fuselm-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    result: dict = {"shape": "Qwen3-0.6B (random bf16 weights)", "layers": args.layers}

    small, big = _measure(_ours(work, 2)), _measure(_ours(work, args.layers))
    final = big.pop("final_counts")
    result["ours"] = {
        "per_pass": _per_layer(small["steps"], big.pop("steps"), args.layers - 2),
        "fused_ops_per_layer": {k: final.get(k, 0) / args.layers for k in FUSED},
        "final_op_counts": final,
        "pipeline": big,
        "pipeline_lazy": {k: v for k, v in _measure(_ours(work, args.layers), lazy=True).items()
                          if k in ("load_s", "pipeline_s", "write_s", "peak_rss_mb")},
    }
    small, big = _measure(_foreign(work, 2)), _measure(_foreign(work, 4))
    final = big.pop("final_counts")
    result["foreign_torchscript"] = {
        "note": "2- and 4-layer models with 0.6B layer shapes (full-depth export is too slow)",
        "per_pass": _per_layer(small["steps"], big.pop("steps"), 2),
        "fused_ops_per_layer": {k: final.get(k, 0) / 4 for k in FUSED},
        "final_op_counts": final,
        "pipeline_L4": big,
    }
    text = json.dumps(result, indent=2)
    if args.json:
        args.json.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
