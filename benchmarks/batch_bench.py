"""Batched decode throughput (runtime_metal/batch.py) against the single-sequence step, one
JSON: the single sequence's decode (generate's pipelined loop, what `fuselm bench` reports as
tg) and, for each batch size b, the batched step's time, tokens/s over all sequences and per
sequence, its time over the single step's and its total throughput over one row's.

    python benchmarks/batch_bench.py [--shape small|qwen3-0.6b] [--dtype float16] [-b 1 4 8 16]
        [--artifact DIR] [--kv-bits 4|8] [--sequential] [--graph]

Single: one prompt of -p tokens, -n new tokens (greedy), a warm-up run, the median of -r runs.
Times are wall clock; each b also reports the process's CPU time a step (`step_cpu_ms`), the
steadier figure on a shared CPU host where MLX's CPU backend is the device, and the calling
thread's (`step_host_ms`; `single_host_ms` for the single sequence, its prefill included): the
host's work a step — the decoder's Python, the compiled call, MLX's dispatch of the graph —
which bounds the step where the device is faster than the host.
Each b: b prompts of -p tokens (random ids) added, one warm-up round of -n steps, then -n
timed steps (every slot decoding); the median of -r rounds. Uses the converted checkpoint of
benchmarks/long_prompt.py (same --work). --kv-bits: the engine's quantized KV cache (the block
cache holds the same form); --sequential: BatchDecoder's sequential mode (each row its own
cache) instead of the batched step.

--graph: instead of the timed rounds, the host's side of a decode step, what a GPU step waits on
when the device is fast (one JSON): for the single sequence (Engine.decode_step) and the batched
step at each b (the compiled DecodeProgram.paged over a block cache, b rows at their own
offsets, fed back their argmax as BatchDecoder's steady state is), the step's MLX graph —
the nodes of the compiled call's outputs (logits, cache writes) and the argmax, by primitive
(profile.graph_nodes: counted, not timed, so the same on any load) and the uncompiled
trace's (what one trace builds) — and the calling thread's CPU time a step (medians of -r
rounds of -n steps), split into `build` (the compiled call and the argmax: Python and MLX's
graph replay) and `dispatch` (mx.async_eval: MLX encoding the graph). On MLX's CPU backend
the compute runs on MLX's own thread, so neither includes it.

--profile (NVIDIA): each b's steps once more under PyTorch's profiler with CUDA activity
(CUPTI records MLX's kernels): the device time a step by kernel name, the kernels a step and
the time covered by at least one kernel, so a batch's extra cost is attributed to the kernels
that grow with its rows.
"""

from __future__ import annotations

import argparse
import json
import os
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
from fuselm.runtime_metal.kv_cache import BLOCK, BlockCache  # noqa: E402
from fuselm.runtime_metal.mlx_engine.profile import graph_nodes  # noqa: E402


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


def _host_rounds(one_step, n: int, runs: int) -> dict[str, float]:  # noqa: ANN001
    """Calling-thread CPU time a step of `one_step(split)` (which adds its build and dispatch
    seconds into split), medians of `runs` rounds of n steps after a warm-up round."""
    build, dispatch = [], []
    for r in range(runs + 1):
        split = {"build": 0.0, "dispatch": 0.0}
        for _ in range(n):
            one_step(split)
        mx.synchronize()
        if r:
            build.append(split["build"] / n * 1e3)
            dispatch.append(split["dispatch"] / n * 1e3)
    b, d = statistics.median(build), statistics.median(dispatch)
    return {"build_ms": b, "dispatch_ms": d, "host_ms": b + d}


def _nodes(outputs: list[mx.array]) -> dict[str, object]:
    counts = graph_nodes(*outputs)
    return {"nodes": sum(counts.values()), "by_primitive": dict(counts.most_common())}


def graph_report(engine, prompt: list[int], batches: list[int], n: int, runs: int  # noqa: ANN001
                 ) -> dict[str, object]:
    """--graph: each step's graph nodes and host CPU time, single sequence and b rows."""
    fast = engine.fast
    if fast is None or engine.batch_program() is None:
        raise SystemExit(f"no compiled program here ({engine.fast_reason})")
    program = fast.program
    engine.reset()
    engine.reserve(len(prompt) + (runs + 2) * n + 8)
    y = mx.argmax(engine.forward_device(np.array([prompt])), axis=-1).astype(mx.uint32)
    mx.eval(y)
    kv = [a for c in fast.caches for a in c.buffers()]
    at = mx.array(engine.offset, mx.int32)
    traced = _nodes(list(program(y, at, *kv)))
    del kv
    state = {"y": y}

    def single(split: dict[str, float]) -> None:
        t0 = time.thread_time()
        nxt = mx.argmax(engine.decode_step(state["y"]), axis=-1)
        t1 = time.thread_time()
        mx.async_eval(nxt)
        split["build"] += t1 - t0
        split["dispatch"] += time.thread_time() - t1
        state["y"] = nxt

    mx.eval(state["y"])
    logits = engine.decode_step(state["y"])
    written = [a for c in fast.caches for a in c.buffers()]  # its cache writes, lazy
    out = {"single": {**_nodes([logits, mx.argmax(logits, axis=-1), *written]),
                      "traced_nodes": traced["nodes"], "traced": traced["by_primitive"],
                      **_host_rounds(single, n, runs)}}
    fn, layout, _ = engine.batch_program()
    # every row's table spans the positions the single sequence's cache holds (one trace)
    width = fast.caches[0].capacity // BLOCK
    rows = []
    for b in batches:
        cache = BlockCache(layout, b * width, engine.kv_quant)
        table = mx.arange(b * width, dtype=mx.int32).reshape(b, width)
        st = {"tokens": mx.zeros((b, 1), mx.uint32),  # rows at their own offsets
              "offsets": mx.array(len(prompt) + np.arange(b) % 8, mx.int32)}
        mx.eval(table, st["offsets"], *cache.buffers())
        traced_b = _nodes(list(program.paged(st["tokens"], st["offsets"], table,
                                             *cache.buffers())))
        mx.eval(*cache.buffers())  # the trace wrote its rows into the pools: done before
        logits, _, *new = fn(st["tokens"], st["offsets"], table, *cache.buffers())
        row = {"batch": b, **_nodes([logits, mx.argmax(logits, axis=-1), *new]),
               "traced_nodes": traced_b["nodes"], "traced": traced_b["by_primitive"]}
        del logits, new

        def batched(split: dict[str, float], cache=cache, table=table, st=st,  # noqa: ANN001
                    b=b) -> None:
            t0 = time.thread_time()
            # the pools straight from the cache, no list kept (BatchDecoder._queue: donated)
            logits, nxt, *new = fn(st["tokens"], st["offsets"], table, *cache.buffers())
            cache.adopt(new)
            del new
            picks = mx.argmax(logits, axis=-1)
            t1 = time.thread_time()
            mx.async_eval(picks)
            split["build"] += t1 - t0
            split["dispatch"] += time.thread_time() - t1
            st["tokens"], st["offsets"] = picks.reshape(b, 1), nxt

        row.update(_host_rounds(batched, n, runs))
        rows.append(row)
    return {**out, "rows": rows}


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
    ap.add_argument("--kv-bits", type=int, choices=(4, 8),
                    help="a quantized KV cache of these bits (default: float)")
    ap.add_argument("--sequential", action="store_true",
                    help="BatchDecoder's sequential mode (each row its own cache)")
    ap.add_argument("--graph", action="store_true",
                    help="each step's graph nodes and host CPU time (build / dispatch), "
                    "single sequence and each b, instead of the timed rounds")
    ap.add_argument("--profile", action="store_true",
                    help="also each b's kernel time a step by kernel name (needs torch + CUDA)")
    args = ap.parse_args()
    out_dir = args.artifact or artifact(args.work, args.shape, args.dtype, args.p + args.n)
    engine = make_engine(out_dir, "mlx", **({"kv_bits": args.kv_bits} if args.kv_bits else {}))
    rng = np.random.default_rng(0)
    vocab = engine.manifest.model.vocab_size
    if args.graph:
        prompt = [int(t) for t in rng.integers(4, min(1000, vocab), args.p)]
        report = graph_report(engine, prompt, args.b, args.n, args.r)
        print(json.dumps({"device": str(mx.default_device()), "host": platform.node(),
                          "load": os.getloadavg(), "shape": str(args.artifact or args.shape),
                          "dtype": args.dtype, "engine": engine.describe(), "prompt": args.p,
                          "steps": args.n, **report}, indent=1))
        return
    single, single_host = single_step_ms(
        engine, [int(t) for t in rng.integers(4, min(1000, vocab), args.p)], args.n, args.r)
    rows = []
    for b in args.b:
        dec = BatchDecoder(engine, max_batch=b,
                           max_context=args.max_context or args.p + (args.r + 1) * args.n + 8,
                           batched=False if args.sequential else None)
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
                      "engine": engine.describe(), "kv_bits": args.kv_bits,
                      "load": os.getloadavg(), "prompt": args.p,
                      "steps": args.n, "single_step_ms": single,
                      "single_host_ms": single_host, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
