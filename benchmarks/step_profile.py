"""Where a decode step's time goes on an NVIDIA GPU: GPU kernel time against wall time per step.

    python benchmarks/step_profile.py --system fuselm --artifact OUT_DIR --hf HF_DIR
    python benchmarks/step_profile.py --system mlx-lm --mlx-dir MLX_DIR --hf HF_DIR

One system per process: prefill -p tokens, decode --warmup steps (traces, compiles), then N
greedy steps timed by wall clock (the pipelined loop of side_by_side.py: step i+1 is queued
before step i is read), then N more steps under PyTorch's profiler with CUDA activity only.
The profiler records through CUPTI every kernel the process launches, MLX's included (graph
nodes one by one), with device start and end times. Per step it reports: kernels, the sum of
kernel durations, the busy time (union of the kernel intervals: overlapping kernels count
once) and the idle share of the span (first kernel start to last kernel end) — the time the
GPU waited for the host. If busy ≈ wall, kernels are the lever; if idle dominates, host-side
work (Python, graph launches, synchronisation) is. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from side_by_side import Fuselm, MlxLm, _prompt  # noqa: E402 - the benchmark's own helpers


def kernel_events(trace: Path) -> list[dict[str, Any]]:
    events = json.loads(trace.read_text())["traceEvents"]
    return sorted((e for e in events if e.get("cat") == "kernel" and "dur" in e),
                  key=lambda e: e["ts"])


def trace_kernels(prof: Any) -> list[dict[str, Any]]:
    """The kernel events a finished torch profiler recorded, in time order."""
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        return kernel_events(trace)


def per_kernel(kernels: list[dict[str, Any]], width: int) -> dict[str, list[float]]:
    """Each kernel name (its first `width` characters)'s durations, µs."""
    out: dict[str, list[float]] = defaultdict(list)
    for e in kernels:
        out[e["name"][:width]].append(e["dur"])
    return out


def busy_union(kernels: list[dict[str, Any]]) -> float:
    """Microseconds covered by at least one kernel."""
    total, end = 0.0, float("-inf")
    for e in kernels:
        s, f = e["ts"], e["ts"] + e["dur"]
        if s >= end:
            total += f - s
            end = f
        elif f > end:
            total += f - end
            end = f
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--system", choices=("fuselm", "mlx-lm"), required=True)
    ap.add_argument("--artifact", type=Path, help="fuselm conversion")
    ap.add_argument("--mlx-dir", type=Path, help="mlx-lm conversion")
    ap.add_argument("--hf", type=Path, required=True, help="the checkpoint (for its vocab)")
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=128, help="steps timed, then steps profiled")
    ap.add_argument("--warmup", type=int, default=16)
    ap.add_argument("-r", type=int, default=3, help="wall-clock repeats")
    ap.add_argument("--wall-only", action="store_true",
                    help="the timed walls and host split only, no profiler run (A/B settings)")
    args = ap.parse_args()

    import mlx.core as mx

    if not args.wall_only:
        import torch

        torch.cuda.init()
    system = Fuselm(args.artifact) if args.system == "fuselm" else MlxLm(args.mlx_dir)
    if isinstance(system, Fuselm):  # one cache capacity throughout: no retrace mid-way
        system.engine.reserve(args.p + args.warmup + (args.r + 1) * args.n + 8)
    token = system.prefill(_prompt(args.hf, args.p))
    y = system.decode(token, args.warmup)
    token = int(y.item())
    walls = []
    for _ in range(args.r):
        mx.synchronize()
        t = time.perf_counter()
        y = system.decode(token, args.n)
        token = int(y.item())
        walls.append((time.perf_counter() - t) * 1e3 / args.n)
    # where the host's time goes, one more timed run: building each step's graph (Python, the
    # compiled function's replay) against mx.async_eval (MLX encoding and launching it); the
    # wall minus both is waiting on the device
    mx.synchronize()
    split = {"build": 0.0, "dispatch": 0.0}
    t = time.perf_counter()
    y = system.decode(token, args.n, split)
    token = int(y.item())
    split_wall = time.perf_counter() - t
    mx.synchronize()
    host = {"build": split["build"] * 1e3 / args.n, "dispatch": split["dispatch"] * 1e3 / args.n,
            "wall": split_wall * 1e3 / args.n}
    if args.wall_only:
        print(json.dumps({"system": args.system, "p": args.p, "steps": args.n,
                          "wall_ms_per_step": statistics.median(walls), "wall_ms_runs": walls,
                          "host_ms_per_step": host}))
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        y = system.decode(token, args.n)
        y.item()
        mx.synchronize()
        prof_wall = (time.perf_counter() - t) * 1e3 / args.n
    kernels = trace_kernels(prof)
    top = sorted(per_kernel(kernels, 80).items(), key=lambda kv: -sum(kv[1]))[:40]
    span = (kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"]) if kernels else 0.0
    busy = busy_union(kernels)
    n = args.n
    print(json.dumps({
        "system": args.system, "p": args.p, "steps": n,
        "wall_ms_per_step": statistics.median(walls), "wall_ms_runs": walls,
        "profiled_wall_ms_per_step": prof_wall,
        "host_ms_per_step": host,
        "kernels_per_step": len(kernels) / n,
        "kernel_sum_ms_per_step": sum(e["dur"] for e in kernels) / 1e3 / n,
        "busy_ms_per_step": busy / 1e3 / n, "span_ms_per_step": span / 1e3 / n,
        "idle_share_of_span": 1 - busy / span if span else None,
        "top_kernels": [{"name": k, "count_per_step": len(v) / n,
                         "us_per_step": sum(v) / n, "us_each_median": statistics.median(v)}
                        for k, v in top]}))


if __name__ == "__main__":
    main()
