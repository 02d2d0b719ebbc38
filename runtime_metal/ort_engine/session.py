"""onnxruntime sessions for fuselm models, with the Q4 activation precision set explicitly.

onnxruntime fuses our DequantizeLinear(uint4, blocked) + MatMul into `MatMulNBits` when it
creates the session; how that kernel computes is a session option,
`session.qdq_matmulnbits_accuracy_level`. Left unset, onnxruntime picks 4 (int8 activations,
~5e-3 relative error per matmul), so every session we make sets it and reports it:

    0  float compute in the activation type (exact up to summation order; for comparisons)
    1  float32   2  float16   3  bfloat16   4  int8 activations (the fast CPU path)

With `optimize=False` no graph optimization runs: DequantizeLinear + MatMul execute as written
(exact, slow) and the accuracy level has no effect.

Threads: unless asked for a number, a session gets `default_threads()` intra-op threads, one per
physical core this process may run on (llama.cpp's default too; SMT siblings share a core's
matmul units and add nothing to a bandwidth-bound decode), set explicitly and with spinning off.
onnxruntime's own default (one thread per physical core, each pinned to its core, spinning
between ops) stalls whenever another process wants one of those cores: a decode step waits at
every op for the thread whose core is taken (BENCHMARKS.md 'CPU: onnxruntime engine': 159-165 ms
a 28-layer step under load ~3.5). Explicit, the threads are not pinned; not spinning, a thread that
waits gives its core back. onnxruntime-genai's default is hardware threads / 2, which on a
machine without SMT leaves half the cores idle: on the 2-core development VM fuselm's decode is
0.9x genai's at one thread each (the uint4 zero-point kernel) and ~1.5x at its default of two.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

ACCURACY_LEVELS = {0: "unset (float, activation type)", 1: "fp32", 2: "fp16", 3: "bf16", 4: "int8"}
ACCURACY_KEY = "session.qdq_matmulnbits_accuracy_level"
EXTERNAL_DIR_KEY = "session.model_external_initializers_file_folder_path"


OPTIMIZATION_LEVELS = ("all", "extended", "basic", "none")


def _usable_cpus() -> list[int] | None:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # no sched_getaffinity (macOS, Windows)
        return None


def default_threads() -> int:
    """Intra-op threads when none are asked for: the physical cores among the CPUs this process
    may use (Linux topology); elsewhere half the logical CPUs (SMT's usual two per core)."""
    cpus = _usable_cpus()
    if cpus is None:
        return max(1, (os.cpu_count() or 1) // 2)
    cores = set()
    for cpu in cpus:
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(((topo / "physical_package_id").read_text().strip(),
                       (topo / "core_id").read_text().strip()))
        except OSError:  # no topology exposed (some containers): assume SMT pairs
            return max(1, len(cpus) // 2)
    return max(1, len(cores))


def ort_version() -> str:
    """The installed onnxruntime's version."""
    import onnxruntime as ort

    return str(ort.__version__)


def make_session(
    model_path: str | Path | bytes,
    *,
    accuracy_level: int = 4,
    optimize: bool = True,
    threads: int | None = None,
    providers: list[str] | None = None,
    optimization: str | None = None,
    profile_prefix: str | None = None,
    external_data_dir: str | Path | None = None,
    initializers: dict[str, Any] | None = None,
) -> tuple[Any, dict[str, Any]]:
    """Create an `onnxruntime.InferenceSession` and say how it will compute.

    Returns (session, info) where info has accuracy_level, activation_precision, optimize,
    threads, providers and onnxruntime's version. `model_path` may be a serialized model
    (bytes) whose external tensors live in `external_data_dir`, or are given as OrtValues in
    `initializers` (name -> OrtValue, for external tensors of those names). `threads` None or
    0: `default_threads()`.
    """
    import onnxruntime as ort

    if accuracy_level not in ACCURACY_LEVELS:
        raise ValueError(
            f"accuracy_level {accuracy_level} not supported; valid values: "
            + ", ".join(f"{k} ({v})" for k, v in ACCURACY_LEVELS.items())
        )
    levels = {
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "none": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    }
    if optimization is None:  # the boolean form: everything on, or off
        optimization = "all" if optimize else "none"
    if optimization not in levels:
        raise ValueError(
            f"optimization {optimization!r} not supported; valid values: "
            + ", ".join(OPTIMIZATION_LEVELS)
        )
    optimize = optimization != "none"
    so = ort.SessionOptions()
    so.add_session_config_entry(ACCURACY_KEY, str(accuracy_level))
    if external_data_dir is not None:
        so.add_session_config_entry(EXTERNAL_DIR_KEY, os.fspath(external_data_dir))
    if initializers:
        so.add_external_initializers(list(initializers), list(initializers.values()))
    so.graph_optimization_level = levels[optimization]
    if profile_prefix:
        so.enable_profiling = True
        so.profile_file_prefix = profile_prefix
    threads = int(threads) if threads else default_threads()
    so.intra_op_num_threads = threads  # explicit, so onnxruntime does not pin threads to cores
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.log_severity_level = 3  # the fp16 "Cast inserted" / serialization notices are noise here
    providers = providers or ["CPUExecutionProvider"]
    model = model_path if isinstance(model_path, bytes) else os.fspath(model_path)
    session = ort.InferenceSession(model, so, providers=providers)
    info = {
        "engine": "onnxruntime",
        "version": ort_version(),
        "accuracy_level": accuracy_level,
        # Without graph optimizations no MatMulNBits exists, so the level does not apply.
        "activation_precision": ACCURACY_LEVELS[accuracy_level] if optimize else "as written",
        "optimize": optimize,
        "optimization": optimization,
        "threads": threads,
        "providers": session.get_providers(),
    }
    return session, info
