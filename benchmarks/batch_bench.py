"""Batched decode throughput (runtime_metal/batch.py) against the single-sequence step, one
JSON: the single sequence's decode (generate's pipelined loop, what `fuselm bench` reports as
tg) and, for each batch size b, the batched step's time, tokens/s over all sequences and per
sequence, its time over the single step's and its total throughput over one row's.

    python benchmarks/batch_bench.py [--shape small|qwen3-0.6b] [--dtype float16] [-b 1 4 8 16]

Single: one prompt of -p tokens, -n new tokens (greedy), a warm-up run, the median of -r runs.
Times are wall clock; each b also reports the process's CPU time a step (`step_cpu_ms`), the
steadier figure on a shared CPU host where MLX's CPU backend is the device, and the calling
thread's (`step_host_ms`; `single_host_ms` for the single sequence, its prefill included): the
host's work a step — the decoder's Python, the compiled call, MLX's dispatch of the graph —
which bounds the step where the device is faster than the host.
Each b: b prompts of -p tokens (random ids) added, one warm-up round of -n steps, then -n
timed steps (every slot decoding); the median of -r rounds. Uses the converted checkpoint of
benchmarks/long_prompt.py (same --work).

--profile (NVIDIA): each b's steps once more under PyTorch's profiler with CUDA activity
(CUPTI records MLX's kernels): the device time a step by kernel name, the kernels a step and
the time covered by at least one kernel, so a batch's extra cost is attributed to the kernels
that grow with its rows.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from long_prompt import SHAPES, artifact  # noqa: E402

from fuselm.runtime_metal.batch import BatchDecoder  # noqa: E402
from fuselm.runtime_metal.engine import make_engine  # noqa: E402
from fuselm.runtime_metal.generate import generate  # noqa: E402


def single_step_ms(engine, prompt: list[int], n: int, runs: int  # noqa: ANN001
                   ) -> tuple[float, float]:
    """The single sequence's decode time per token and the calling thread's CPU time per
    token over the whole generation (medians of `runs`, after a warm-up)."""
    times, host = [], []
    for r in range(runs + 1):
        c0 = time.thread_time()
        res = generate(engine, prompt, max_new_tokens=n)
        if r:
            times.append(1e3 / res.tg)
            host.append((time.thread_time() - c0) / n * 1e3)
    return statistics.median(times), statistics.median(host)


def profile_steps(dec: BatchDecoder, n: int) -> dict[str, object]:
    """n more steps of `dec` under the CUDA profiler: device time a step by kernel name."""
    from step_profile import busy_union, per_kernel, trace_kernels
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            dec.step()
        mx.synchronize()
    kernels = trace_kernels(prof)
    top = sorted(per_kernel(kernels, 90).items(), key=lambda kv: -sum(kv[1]))[:15]
    return {"kernels_per_step": len(kernels) / n,
            "kernel_sum_ms_per_step": sum(e["dur"] for e in kernels) / 1e3 / n,
            "busy_ms_per_step": busy_union(kernels) / 1e3 / n,
            "top": [{"name": k, "count_per_step": len(v) / n, "us_per_step": sum(v) / n}
                    for k, v in top]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="small")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("-b", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("-p", type=int, default=128)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("-r", type=int, default=3)
    ap.add_argument("--work", type=Path, default=Path("/tmp/fuselm_long_prompt"))
    ap.add_argument("--artifact", type=Path,
                    help="a converted artifact to run instead of --shape's (e.g. side_by_side's "
                    "Q4 conversion)")
    ap.add_argument("--max-context", type=int, default=0,
                    help="the decoder's context (default: what the rounds need)")
    ap.add_argument("--profile", action="store_true",
                    help="also each b's kernel time a step by kernel name (needs torch + CUDA)")
    args = ap.parse_args()
    out_dir = args.artifact or artifact(args.work, args.shape, args.dtype, args.p + args.n)
    engine = make_engine(out_dir, "mlx")
    rng = np.random.default_rng(0)
    vocab = engine.manifest.model.vocab_size
    single, single_host = single_step_ms(
        engine, [int(t) for t in rng.integers(4, min(1000, vocab), args.p)], args.n, args.r)
    rows = []
    for b in args.b:
        dec = BatchDecoder(engine, max_batch=b,
                           max_context=args.max_context or args.p + (args.r + 1) * args.n + 8)
        for _ in range(b):
            dec.add([int(t) for t in rng.integers(4, min(1000, vocab), args.p)])
        dec.step()  # the first tokens (from the prompts)
        times, cpu, host = [], [], []
        for r in range(args.r + 1):
            t0, c0, h0 = time.perf_counter(), time.process_time(), time.thread_time()
            for _ in range(args.n):
                dec.step()
            if r:
                times.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
                host.append(time.thread_time() - h0)
        t = statistics.median(times)
        prof = profile_steps(dec, args.n) if args.profile else None
        rows.append({"batch": b, "mode": dec.mode, "step_ms": t / args.n * 1e3,
                     "tok_s_total": b * args.n / t, "tok_s_per_seq": args.n / t,
                     "step_over_single": t / args.n * 1e3 / single,
                     "step_cpu_ms": statistics.median(cpu) / args.n * 1e3,
                     "step_host_ms": statistics.median(host) / args.n * 1e3,
                     **({"profile": prof} if prof else {})})
    one = next((r["tok_s_total"] for r in rows if r["batch"] == 1), None)
    for r in rows:
        r["throughput_over_one_row"] = r["tok_s_total"] / one if one else None
    print(json.dumps({"device": str(mx.default_device()), "host": platform.node(),
                      "shape": str(args.artifact or args.shape), "dtype": args.dtype,
                      "engine": engine.describe(), "prompt": args.p,
                      "steps": args.n, "single_step_ms": single,
                      "single_host_ms": single_host, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
