"""GPU time of fuselm's decode kernels alone, variant against variant (NVIDIA, MLX-CUDA).

    python benchmarks/kernel_bench.py [--shape qwen3-0.6b] [--pos 512 1024 4096] [-n 50]

Each kernel is called n times on random inputs of one model shape's decode step (--rows rows,
default one; float16), every call evaluated, under PyTorch's profiler with CUDA activity
(CUPTI records MLX's kernels too); the median device duration per kernel name is reported, so
Python's launch overhead is not in the figure. Compared:
- the Q4 GEMV (kernels_q4) for the q/k/v, the gated gate/up and the LM head (float32 out)
  shapes, the o_proj and down GEMVs plain and with the add+RMSNorm epilogue
  (q4_gemv_add_norm: the default), and the separate add+RMSNorm kernel the epilogue replaces
  (FUSELM_FOLD_NORM=0); the GEMVs with --unroll weight loads in flight a lane (default:
  kernels.Q4_UNROLL); at --rows R > 1 (a batched step) each GEMV also in its tensor-core form
  (`mma`: q4_gemv's MMA kernel, FUSELM_GEMV_MMA) at the tiles it picks and at each of
  --mma-tiles (NJxNWK), the one-column-a-warp form still the plain names;
- rope+attention (kernels_cuda.rope_attend, reading q, k, v out of the fused projection as the
  program does: one input for the three): a block per query head (split 0), and the split
  kernel with --splits key splits (`auto` as kernels.auto_splits picks: FUSELM_ATTN_SPLIT=auto)
  at each cached length --pos, with the program's warps/keys per block and each of
  --split-configs (WARPSxKEYS) at the auto split count; with --kv-forms 8 / 4, the same
  kernel's forms over a quantized cache (kv_cache.KVQuant at --kv-group-size, random codes) at
  the auto split count, the 4-bit form at each of its warp steps --q4-steps (a step that seals
  no key group, the only one it runs in), so a cached length's float, 8- and 4-bit reads
  compare on the device alone (FUSELM_KV_ATTN's question; `gpu_run.sh kvattn`).
--only-attention leaves the GEMVs out. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

SHAPES = {  # hidden, q heads, kv heads, head_dim, intermediate, q/k norm, vocabulary
    "qwen3-0.6b": (1024, 16, 8, 128, 3072, True, 151936),
    "llama-3.2-1b": (2048, 32, 8, 64, 8192, False, 128256),
    "llama-3.1-8b": (4096, 32, 8, 128, 14336, False, 128256),
}


def kernel_times(trace: Path) -> dict[str, list[float]]:
    events = json.loads(trace.read_text())["traceEvents"]
    out: dict[str, list[float]] = defaultdict(list)
    for e in events:
        if e.get("cat") == "kernel" and "dur" in e:
            out[e["name"]].append(float(e["dur"]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    ap.add_argument("--group-size", type=int, default=32)
    ap.add_argument("--pos", type=int, nargs="*", default=[512, 1024, 4096],
                    help="cached lengths for the attention kernels (none: GEMVs only)")
    ap.add_argument("-n", type=int, default=50)
    ap.add_argument("--splits", nargs="+", default=["0", "4", "8", "16", "32", "auto"])
    ap.add_argument("--split-configs", nargs="*", default=["4x2", "8x2", "16x4", "8x8"])
    ap.add_argument("--unroll", type=int, default=None,
                    help="the Q4 GEMVs' weight loads in flight a lane, 1..16 (default: "
                         "kernels.Q4_UNROLL)")
    ap.add_argument("--rows", type=int, default=1,
                    help="rows of x, 1..16 (a batched decode step); > 1 adds the GEMVs' "
                         "tensor-core form")
    ap.add_argument("--mma-tiles", nargs="*", default=[],
                    help="more NJxNWK tiles for the tensor-core GEMVs (columns / 8 a block x "
                         "warps splitting K)")
    ap.add_argument("--kv-forms", nargs="+", choices=["float", "8", "4"], default=["float"],
                    help="the attention kernel's cache forms at each --pos (float: every "
                         "--splits and --split-configs; 8 / 4: the auto split count)")
    ap.add_argument("--kv-group-size", type=int, default=64,
                    help="the quantized caches' group (kv_cache.KVQuant: 32, 64 or 128)")
    ap.add_argument("--q4-steps", type=int, nargs="+", default=[8, 16, 32],
                    help="the 4-bit form's keys a warp step (split_keys: 8, 16 or 32)")
    ap.add_argument("--only-attention", action="store_true",
                    help="time the attention kernels only (no GEMVs, no add+RMSNorm)")
    ap.add_argument("--launch-only", action="store_true",
                    help="launch each kernel (3 + n times) without PyTorch's profiler, for an "
                         "outside profiler (ncu: gpu_run.sh attn); prints nothing")
    args = ap.parse_args()

    import mlx.core as mx
    import numpy as np
    import torch
    from torch.profiler import ProfilerActivity, profile

    from fuselm.runtime_metal.cuda_kernels import q4_gemv as kernels_q4
    from fuselm.runtime_metal.cuda_kernels import selection as kernels
    from fuselm.runtime_metal.cuda_kernels import sources as kernels_cuda
    from fuselm.runtime_metal.kv_cache import KEY_GROUP, KVQuant, key_groups_zeros

    torch.cuda.init()
    hidden, hq, hk, d, inter, qk_norm, vocab = SHAPES[args.shape]
    g = args.group_size
    dt = mx.float16
    rng = np.random.default_rng(0)

    def rand(*shape: int, scale: float = 1.0) -> mx.array:
        return mx.array((rng.standard_normal(shape) * scale).astype(np.float32)).astype(dt)

    def q4(n: int, k: int) -> tuple[mx.array, mx.array, mx.array]:
        w = rand(n, k, scale=0.02)
        packed, scales, biases = mx.quantize(w, group_size=g, bits=4)
        return packed, scales.astype(dt), biases.astype(dt)

    eps = 1e-6  # a template constant of the kernels (kernels.float_bits)
    b = args.rows
    x, r, nw = rand(b, 1, hidden), rand(b, 1, hidden), rand(hidden, scale=0.1) + 1
    qkv = q4((hq + 2 * hk) * d, hidden)
    gate_up = q4(2 * inter, hidden)
    o_proj, down = q4(hidden, hq * d), q4(hidden, inter)
    lm_head = q4(vocab, hidden)
    xo, xd = rand(b, 1, hq * d), rand(b, 1, inter)
    u = args.unroll

    def gemvs(mma: bool, tiles: tuple[int, int] | None = None) -> dict[str, Any]:
        """The decode step's GEMVs in one form: mma False = one column a warp (--unroll)."""
        kw: dict[str, Any] = {"mma": mma, "tiles": tiles} if mma else {"unroll": u, "mma": False}
        return {
            "qkv plain": lambda: kernels_q4.q4_gemv(x, *qkv, g, **kw),
            "gate_up plain": lambda: kernels_q4.q4_gemv(x, *gate_up, g, "silu", **kw),
            "o_proj plain": lambda: kernels_q4.q4_gemv(xo, *o_proj, g, **kw),
            "o_proj addnorm": lambda: kernels_q4.q4_gemv_add_norm(xo, *o_proj, g, r, nw, eps,
                                                                  **kw),
            "down plain": lambda: kernels_q4.q4_gemv(xd, *down, g, **kw),
            "lm_head": lambda: kernels_q4.q4_gemv(x, *lm_head, g, None, mx.float32, **kw),
            "down addnorm": lambda: kernels_q4.q4_gemv_add_norm(xd, *down, g, r, nw, eps,
                                                                **kw),
        }

    calls: dict[str, Any] = {} if args.only_attention else {
        "add_rms_norm": lambda: kernels_cuda.add_rms_norm(x, r, nw, eps), **gemvs(False)}
    if b > 1 and not args.only_attention:
        calls |= {f"{n} mma": fn for n, fn in gemvs(True).items()}
        for cfg in args.mma_tiles:
            nj, nwk = (int(t) for t in cfg.split("x"))
            calls |= {f"{n} mma {cfg}": fn for n, fn in gemvs(True, (nj, nwk)).items()}
    inv_freq = mx.array((1.0 / 10000 ** (np.arange(0, d, 2) / d)).astype(np.float32))
    prm = (1e-6, 1.0 / np.sqrt(d), 1.0)  # eps, softmax scale, attention scale
    # q, k, v as the program passes them: slices of the fused projection, read from it
    qkv_row = rand(1, 1, (hq + 2 * hk) * d)
    q, k, v = (qkv_row[..., :hq * d], qkv_row[..., hq * d:(hq + hk) * d],
               qkv_row[..., (hq + hk) * d:])
    norm = rand(d, scale=0.1) + 1 if qk_norm else None
    def codes(*shape: int) -> mx.array:
        return mx.array(rng.integers(0, 2**32, shape, dtype=np.uint32))

    def quantized(lead: tuple[int, ...], stored: tuple[mx.array, ...]) -> tuple[mx.array, ...]:
        """A KVQuant-shaped cache of random codes, positive scales and negative biases (the
        values the kernel reads stay finite and of the activations' size)."""
        return (codes(*stored[0].shape), rand(*stored[1].shape, scale=0.01).abs() + 0.005,
                -rand(*stored[2].shape, scale=0.05).abs(), *stored[3:])

    for pos in args.pos:
        cap = (pos // 256 + 1) * 256
        kc, vc = rand(1, hk, cap, d), rand(1, hk, cap, d)
        off = mx.array([pos], mx.int32)
        groups = hq // hk // kernels_cuda.split_heads_per_block(hq, hk, d)
        auto = kernels.auto_splits(cap, hk, groups)
        kvg = args.kv_group_size
        for form in args.kv_forms:
            if form == "float":
                continue
            if form == "8":
                kq = quantized((1, hk, cap), KVQuant(8, kvg).zeros((1, hk, cap), d, dt))
                vq = quantized((1, hk, cap), KVQuant(8, kvg).zeros((1, hk, cap), d, dt))
                steps: list[int | None] = [None]
            else:
                if pos % KEY_GROUP == KEY_GROUP - 1:
                    raise SystemExit(f"--pos {pos}: that step seals a key group, which the "
                                     "4-bit form leaves to MLX's ops; take another length")
                kq = quantized((1, hk), key_groups_zeros((1, hk), cap, d, dt))
                kq = (*kq[:3], rand(*kq[3].shape))  # the open group's float keys
                vq = quantized((1, hk, cap), KVQuant(4, kvg).zeros((1, hk, cap), d, dt))
                steps = list(args.q4_steps)
            for step in steps:
                label = f"attend pos {pos} kv {form}-bit g{kvg} split auto={auto}" + (
                    f" step {step}" if step else "")
                calls[label] = (
                    lambda kq=kq, vq=vq, off=off, step=step, n=auto: kernels_cuda.rope_attend(
                        q, k, v, norm, norm, inv_freq, prm, off, kq, vq, hq=hq, hk=hk,
                        rotary_dim=d, interleaved=False, splits=n, split_keys=step,
                        qkv=qkv_row)[0])
        if "float" not in args.kv_forms:
            continue
        for sp in args.splits:
            n_split = auto if sp == "auto" else int(sp)
            calls[f"attend pos {pos} split {sp}={n_split}"] = (
                lambda kc=kc, vc=vc, off=off, n_split=n_split: kernels_cuda.rope_attend(
                    q, k, v, norm, norm, inv_freq, prm, off, kc, vc, hq=hq, hk=hk,
                    rotary_dim=d, interleaved=False, splits=n_split, qkv=qkv_row)[0])
        for cfg in args.split_configs:
            warps, kb = (int(t) for t in cfg.split("x"))
            calls[f"attend pos {pos} split auto={auto} {cfg}"] = (
                lambda kc=kc, vc=vc, off=off, nw=warps, kb=kb, n=auto: kernels_cuda.rope_attend(
                    q, k, v, norm, norm, inv_freq, prm, off, kc, vc, hq=hq, hk=hk,
                    rotary_dim=d, interleaved=False, splits=n, split_warps=nw,
                    split_keys=kb, qkv=qkv_row)[0])
    if args.launch_only:
        for fn in calls.values():
            for _ in range(3 + args.n):
                mx.eval(fn())
        mx.synchronize()
        return
    results: dict[str, Any] = {}
    for name, fn in calls.items():
        for _ in range(3):  # compile, allocate
            mx.eval(fn())
        mx.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.n):
                mx.eval(fn())
            mx.synchronize()
        with tempfile.TemporaryDirectory() as tmp:
            trace = Path(tmp) / "t.json"
            prof.export_chrome_trace(str(trace))
            times = kernel_times(trace)
        fuselm = {n: t for n, t in times.items() if "fuselm" in n} or times
        results[name] = {n[:90]: {"median_us": statistics.median(t), "calls": len(t)}
                         for n, t in fuselm.items()}
        # one call's kernels: the sum of their medians
        results[name]["total_us"] = sum(v["median_us"] for v in results[name].values())
        print(name, round(results[name]["total_us"], 2),
              file=sys.stderr, flush=True)
    print(json.dumps({"shape": args.shape, "group_size": g, "dtype": "float16", "rows": b,
                      "n": args.n, "kernels": results}))


if __name__ == "__main__":
    main()
