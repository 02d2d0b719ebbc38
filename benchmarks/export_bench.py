"""Export cost on a real-size shape: wall time and peak RSS of `fuselm convert --no-optimize`.

Builds (once) a random-weight bf16 checkpoint with Qwen3-0.6B's shapes, then runs the export in
a child process so its peak RSS is measured alone. Prints one JSON object.

    .venv/bin/python benchmarks/export_bench.py [--checkpoint DIR] [--out DIR] [--dtype auto]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import onnx

from fuselm.converter.models.builtin import QWEN3_0_6B, build_model


def ensure_checkpoint(path: Path) -> Path:
    if not (path / "config.json").is_file():
        build_model(path, "qwen3", dtype="bfloat16", tokenizer=False, **QWEN3_0_6B)
    return path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", type=Path, default=Path("/tmp/fuselm-bench/qwen3-0.6b-bf16"))
    ap.add_argument("--out", type=Path, default=Path("/tmp/fuselm-bench/qwen3-0.6b-raw"))
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    ckpt = ensure_checkpoint(args.checkpoint)
    ckpt_bytes = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    cmd = [
        sys.executable,
        "-m",
        "fuselm.converter.cli.main",
        "convert",
        str(ckpt),
        "-o",
        str(args.out),
        "--no-optimize",
        "--quiet",
        "--dtype",
        args.dtype,
    ]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True)
    wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    model = onnx.load(str(args.out / "model.onnx"), load_external_data=False)
    ops = Counter(n.op_type for n in model.graph.node)
    layers = QWEN3_0_6B["num_hidden_layers"]
    print(
        json.dumps(
            {
                "shape": "Qwen3-0.6B (random weights, bf16 checkpoint)",
                "checkpoint_bytes": ckpt_bytes,
                "graph_dtype": json.loads((args.out / "fuselm.json").read_text())["dtype"],
                "export_seconds": round(wall, 1),
                "peak_rss_bytes": peak,
                "peak_rss_over_checkpoint": round(peak / ckpt_bytes, 2),
                "nodes": len(model.graph.node),
                "nodes_per_layer": round(len(model.graph.node) / layers, 2),
                "ops": dict(ops.most_common()),
                "machine": f"{platform.machine()} cores={os.cpu_count()}",
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
