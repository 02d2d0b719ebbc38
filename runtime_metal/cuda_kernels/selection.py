"""Whether the compiled program (mlx_engine/decode.py) calls fuselm's fused CUDA kernels
(runtime_metal/cuda_kernels/sources.py) and, per call, whether a kernel takes the shapes at hand.

RuntimeConfig.kernels (FUSELM_KERNELS) selects: `auto` (default) uses them on MLX's CUDA
backend and never elsewhere; `off` keeps MLX's built-ins everywhere (the plain path the kernels
are tested against); `on` demands them and fails clearly where MLX has no CUDA device. On
Apple GPUs MLX's own SDPA already has a vector kernel that takes the decode mask, so there is
no Metal twin: the plain path runs there.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import cache
from typing import Any

import mlx.core as mx
import numpy as np

from fuselm.config import RuntimeConfig, apply_mlx_settings, resolve
from fuselm.runtime_metal.cuda_kernels import kernel_files
from fuselm.runtime_metal.errors import RuntimeUserError
from fuselm.runtime_metal.kv_cache import KEY_GROUP, KEY_TAIL, KEY_WORDS

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


def enabled(mode: str) -> bool:
    """Resolve a kernel mode (RuntimeConfig.kernels) to on/off for this process's device."""
    if mode == "off":
        return False
    if mode == "on" and not cuda_device():
        raise RuntimeUserError(
            f"FUSELM_KERNELS=on needs MLX's CUDA backend (device here: {mx.default_device()}); "
            "use FUSELM_KERNELS=auto to run MLX's built-in kernels instead")
    return cuda_device()


# How many of a lane's 16-byte weight loads the Q4 GEMV keeps in flight at once: all of them
# when the row takes at most this many a lane (K <= 1,024 x N), else two at a time. More loads
# in flight hide more memory latency on the long rows (a down projection: few output columns,
# so few warps, each reading a long row), at more registers; the result is the same (the sums
# run in the same order). 16 against 2 measured faster or equal on every decode GEMV of the
# H200 (BENCHMARKS.md; kernel_bench.py --unroll measures another count).
Q4_UNROLL = 16


# From how many rows the Q4 GEMV of a decode step runs on tensor cores (q4_gemv's MMA form, for
# float16 / bfloat16 activations), 0 = never. Off by default: the form compiles for sm_90 and
# its indexing matches x @ dequant(W) in an emulation, but it has not yet run on a GPU, so
# neither its results nor its speed are measured; FUSELM_GEMV_MMA=2 turns it on for batched
# steps (the GPU tests in test_kernels.py and `gpu_run.sh batch` with MMA="auto 2 0" measure it).
GEMV_MMA_ROWS = 0
_gemv_mma: list[int] = []  # the process's setting; until configure hands one over, the default's


def use_gemv_mma(setting: int | None) -> None:
    """RuntimeConfig.gemv_mma (FUSELM_GEMV_MMA) for this process from now on: None = auto
    (GEMV_MMA_ROWS), 0 = never, N = from N rows."""
    _gemv_mma[:] = [GEMV_MMA_ROWS if setting is None else setting]


def gemv_mma_rows() -> int:
    """From how many rows the Q4 GEMV runs its tensor-core form (0: never)."""
    if not _gemv_mma:
        use_gemv_mma(resolve().gemv_mma)
    return _gemv_mma[0]

# Whether the decode step's fused attention reads a quantized KV cache itself (the 8- and 4-bit
# forms of sources.py's split kernel). Off by default: both compile for sm_90 (every variant,
# cuda_compile_check.py) and their index math matches the MLX path in a numpy emulation, but
# they have not yet run on a GPU, so neither their results nor their speed are measured;
# FUSELM_KV_ATTN=on turns them on (test_kv_kernels.py's GPU tests and `gpu_run.sh kvbench`
# measure them). Off, a quantized cache takes MLX's ops, as before.
QUANT_KV_ATTN = False
_kv_attn: list[bool] = []  # the process's setting; until configure hands one over, the default's


def use_kv_attn(setting: str) -> None:
    """RuntimeConfig.kv_attn (FUSELM_KV_ATTN) for this process from now on: "auto" =
    QUANT_KV_ATTN, "on", "off"."""
    _kv_attn[:] = [QUANT_KV_ATTN if setting == "auto" else setting == "on"]


def kv_attn() -> bool:
    """Whether the fused attention takes a quantized KV cache."""
    if not _kv_attn:
        use_kv_attn(resolve().kv_attn)
    return _kv_attn[0]


def configure(config: RuntimeConfig) -> None:
    """The process-wide settings, before an engine loads its weights: the folder of the kernel
    headers, and on MLX's CUDA backend MLX's launches per CUDA graph (MLX reads it once, at the
    first GPU evaluation of the process; Metal, which reads the same variable for its command
    buffers, and CPU are left alone)."""
    kernel_files.use_folder(config.kernel_folder())
    use_gemv_mma(config.gemv_mma)
    use_kv_attn(config.kv_attn)
    if cuda_device():
        apply_mlx_settings(config)


# MLX-CUDA's quantized matmul for many rows runs well below a dense GEMM: dequantizing each
# weight inside the call (a transient) and running MLX's dense matmul doubled prefill on the
# H200 (Qwen3-0.6B Q4 float16, 2,048 tokens: 149k vs 80k tok/s; BENCHMARKS.md 'Long prompts').
CUDA_DENSE_ROWS = 256


def dense_prefill_rows(setting: int | None) -> int:
    """From how many rows a Q4 matmul dequantizes its weight (a transient, inside the call)
    and runs a dense matmul instead of MLX's quantized matmul; 0 = never. setting
    (RuntimeConfig.prefill_dense) None = auto: from CUDA_DENSE_ROWS rows on MLX-CUDA, never
    elsewhere (Metal and CPU keep MLX's quantized matmul, not measured slower)."""
    if setting is None:
        return CUDA_DENSE_ROWS if cuda_device() else 0
    return setting


MAX_SPLITS = 32
# Blocks the split attention aims at: two per SM of an H200 (132 SMs); MLX does not report the
# SM count, and the H200 is the only GPU this was written for.
_TARGET_BLOCKS = 264


def auto_splits(capacity: int, kv_heads: int, head_groups: int) -> int:
    """Key splits of the decode attention (kernels_cuda.rope_attend; FUSELM_ATTN_SPLIT=auto,
    the default): enough blocks (kv_heads x head_groups x splits) to fill an H200 twice, at
    least 64 cache slots a split, at most MAX_SPLITS. Each block serves a KV head's query heads
    (K/V read once) over 1/N of the cached keys, the last block of a head group merging the N
    partial softmaxes (flash-decoding in one launch). The count depends on the capacity and
    heads only, never on the batch, so a row's result does not depend on its batch."""
    by_blocks = _TARGET_BLOCKS // max(1, kv_heads * head_groups)
    return max(1, min(MAX_SPLITS, by_blocks, capacity // 64))


def add_rms_norm_fits(x: object, r: object, scale: object, axis: int) -> bool:
    """Same-shape, same-dtype residual Add feeding a last-axis RMSNorm with a 1-D scale."""
    if not all(isinstance(a, mx.array) for a in (x, r, scale)):
        return False
    assert isinstance(x, mx.array) and isinstance(r, mx.array) and isinstance(scale, mx.array)
    return (x.ndim >= 1 and x.shape == r.shape and x.dtype == r.dtype and x.dtype in DTYPES
            and axis % x.ndim == x.ndim - 1 and scale.ndim == 1
            and scale.shape[0] == x.shape[-1])


def _q8_cache(buf: tuple[object, ...], head_dim: int) -> tuple[tuple[int, ...], mx.Dtype] | None:
    """An 8-bit cache buffer's (leading shape, scales' dtype) when the kernel takes it: the
    triple kv_cache.KVQuant makes at bits 8 (codes uint32 [.., head_dim / 4], scales and biases
    of one float dtype [.., head_dim / group]) with a group of 32, 64 or 128 values dividing
    head_dim that holds whole lanes' shares (head_dim / 32 values a lane; a power-of-two
    head_dim always does); else None (a 4-bit cache: its keys per channel are four arrays, its
    values 4-bit codes)."""
    if len(buf) != 3 or not all(isinstance(a, mx.array) and a.ndim == 4 for a in buf):
        return None
    codes, scales, biases = buf
    assert isinstance(codes, mx.array) and isinstance(scales, mx.array)
    assert isinstance(biases, mx.array)
    groups = scales.shape[-1]
    if (codes.dtype != mx.uint32 or codes.shape[-1] * 4 != head_dim or groups == 0
            or scales.shape != biases.shape or scales.dtype != biases.dtype
            or scales.shape[:3] != codes.shape[:3] or scales.dtype not in DTYPES
            or head_dim % groups):
        return None
    group = head_dim // groups
    if group not in (32, 64, 128) or head_dim % 32 or group % (head_dim // 32):
        return None
    return codes.shape[:3], scales.dtype


def _q4_cache(keys: tuple[object, ...], values: tuple[object, ...], head_dim: int,
              table: mx.array | None, tails: mx.array | None
              ) -> tuple[tuple[int, ...], mx.Dtype] | None:
    """A 4-bit cache's (values' leading shape, dtype) when the kernel's 4-bit form takes it:
    per-channel keys as kv_cache.key_groups_zeros makes them (a block pool:
    key_blocks_zeros', one group a block, with int32 tail slots `tails` [table rows]), values
    4-bit codes per token of one group size 32, 64 or 128 (mx.quantize's triple), all of one
    float dtype, head_dim a power of two from 32 to 256 (a lane's values in one code word);
    else None."""
    if len(keys) != 4 or len(values) != 3 or not all(
            isinstance(a, mx.array) and a.ndim == 4 for a in (*keys, *values)):
        return None
    kp, ks, kb, kt = keys
    vp, vs, vb = values
    assert isinstance(kp, mx.array) and isinstance(ks, mx.array) and isinstance(kb, mx.array)
    assert isinstance(kt, mx.array) and isinstance(vp, mx.array) and isinstance(vs, mx.array)
    assert isinstance(vb, mx.array)
    d, dtype, kg = head_dim, ks.dtype, ks.shape[-1]
    if (d & (d - 1) or not 32 <= d <= 256 or dtype not in DTYPES
            or any(a.dtype != dtype for a in (kb, kt, vs, vb))
            or kp.dtype != mx.uint32 or vp.dtype != mx.uint32
            or kp.shape != (*ks.shape[:3], kg * KEY_WORDS) or kb.shape != ks.shape
            or ks.shape[2] != d or kt.shape[1:] != (ks.shape[1], KEY_TAIL, d)
            or vp.shape[-1] * 8 != d or vs.shape != vb.shape or vs.shape[:3] != vp.shape[:3]
            or vs.shape[-1] == 0 or d % vs.shape[-1] or vp.shape[1] != ks.shape[1]):
        return None
    if d // vs.shape[-1] not in (32, 64, 128):
        return None
    if table is None:  # one buffer a row: every position's group, and the spare
        ok = (tails is None and ks.shape[0] == vp.shape[0] == kt.shape[0]
              and kg == vp.shape[2] // KEY_GROUP + 1 and vp.shape[2] % KEY_GROUP == 0)
    else:  # a block a group (and the pool's sink block), a tail slot a row
        ok = (isinstance(tails, mx.array) and tails.dtype == mx.int32
              and tails.shape == (table.shape[0],) and kg == 1
              and vp.shape[2] == KEY_GROUP and ks.shape[0] == vp.shape[0] + 1)
    return (vp.shape[:3], dtype) if ok else None


def rope_attend_fits(q: object, k: object, v: object, norms: tuple[object, object],
                     keys: mx.array | tuple[object, ...], values: mx.array | tuple[object, ...],
                     hq: int, hk: int, head_dim: int, rotary_dim: int,
                     table: mx.array | None = None, tails: mx.array | None = None) -> bool:
    """One token per batch row (3-D [b, 1, H*D] q/k/v, b = the cache's batch, or the block
    table's rows: int32 [b, W] over pools of power-of-two blocks), head_dim a multiple of 32
    up to 256 for keys and values alike, even rotary width, whole GQA groups, cache of the
    activation dtype, 8-bit (_q8_cache: keys and values alike, scales of the activation
    dtype) or 4-bit (_q4_cache; `tails` with a block table: its rows' tail slots), q/k-norm
    scales (when present) of one head's width. A 4-bit cache's kernel writes no key group:
    only for a step that completes none (the caller knows). A quantized cache only with
    FUSELM_KV_ATTN on (kv_attn)."""
    if (isinstance(keys, tuple) or isinstance(values, tuple)) and not kv_attn():
        return False
    if isinstance(keys, tuple) and len(keys) == 4:
        if not isinstance(values, tuple):
            return False
        found = _q4_cache(keys, values, head_dim, table, tails)
        if found is None:
            return False
        lead, dtype, d = found[0], found[1], head_dim
    elif isinstance(keys, tuple) or isinstance(values, tuple):
        if not (isinstance(keys, tuple) and isinstance(values, tuple)):
            return False
        kq, vq = _q8_cache(keys, head_dim), _q8_cache(values, head_dim)
        if kq is None or kq != vq or keys[1].shape != values[1].shape:  # type: ignore[union-attr]
            return False
        lead, dtype, d = kq[0], kq[1], head_dim
    else:
        lead, dtype, d = keys.shape[:3], keys.dtype, keys.shape[-1]
        if values.shape[-1] != d or values.dtype != dtype:
            return False
    rows = lead[0]
    if table is not None:
        bs = lead[2]
        if table.ndim != 2 or table.dtype != mx.int32 or bs & (bs - 1):
            return False
        rows = table.shape[0]
    if not all(isinstance(a, mx.array) and a.ndim == 3 and a.shape[:2] == (rows, 1)
               for a in (q, k, v)):
        return False
    assert isinstance(q, mx.array) and isinstance(k, mx.array) and isinstance(v, mx.array)
    if any(n is not None and not (isinstance(n, mx.array) and n.shape == (d,)) for n in norms):
        return False
    return (d == head_dim and d % 32 == 0 and d <= 256 and 0 < rotary_dim <= d
            and rotary_dim % 2 == 0 and hk > 0 and hq % hk == 0
            and q.shape[2] == hq * d and k.shape[2] == hk * d and v.shape[2] == hk * d
            and dtype in DTYPES and q.dtype == dtype)
