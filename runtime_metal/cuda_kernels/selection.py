"""Whether the compiled program (mlx_engine/decode.py) calls fuselm's fused CUDA kernels
(runtime_metal/cuda_kernels/sources.py) and, per call, whether a kernel takes the shapes at hand.

FUSELM_KERNELS selects: `auto` (default) uses them on MLX's CUDA backend and never elsewhere;
`off` keeps MLX's built-ins everywhere (the plain path the kernels are tested against); `on`
demands them and fails clearly where MLX has no CUDA device. On Apple GPUs MLX's own SDPA
already has a vector kernel that takes the decode mask, so there is no Metal twin: the plain
path runs there.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from functools import cache
from typing import Any

import mlx.core as mx
import numpy as np

from fuselm.runtime_metal.cuda_kernels import kernel_files
from fuselm.runtime_metal.errors import RuntimeUserError

ENV = "FUSELM_KERNELS"
MODES = ("auto", "on", "off")
DTYPES = (mx.float16, mx.bfloat16, mx.float32)  # the activation dtypes the kernels take


def compact_cuda(text: str) -> str:
    """CUDA text without its comments, indentation and blank lines (line breaks kept, so
    preprocessor lines stay whole; a `//` inside a string literal is kept).

    Why: MLX-CUDA hashes a custom kernel's whole source on every launch (custom_kernel.cpp,
    CustomKernel::eval_gpu names the JIT module with std::hash of it), so every byte of
    commentary costs host time on each of a decode step's ~150 launches. The compiled code
    is the same (benchmarks/cuda_compile_check.py --compare-ptx checks it)."""
    out = []
    for line in text.splitlines():
        cut, quoted, i = len(line), False, 0
        while i < len(line) - 1:
            if line[i] == '"' and (i == 0 or line[i - 1] != "\\"):
                quoted = not quoted
            elif not quoted and line[i:i + 2] == "//":
                cut = i
                break
            i += 1
        code = line[:cut].strip()
        if code:
            out.append(code)
    return "\n".join(out) + "\n"


def _float32(x: float) -> np.float32:
    with np.errstate(over="ignore"):  # past float32's range: inf, refused by the callers
        return np.float32(x)


def takes_float_bits(*xs: float) -> bool:
    """Whether float_bits takes every one of xs (the caller runs the plain path otherwise)."""
    return all(math.isfinite(f) and not np.signbit(f) for f in map(_float32, xs))


def float_bits(x: float) -> int:
    """The float32 bit pattern of x as a non-negative int: a float constant passed to a kernel
    as an integer template argument (the kernel reads it back with `__int_as_float(NAME)`)
    instead of a float32 input array, because MLX-CUDA's host cost is ~0.4 µs an input array
    at every launch. The same float32 value mx.array([x], mx.float32) holds (x rounded to
    nearest), so the kernel's arithmetic is unchanged.

    MLX writes a template value into the kernel's name (`_<value>`), where a minus sign makes
    no identifier: only finite values with the sign bit clear; ValueError otherwise."""
    if not takes_float_bits(x):
        raise ValueError(f"{x!r} is no finite float32 with the sign bit clear: no kernel "
                         "template constant")
    return int(np.array(_float32(x), np.float32).view(np.int32))


_FACTORIES: list[Any] = []


def kernel_factory(make: Callable[..., Any]) -> Any:
    """A kernel module's function making one of its kernels (through cuda_kernel), cached per
    argument set like functools.cache, and registered so clear_kernel_factories can empty them
    all at once."""
    cached = cache(make)
    _FACTORIES.append(cached)
    return cached


def clear_kernel_factories() -> None:
    """Empties every kernel_factory's cache: the next call makes its kernel again through
    cuda_kernel (tests that record launches with a stand-in cuda_kernel)."""
    for f in _FACTORIES:
        f.cache_clear()


def cuda_kernel(name: str, input_names: list[str], output_names: list[str], source: str,
                header: str = "") -> object:
    """mx.fast.cuda_kernel over compact_cuda's text of the body and header, handed over as
    kernel_files.mlx_text makes it (an #include of a file holding that text: MLX hashes the
    text it gets at every launch)."""
    body, head = kernel_files.mlx_text(input_names, compact_cuda(source), compact_cuda(header))
    return mx.fast.cuda_kernel(name=name, input_names=input_names, output_names=output_names,
                               source=body, header=head)


def cuda_device() -> bool:
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


def enabled(mode: str | None = None) -> bool:
    """Resolve a mode (default: the environment's) to on/off for this process's device."""
    mode = (mode if mode is not None else os.environ.get(ENV, "auto")).strip().lower()
    if mode not in MODES:
        raise RuntimeUserError(
            f"{ENV}={mode!r} is not a kernel mode; use one of {', '.join(MODES)}")
    if mode == "off":
        return False
    if mode == "on" and not cuda_device():
        raise RuntimeUserError(
            f"{ENV}=on needs MLX's CUDA backend (device here: {mx.default_device()}); "
            f"use {ENV}=auto to run MLX's built-in kernels instead")
    return cuda_device()


GEMV_ENV = "FUSELM_Q4_GEMV"


def gemv_enabled(kernels_on: bool) -> bool:
    """The Q4 GEMV kernel (kernels_q4.py) for decode steps: with the other kernels, unless
    FUSELM_Q4_GEMV=0 keeps MLX's quantized matmul (to measure one against the other)."""
    return kernels_on and os.environ.get(GEMV_ENV, "1").strip() != "0"


UNROLL_ENV = "FUSELM_Q4_UNROLL"
# How many of a lane's 16-byte weight loads the Q4 GEMV keeps in flight at once: all of them
# when the row takes at most this many a lane (K <= 1,024 x N), else two at a time.
Q4_UNROLL = 16


def q4_unroll() -> int:
    """FUSELM_Q4_UNROLL=N (1..16), else Q4_UNROLL: the Q4 GEMV's loads in flight a lane (a weight
    row of K columns takes K / 1,024 of them). More loads in flight hide more memory latency on
    the long rows (a down projection: few output columns, so few warps, each reading a long
    row), at more registers; the result is the same (the sums run in the same order)."""
    raw = os.environ.get(UNROLL_ENV, "").strip()
    if not raw:
        return Q4_UNROLL
    if not raw.isdigit() or not 1 <= int(raw) <= 16:
        raise RuntimeUserError(f"{UNROLL_ENV}={raw!r}: use a load count 1..16 (default "
                               f"{Q4_UNROLL})")
    return int(raw)


FOLD_ENV = "FUSELM_FOLD_NORM"
FOLD_MODES = ("epilogue", "chain", "0")


def fold_norm_mode(gemv_on: bool) -> str:
    """Where each decode step's residual add + RMSNorm runs when the Q4 GEMV kernel is on
    (FUSELM_FOLD_NORM): `epilogue` (default) in the GEMV that produces the added row (o_proj,
    down: kernels_q4.q4_gemv_add_norm, whose last block normalizes); `chain` the same, launched
    together with the GEMV reading the normalized row (gate/up, the next layer's q/k/v:
    kernels_q4.q4_gemv_add_norm_then; 2 launches a layer fewer, but the H200 measured the
    chained launch at ~2.7x the two apart, a Qwen3-0.6B step 2.48 ms against 1.70 ms:
    BENCHMARKS.md 'Runtime settings'); `0` as the separate add+RMSNorm kernel. Without the GEMV
    kernel: "0". (Folding it into every block of the GEMV reading the normalized row instead
    measured ~21 µs a GEMV against ~3.5 µs plain on the H200, a Qwen3-0.6B step 2.85 ms
    against 1.59 ms unfolded: BENCHMARKS.md 'Runtime settings'.)"""
    raw = os.environ.get(FOLD_ENV, FOLD_MODES[0]).strip().lower()
    if raw not in FOLD_MODES:
        raise RuntimeUserError(f"{FOLD_ENV}={raw!r}: use one of {', '.join(FOLD_MODES)}")
    return raw if gemv_on else "0"


GRAPH_OPS_ENV = "FUSELM_CUDA_GRAPH_OPS"
MLX_GRAPH_OPS_ENV = "MLX_MAX_OPS_PER_BUFFER"
# MLX-CUDA records launches into a CUDA graph and launches it every MLX_MAX_OPS_PER_BUFFER
# operations (its default: 20). A decode step of ~150 launches is bound by the host's cost per
# launch once the kernels are fast: on an H200 host, a Qwen3-0.6B g32 step took 2.09 ms at 20,
# 1.62 ms at 60 and 2.47 ms at 200 operations per graph (BENCHMARKS.md 'Runtime settings').
CUDA_GRAPH_OPS = 60
GRAPHS_ENV = "FUSELM_CUDA_GRAPHS"
MLX_GRAPHS_ENV = "MLX_USE_CUDA_GRAPHS"
# Whether MLX-CUDA records launches into CUDA graphs at all (FUSELM_CUDA_GRAPHS=0|1; the user's
# own MLX_USE_CUDA_GRAPHS wins). Without graphs every kernel is launched at once
# (cuLaunchKernelEx), no per-graph node adds, update and launch on the host.
CUDA_GRAPHS = True


def configure_cuda_graphs() -> None:
    """Sets MLX_MAX_OPS_PER_BUFFER (and MLX_USE_CUDA_GRAPHS) for this process on MLX's CUDA
    backend, unless the user set it: FUSELM_CUDA_GRAPH_OPS=N, else CUDA_GRAPH_OPS
    (FUSELM_CUDA_GRAPHS=0|1, else CUDA_GRAPHS). MLX reads it once, at the first GPU
    evaluation of the process, so this runs before an engine loads its weights; Metal (which
    reads the same variable for its command buffers) and CPU are left alone."""
    if not cuda_device():
        return
    raw = os.environ.get(GRAPH_OPS_ENV, "").strip() or str(CUDA_GRAPH_OPS)
    if not raw.isdigit() or int(raw) < 1:
        raise RuntimeUserError(f"{GRAPH_OPS_ENV}={raw!r} is not an operation count; use e.g. "
                               f"{CUDA_GRAPH_OPS}")
    os.environ.setdefault(MLX_GRAPH_OPS_ENV, raw)
    graphs = os.environ.get(GRAPHS_ENV, "").strip() or ("1" if CUDA_GRAPHS else "0")
    if graphs not in ("0", "1"):
        raise RuntimeUserError(f"{GRAPHS_ENV}={graphs!r}: use 1 (CUDA graphs) or 0 (launch "
                               "each kernel directly)")
    os.environ.setdefault(MLX_GRAPHS_ENV, graphs)


DENSE_PREFILL_ENV = "FUSELM_PREFILL_DENSE"
# MLX-CUDA's quantized matmul for many rows runs well below a dense GEMM: dequantizing each
# weight inside the call (a transient) and running MLX's dense matmul doubled prefill on the
# H200 (Qwen3-0.6B Q4 float16, 2,048 tokens: 149k vs 80k tok/s; BENCHMARKS.md 'Long prompts').
CUDA_DENSE_ROWS = 256


def dense_prefill_rows() -> int:
    """From how many rows a Q4 matmul dequantizes its weight (a transient, inside the call)
    and runs a dense matmul instead of MLX's quantized matmul; 0 = never. Default: from
    CUDA_DENSE_ROWS rows on MLX-CUDA, never elsewhere (Metal and CPU keep MLX's quantized
    matmul, not measured slower); FUSELM_PREFILL_DENSE=N sets N (0: off)."""
    raw = os.environ.get(DENSE_PREFILL_ENV, "").strip()
    if not raw:
        return CUDA_DENSE_ROWS if cuda_device() else 0
    if not raw.isdigit():
        raise RuntimeUserError(f"{DENSE_PREFILL_ENV}={raw!r} is not a row count; use e.g. 256 "
                               "or 0 (off)")
    return int(raw)


ATTEND_SPLIT_ENV = "FUSELM_ATTN_SPLIT"
MAX_SPLITS = 32
# Blocks the split attention aims at: two per SM of an H200 (132 SMs); MLX does not report the
# SM count, and the H200 is the only GPU this was written for.
_TARGET_BLOCKS = 264


def auto_splits(capacity: int, kv_heads: int, head_groups: int) -> int:
    """FUSELM_ATTN_SPLIT=auto's split count: enough blocks (kv_heads x head_groups x splits)
    to fill an H200 twice, at least 64 cache slots a split, at most MAX_SPLITS."""
    by_blocks = _TARGET_BLOCKS // max(1, kv_heads * head_groups)
    return max(1, min(MAX_SPLITS, by_blocks, capacity // 64))


def attend_splits(capacity: int, kv_heads: int, head_groups: int) -> int:
    """Key splits of the decode attention (kernels_cuda.rope_attend): `auto` (default) = N
    from the cache capacity (at least 64 slots a split) and the blocks an H200 fills; 0 = the
    one-block-per-query-head kernel; N >= 1 = the split kernel, each block serving a KV head's
    query heads (K/V read once) over 1/N of the cached keys, the last block of a head group
    merging the N partial softmaxes (flash-decoding in one launch). FUSELM_ATTN_SPLIT=auto|0|N
    selects; the split count depends on the capacity and heads only, never on the batch, so a
    row's result does not depend on its batch."""
    raw = os.environ.get(ATTEND_SPLIT_ENV, "auto").strip().lower()
    if raw == "auto":
        return auto_splits(capacity, kv_heads, head_groups)
    if not raw.isdigit() or int(raw) > MAX_SPLITS:
        raise RuntimeUserError(f"{ATTEND_SPLIT_ENV}={raw!r}: use auto (default), 0 (a block per "
                               f"query head) or a split count 1..{MAX_SPLITS}")
    return int(raw)


def add_rms_norm_fits(x: object, r: object, scale: object, axis: int) -> bool:
    """Same-shape, same-dtype residual Add feeding a last-axis RMSNorm with a 1-D scale."""
    if not all(isinstance(a, mx.array) for a in (x, r, scale)):
        return False
    assert isinstance(x, mx.array) and isinstance(r, mx.array) and isinstance(scale, mx.array)
    return (x.ndim >= 1 and x.shape == r.shape and x.dtype == r.dtype and x.dtype in DTYPES
            and axis % x.ndim == x.ndim - 1 and scale.ndim == 1
            and scale.shape[0] == x.shape[-1])


def rope_attend_fits(q: object, k: object, v: object, norms: tuple[object, object],
                     keys: mx.array, values: mx.array, hq: int, hk: int, head_dim: int,
                     rotary_dim: int) -> bool:
    """One token per batch row (3-D [b, 1, H*D] q/k/v, b = the cache's batch), head_dim a
    multiple of 32 up to 256 for keys and values alike, even rotary width, whole GQA groups,
    cache of the activation dtype, q/k-norm scales (when present) of one head's width."""
    if not all(isinstance(a, mx.array) and a.ndim == 3 and a.shape[:2] == (keys.shape[0], 1)
               for a in (q, k, v)):
        return False
    assert isinstance(q, mx.array) and isinstance(k, mx.array) and isinstance(v, mx.array)
    d = keys.shape[-1]
    if any(n is not None and not (isinstance(n, mx.array) and n.shape == (d,)) for n in norms):
        return False
    return (d == head_dim and values.shape[-1] == d and values.dtype == keys.dtype
            and d % 32 == 0 and d <= 256 and 0 < rotary_dim <= d and rotary_dim % 2 == 0
            and hk > 0 and hq % hk == 0
            and q.shape[2] == hq * d and k.shape[2] == hk * d and v.shape[2] == hk * d
            and keys.dtype in DTYPES and q.dtype == keys.dtype)
