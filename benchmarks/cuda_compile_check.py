"""Compile fuselm's decode kernels with nvcc for a GPU architecture, on a machine without a GPU,
and report each one's registers, spills and whether its block fits the register file.

    python benchmarks/cuda_compile_check.py [--arch sm_90] [--only NAME_PART ...] [--keep DIR]

How: mx.fast.cuda_kernel is replaced by a recorder, then the public kernel functions
(kernels_cuda.rope_attend, kernels_q4.q4_gemv, ...) are called on small CPU arrays of the model
shapes below. Each call hands the recorder exactly what MLX-CUDA's JIT would get (name,
header, body, input/output dtypes, template arguments, block size); the recorder writes the
translation unit the way MLX's build_kernel does (mlx/backend/cuda/custom_kernel.cpp: its
default header, `namespace mlx::core::cu`, one pointer per input, a `Shape` where the body
uses NAME_shape, the template arguments as constexpr) with MLX's device header replaced by
the CUDA headers it brings in, and nvcc compiles it with `-Xptxas -v`. It proves the
kernels compile and how many registers they take; it says nothing about their results or
speed (tests/runtime/test_kernels.py and kernel_bench.py do, on a GPU). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

_PRELUDE = """#include <cstdint>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cooperative_groups.h>
#include <cuda/std/limits>
#define inf cuda::std::numeric_limits<float>::infinity()
namespace mlx::core::cu {
struct Shape {  // MLX: the input's shape, passed by value
  int32_t v[10];
  __device__ int32_t operator[](int i) const { return v[i]; }
};
}
"""
_REGS = re.compile(r"Compiling entry function '(\w+)'.*?Used (\d+) registers", re.S)


def cuda_type(dtype: Any) -> str:
    import mlx.core as mx

    return {mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.float32: "float",
            mx.int32: "int32_t", mx.uint32: "uint32_t", mx.bool_: "bool"}[dtype]


def same_ptx(arch: str, a: str, b: str, tmp: Path) -> bool:
    """Whether two translation units compile to the same PTX (comment lines dropped: they name
    the file and the compiler). ptxas makes the machine code from the PTX alone, so equal PTX
    means equal kernels (this machine's CUDA has no cuobjdump to compare SASS itself)."""
    dumps = []
    for i, text in enumerate((a, b)):
        cu, ptx = tmp / f"cmp{i}.cu", tmp / f"cmp{i}.ptx"
        cu.write_text(text)
        subprocess.run(["nvcc", f"-arch={arch}", "-std=c++17", "-ptx", "-o", str(ptx), str(cu)],
                       check=True, capture_output=True)
        dumps.append([line for line in ptx.read_text().splitlines()
                      if line.strip() and not line.lstrip().startswith("//")])
    return dumps[0] == dumps[1] and len(dumps[0]) > 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--only", nargs="*", default=[], help="kernels whose name has all of these")
    ap.add_argument("--keep", type=Path, help="also write each translation unit (.cu) here")
    ap.add_argument("--compare-ptx", action="store_true",
                    help="also compile each kernel from its text as written (comments kept, "
                         "inline) and check that its PTX equals that of the text MLX gets "
                         "(kernels.compact_cuda's, through kernel_files' #include)")
    args = ap.parse_args()

    import mlx.core as mx
    import numpy as np

    units: dict[str, tuple[str, int]] = {}  # kernel name -> (source, threads per block)

    def recorder(name: str, input_names: list[str], output_names: list[str], source: str,
                 header: str = "", **_: Any) -> Any:
        def launch(inputs: list[mx.array], output_shapes: list[tuple[int, ...]],
                   output_dtypes: list[Any], grid: tuple[int, int, int],
                   threadgroup: tuple[int, int, int], template: list[tuple[str, Any]] = (),
                   **__: Any) -> list[mx.array]:
            suffix = "".join(
                f"_{'t' if v else 'f'}" if isinstance(v, bool) else f"_{v}" if isinstance(v, int)
                else f"_{cuda_type(v)}" for _, v in template)
            fname = f"custom_kernel_{name}{suffix}"
            params = []
            for n, a in zip(input_names, inputs, strict=True):
                params.append(f"    const {cuda_type(a.dtype)}* {n}")
                if a.ndim > 0 and f"{n}_shape" in source:
                    params.append(f"    const __grid_constant__ Shape {n}_shape")
            params += [f"    {cuda_type(d)}* {n}" for n, d in zip(output_names, output_dtypes,
                                                                   strict=True)]
            consts = "".join(
                f"  constexpr bool {k} = {'true' if v else 'false'};\n" if isinstance(v, bool)
                else f"  constexpr int {k} = {v};\n" if isinstance(v, int)
                else f"  using {k} = {cuda_type(v)};\n" for k, v in template)
            text = (_PRELUDE + header + "namespace mlx::core::cu {\n\n"
                    "namespace cg = cooperative_groups;\n\n"
                    f"__global__ void {fname}(\n" + ",\n".join(params) + ") {\n"
                    + consts + "\n" + source + "\n}\n\n} // namespace mlx::core::cu\n")
            units[fname] = (text, threadgroup[0] * threadgroup[1] * threadgroup[2])
            return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes, strict=True)]
        return launch

    mx.fast.cuda_kernel = recorder  # type: ignore[assignment]
    from fuselm.runtime_metal.cuda_kernels import embedding as kernels_embedding
    from fuselm.runtime_metal.cuda_kernels import kernel_files
    from fuselm.runtime_metal.cuda_kernels import q4_gemv as kernels_q4
    from fuselm.runtime_metal.cuda_kernels import selection as kernels
    from fuselm.runtime_metal.cuda_kernels import sources as kernels_cuda

    raw_units: dict[str, str] = {}  # --compare-ptx: kernel name -> its text as written
    if args.compare_ptx:
        def both(name: str, input_names: list[str], output_names: list[str], source: str,
                 header: str = "") -> Any:
            # what kernels.cuda_kernel hands MLX (kernel_files: the #include of the text)
            body, head = kernel_files.mlx_text(input_names, kernels.compact_cuda(source),
                                               kernels.compact_cuda(header))
            compact = recorder(name, input_names, output_names, body, head)
            raw = recorder(name, input_names, output_names, source, header)

            def launch(*a: Any, **k: Any) -> list[mx.array]:
                before = set(units)
                raw(*a, **k)
                for fname in set(units) - before:
                    raw_units[fname] = units.pop(fname)[0]
                return compact(*a, **k)
            return launch
        kernels.cuda_kernel = both  # type: ignore[assignment]

    rng = np.random.default_rng(0)
    attention = [  # d, hq, hk, q/k norms, interleaved: the test and model shapes
        (128, 16, 8, True, False), (64, 32, 8, False, False), (128, 32, 8, False, False),
        (64, 4, 4, False, True), (128, 8, 1, True, False), (256, 4, 2, False, False),
        (96, 6, 2, True, True)]
    for dt in (mx.float16, mx.bfloat16, mx.float32):
        for d, hq, hk, norms, inter in attention:
            qkv = mx.zeros((1, 1, (hq + 2 * hk) * d), dt)
            q, k = qkv[..., :hq * d], qkv[..., hq * d:(hq + hk) * d]
            cache = mx.zeros((1, hk, 512, d), dt)
            n = mx.ones((d,), dt) if norms else None  # without: no qn/kn inputs (null pointers)
            inv = mx.array(rng.random(d // 2).astype(np.float32))
            prm, off = (1e-6, float(d) ** -0.5, 1.0), mx.array([5], mx.int32)
            for splits in (0, 1, 8):
                for joined in (None, qkv):  # q, k, v apart, or the fused projection once
                    kernels_cuda.rope_attend(q, k, k, n, n, inv, prm, off, cache, cache, hq=hq,
                                             hk=hk, rotary_dim=d, interleaved=inter,
                                             splits=splits, qkv=joined)
        # the 8-bit cache's form (kv_cache.KVQuant bits 8: codes, scales, biases): merged
        # (1 split) and split (scratch) forms, contiguous and paged, q/k/v apart and joined, at
        # group 64; every group size the head takes at 8 splits; the partials as outputs (a
        # batch too large for the scratch, through a block table over a small pool)
        def step_inputs(d: int, hq: int, hk: int, norms: bool, dt: Any) -> tuple[Any, ...]:
            """A one-token step's inputs for the quantized caches' forms: the fused
            projection, q and k slices of it, the norm scale (or None), inv_freq, the float
            constants and the offset."""
            qkv = mx.zeros((1, 1, (hq + 2 * hk) * d), dt)
            q, k = qkv[..., :hq * d], qkv[..., hq * d:(hq + hk) * d]
            n = mx.ones((d,), dt) if norms else None
            inv = mx.array(rng.random(d // 2).astype(np.float32))
            return qkv, q, k, n, inv, (1e-6, float(d) ** -0.5, 1.0), mx.array([5], mx.int32)

        q8_shapes = [(128, 16, 8, True, False), (64, 32, 8, False, False),
                     (128, 8, 1, True, False), (256, 4, 2, False, False),
                     (64, 4, 4, False, True)]
        for d, hq, hk, norms, inter in q8_shapes if dt != mx.float32 else q8_shapes[:2]:
            qkv, q, k, n, inv, prm, off = step_inputs(d, hq, hk, norms, dt)

            def q8(lead: tuple[int, ...], group: int, d: int = d, dt: Any = dt
                   ) -> tuple[mx.array, ...]:
                return (mx.zeros((*lead, d // 4), mx.uint32), mx.zeros((*lead, d // group), dt),
                        mx.zeros((*lead, d // group), dt))
            cases = [(64, s, j, p) for s in (1, 8) for j in (None, qkv) for p in (False, True)]
            cases += [(g, 8, None, False) for g in (32, 128) if g <= d]
            for group, splits, joined, paged in cases:
                cache = q8((4, hk, 64) if paged else (1, hk, 512), group)
                table = mx.zeros((1, 8), mx.int32) if paged else None
                kernels_cuda.rope_attend(q, k, k, n, n, inv, prm, off, cache, cache, hq=hq,
                                         hk=hk, rotary_dim=d, interleaved=inter, splits=splits,
                                         qkv=joined, table=table)
            if (d, norms) == (128, True):  # 2,048 rows x 8 splits: past the scratch
                rows = 2048
                qr, kr = mx.zeros((rows, 1, hq * d), dt), mx.zeros((rows, 1, hk * d), dt)
                cache = q8((4, hk, 64), 64)
                kernels_cuda.rope_attend(qr, kr, kr, n, n, inv, prm, mx.zeros((rows,), mx.int32),
                                         cache, cache, hq=hq, hk=hk, rotary_dim=d,
                                         interleaved=inter, splits=8,
                                         table=mx.zeros((rows, 2), mx.int32))
        # the 4-bit cache's form (keys per channel, kv_cache.key_groups_zeros /
        # key_blocks_zeros; values 4-bit per token): merged and split, contiguous and paged
        # (with the rows' tail slots), q/k/v apart and joined at value group 64; groups 32 and
        # 128 at 8 splits; D 64, 128 and 256 (float32: two shapes); its warp steps of 8 and 32
        # keys besides the default 16 (D 128, bfloat16, 8 splits, contiguous and paged)
        from fuselm.runtime_metal.kv_cache import KVQuant, key_blocks_zeros, key_groups_zeros
        for d, hq, hk, norms, inter in q8_shapes if dt != mx.float32 else q8_shapes[:2]:
            qkv, q, k, n, inv, prm, off = step_inputs(d, hq, hk, norms, dt)
            cases: list[tuple[int, int, Any, bool, int | None]] = [
                (64, s, j, p, None) for s in (1, 8) for j in (None, qkv) for p in (False, True)]
            cases += [(g, 8, None, p, None) for g in (32, 128) if g <= d for p in (False, True)]
            if (d, dt) == (128, mx.bfloat16):  # the other keys a warp step it takes: 8, 32
                cases += [(64, 8, None, p, kb) for p in (False, True) for kb in (8, 32)]
            for group, splits, joined, paged, step in cases:
                four = KVQuant(4, group)
                if paged:
                    keys = key_blocks_zeros(4, 1, hk, d, dt)
                    values = four.zeros((4, hk, 64), d, dt)
                    table, tails = mx.zeros((1, 8), mx.int32), mx.zeros((1,), mx.int32)
                else:
                    keys = key_groups_zeros((1, hk), 512, d, dt)
                    values = four.zeros((1, hk, 512), d, dt)
                    table = tails = None
                kernels_cuda.rope_attend(q, k, k, n, n, inv, prm, off, keys, values, hq=hq,
                                         hk=hk, rotary_dim=d, interleaved=inter,
                                         splits=splits, qkv=joined, table=table,
                                         tails=tails, split_keys=step)
        for rows, kdim, nout, act in ((1, 1024, 4096, None), (1, 1024, 6144, "silu"),
                                      (4, 2048, 8192, "silu"), (16, 1024, 4096, None),
                                      (1, 4096, 1024, None)):
            x = mx.zeros((rows, 1, kdim), dt)
            packed = mx.zeros((nout, kdim // 8), mx.uint32)
            sc = mx.zeros((nout, kdim // 32), dt)
            kernels_q4.q4_gemv(x, packed, sc, sc, 32, act, mma=False)
            if act is None and nout <= 4096:  # an o_proj / down shape: the add+norm epilogue
                res = mx.zeros((rows, 1, nout), dt)
                hy = kernels_q4.q4_gemv_add_norm(x, packed, sc, sc, 32, res,
                                                 mx.ones((nout,), dt), 1e-6, mma=False)
                # read out of the one output hy [2, ...] at an element offset (template
                # constants XO / RO): y as a GEMV's input, a row of it as a residual
                y = kernels_q4.halves(hy)[1]
                y_at = (hy, kernels_q4.y_offset(hy))
                kernels_q4.q4_gemv_add_norm(x, packed, sc, sc, 32, y, mx.ones((nout,), dt),
                                            1e-6, residual_at=y_at, mma=False)
                for n2, g2, a2 in ((3 * nout, 64, "silu"), (2 * nout, 32, None)):
                    # a gate/up or q/k/v GEMV over y, read out of hy
                    p2 = mx.zeros((n2, nout // 8), mx.uint32)
                    s2 = mx.zeros((n2, nout // g2), dt)
                    kernels_q4.q4_gemv(y, p2, s2, s2, g2, a2, x_at=y_at, mma=False)
        if dt in kernels_q4.MMA_DTYPES:
            # the tensor-core form (batched rows): Qwen3-0.6B's decode GEMVs at 16 rows (q/k/v,
            # gate/up, o_proj and down with the add+norm epilogue reading x and the residual
            # out of hy, the LM head's float32 logits), odd row counts, 8-bit codes, group 64
            for rows, kdim, nout, act, g, bits in (
                    (16, 1024, 4096, None, 32, 4), (16, 1024, 6144, "silu", 32, 4),
                    (16, 2048, 1024, None, 32, 4), (16, 3072, 1024, None, 32, 4),
                    (16, 1024, 151936, None, 32, 4), (5, 1024, 6144, "gelu_tanh", 64, 4),
                    (2, 3072, 1024, None, 64, 8), (16, 96, 64, None, 32, 4)):
                x = mx.zeros((rows, 1, kdim), dt)
                packed = mx.zeros((nout, kdim * bits // 32), mx.uint32)
                sc = mx.zeros((nout, kdim // g), dt)
                if nout > 100000:
                    kernels_q4.q4_gemv(x, packed, sc, sc, g, None, mx.float32, mma=True)
                    continue
                kernels_q4.q4_gemv(x, packed, sc, sc, g, act, mma=True)
                if act is None and nout <= 1024:
                    res = mx.zeros((rows, 1, nout), dt)
                    hy = kernels_q4.q4_gemv_add_norm(x, packed, sc, sc, g, res,
                                                     mx.ones((nout,), dt), 1e-6, mma=True)
                    y_at = (hy, kernels_q4.y_offset(hy))
                    y = kernels_q4.halves(hy)[1]
                    p2 = mx.zeros((nout, nout * bits // 32), mx.uint32)
                    s2 = mx.zeros((nout, nout // g), dt)
                    x2 = mx.zeros((rows, 1, nout), dt)
                    kernels_q4.q4_gemv_add_norm(x2, p2, s2, s2, g, y, mx.ones((nout,), dt),
                                                1e-6, x_at=y_at, residual_at=y_at, mma=True)
        for rows, kdim, nout, act, g in ((1, 1024, 4096, None, 32), (4, 1024, 6144, "silu", 64),
                                         (16, 2048, 4096, None, 128)):
            # 8-bit weights (BITS = 8: 4 codes a word), plain, gated and add+norm
            x = mx.zeros((rows, 1, kdim), dt)
            packed = mx.zeros((nout, kdim // 4), mx.uint32)
            sc = mx.zeros((nout, kdim // g), dt)
            kernels_q4.q4_gemv(x, packed, sc, sc, g, act, mma=False)
            if act is None:
                kernels_q4.q4_gemv_add_norm(x, packed, sc, sc, g, mx.zeros((rows, 1, nout), dt),
                                            mx.ones((nout,), dt), 1e-6, mma=False)
        for hidden in (1024, 4096):  # the separate add+RMSNorm: 256 and 1024 threads a block
            h = mx.zeros((1, 1, hidden), dt)
            kernels_cuda.add_rms_norm(h, h, mx.ones((hidden,), dt), 1e-6)
        packed = mx.zeros((1000, 128), mx.uint32)  # an embedding table [1000, 1024]
        kernels_embedding.q4_take_rows(mx.zeros((1, 1), mx.int32), packed,
                                       mx.zeros((1000, 32), dt), mx.zeros((1000, 32), dt), 32,
                                       dt)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for fname, (text, threads) in sorted(units.items()):
            if args.only and not all(o in fname for o in args.only):
                continue
            cu = Path(tmp) / f"{fname}.cu"
            cu.write_text(text)
            if args.keep:
                args.keep.mkdir(parents=True, exist_ok=True)
                (args.keep / cu.name).write_text(text)
            p = subprocess.run(["nvcc", f"-arch={args.arch}", "-std=c++17", "-c", "-Xptxas", "-v",
                                "-o", os.devnull, str(cu)], capture_output=True, text=True)
            log = p.stdout + p.stderr
            m = _REGS.search(log)
            regs = int(m.group(2)) if m else None
            spills = [int(v) for v in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)]
            smem = re.search(r"(\d+) bytes smem", log)
            row = {"kernel": fname, "ok": p.returncode == 0, "registers": regs,
                   "spill_bytes": sum(spills), "smem": int(smem.group(1)) if smem else 0,
                   "threads": threads,
                   "fits_register_file": regs is not None and regs * threads <= 65536}
            if p.returncode != 0:
                row["error"] = log[-2000:]
            if args.compare_ptx and fname in raw_units:
                row["ptx_equal_to_text_as_written"] = same_ptx(args.arch, text,
                                                               raw_units[fname], Path(tmp))
                # what MLX hashes at each launch (its own header aside): written vs handed over
                row["text_bytes"] = {"as_written": len(raw_units[fname]), "to_mlx": len(text)}
            results.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    print(json.dumps({"arch": args.arch, "kernels": results}))
    sys.exit(0 if all(r["ok"] and r["fits_register_file"] and not r["spill_bytes"]
                      for r in results) else 1)


if __name__ == "__main__":
    main()
