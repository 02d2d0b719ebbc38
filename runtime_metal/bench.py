"""llama-bench figures for a converted model: pp (prefill tokens/s for a p-token prompt) and tg
(decode tokens/s over n new tokens), warm-up first, then median and spread of r runs.

One run = one greedy generation through the generation loop the CLI uses (generate.py): pp is
p / (time to the first new token), tg is (n - 1) / (time from the first to the n-th new token),
the definitions mlx-lm's generate reports, so the figures compare with it.
"""

from __future__ import annotations

import resource
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fuselm.runtime_metal.engine import resolve_engine
from fuselm.runtime_metal.errors import RuntimeUserError
from fuselm.runtime_metal.generate import generate_steps
from fuselm.runtime_metal.loaded_model import open_model
from fuselm.runtime_metal.sampling import SamplingOptions, make_device_sampler, make_sampler


@dataclass
class Stat:
    median: float
    min: float
    max: float
    stdev: float
    runs: list[float]

    @classmethod
    def of(cls, xs: list[float]) -> Stat:
        return cls(statistics.median(xs), min(xs), max(xs),
                   statistics.stdev(xs) if len(xs) > 1 else 0.0, xs)


@dataclass
class BenchResult:
    pp: float  # median prefill tokens/s
    tg: float  # median decode tokens/s
    pp_stats: Stat
    tg_stats: Stat
    prompt_tokens: int
    new_tokens: int
    runs: int
    engine: dict[str, Any]
    device: dict[str, Any]
    peak_memory_bytes: int
    peak_memory_source: str
    ms_per_token: float
    profile: list[dict[str, Any]] | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    speculative: dict[str, Any] | None = None  # drafter, num_draft, drafted, accepted

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def device_info() -> dict[str, Any]:
    """MLX's default device, and the GPU's name where there is one (Metal or CUDA)."""
    import mlx.core as mx

    out: dict[str, Any] = {"mlx_device": str(mx.default_device())}
    try:
        info = mx.device_info()
        out.update({k: v for k, v in info.items() if isinstance(v, str | int | float)})
    except Exception:  # noqa: BLE001 - older MLX or no device query
        pass
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available() and shutil.which("nvidia-smi"):
        try:
            name = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                  capture_output=True, text=True, timeout=10).stdout
            out["gpu"] = name.strip().splitlines()[0] if name.strip() else None
        except (OSError, subprocess.SubprocessError):
            pass
    elif mx.metal.is_available():
        out["gpu"] = out.get("device_name")
    return out


def peak_memory(engine_name: str) -> tuple[int, str]:
    import mlx.core as mx

    if engine_name == "mlx":
        return int(mx.get_peak_memory()), "mx.get_peak_memory"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss * (1 if sys.platform == "darwin" else 1024)), "max RSS (process)"


def timed_generation(engine: Any, prompt: list[int], n: int, chunk: int | None,
                     on_token: Callable[[int], None] | None = None,
                     timings: dict[str, float] | None = None,
                     **speculative: Any) -> tuple[float, float]:
    """One greedy generation of n tokens; returns (pp, tg) in tokens/s. `on_token(count)`
    after each token (progress); `speculative`: generate_steps' drafter and num_draft (its
    drafted / accepted counts go into `timings`)."""
    opts = SamplingOptions()
    timings = timings if timings is not None else {}
    device = make_device_sampler(opts) if engine.device_loop else None
    count = 0
    for _ in generate_steps(engine, prompt, max_new_tokens=n, sampler=make_sampler(opts),
                            prefill_chunk=chunk, timings=timings, device_sampler=device,
                            **speculative):
        count += 1
        if on_token is not None:
            on_token(count)
    pp = len(prompt) / timings["prefill"]
    tg = (count - 1) / timings["decode"] if count > 1 and timings.get("decode") else 0.0
    return pp, tg


def check_fits(p: int, n: int, context_length: int) -> None:
    """A p-token prompt and n new tokens must fit the model's context: beyond it the positions
    are ones the model was never built for (and `run` refuses such a prompt), so the figures
    would time a model that does not exist, at the cost of a quadratic prefill."""
    if p + n > context_length:
        raise RuntimeUserError(
            f"bench -p {p} -n {n} needs {p + n} positions but the model's context is "
            f"{context_length}; choose -p + -n <= {context_length}")


def run_bench(out_dir: str | Path, p: int = 512, n: int = 128, r: int = 5,
              engine: str = "auto", warmup: int = 1, profile: bool = False,
              prefill_chunk: int | None = None, seed: int = 0,
              on_run: Callable[[int, int], None] | None = None,
              speculative: dict[str, Any] | None = None,
              **engine_options: Any) -> BenchResult:
    """on_run(done, total) after each run, warm-up included (progress). speculative: the
    generation options of speculative decoding (drafter, num_draft), for every run."""
    speculative = speculative or {}
    if p < 1 or n < 2 or r < 1:
        raise ValueError("bench needs -p >= 1, -n >= 2, -r >= 1")
    name = resolve_engine(engine)
    t0 = time.perf_counter()
    model = open_model(out_dir, name, defer_engine=True, **engine_options)
    check_fits(p, n, model.manifest.model.context_length)  # before the engine's load
    eng = model.engine
    load_s = time.perf_counter() - t0
    vocab = model.manifest.model.vocab_size
    prompt = [int(i) for i in np.random.default_rng(seed).integers(0, vocab, size=p)]
    for i in range(warmup):
        eng.reset()
        timed_generation(eng, prompt, n, prefill_chunk, **speculative)
        if on_run is not None:
            on_run(i + 1, warmup + r)
    pps, tgs = [], []
    counts: dict[str, float] = {}
    for i in range(r):
        eng.reset()
        timings: dict[str, float] = {}
        pp, tg = timed_generation(eng, prompt, n, prefill_chunk, timings=timings,
                                  **speculative)
        for key in ("drafted", "accepted"):
            counts[key] = counts.get(key, 0) + timings.get(key, 0)
        pps.append(pp)
        tgs.append(tg)
        if on_run is not None:
            on_run(warmup + i + 1, warmup + r)
    mem, source = peak_memory(name)
    rows = None
    if profile:
        rows = profile_rows(out_dir, name, prompt, min(n, 8), prefill_chunk)
    tg_s = Stat.of(tgs)
    return BenchResult(
        pp=Stat.of(pps).median, tg=tg_s.median, pp_stats=Stat.of(pps), tg_stats=tg_s,
        prompt_tokens=p, new_tokens=n, runs=r, engine=eng.describe(), device=device_info(),
        peak_memory_bytes=mem, peak_memory_source=source,
        ms_per_token=1e3 / tg_s.median if tg_s.median else 0.0, profile=rows,
        seconds={"load": load_s, "total": time.perf_counter() - t0},
        speculative={"drafter": speculative["drafter"].name,
                     "num_draft": speculative["num_draft"],
                     **{k: int(v) for k, v in counts.items()}} if speculative else None)


def profile_rows(out_dir: str | Path, name: str, prompt: list[int], n: int, chunk: int | None,
                 on_token: Callable[[int], None] | None = None) -> list[dict[str, Any]]:
    """Per-op time of the MLX executor (node by node, warm-up passes skipped); `on_token`:
    timed_generation's."""
    from fuselm.runtime_metal.mlx_engine.profile import Profiler

    if name != "mlx":
        raise ValueError("--profile times the MLX engine's nodes; use --engine mlx")
    prof = Profiler()
    eng = open_model(out_dir, "mlx", profiler=prof).engine
    timed_generation(eng, prompt, n, chunk, on_token)
    return prof.by_op()


def table(res: BenchResult) -> str:
    e, d = res.engine, res.device
    lines = [
        f"engine {e.get('engine')} ({e.get('decode', '-')}), device "
        f"{d.get('gpu') or d.get('device_name') or d.get('mlx_device')}",
        f"{'test':<10}{'t/s median':>12}{'min':>10}{'max':>10}{'stdev':>10}",
    ]
    for label, s in ((f"pp{res.prompt_tokens}", res.pp_stats), (f"tg{res.new_tokens}",
                                                                 res.tg_stats)):
        lines.append(f"{label:<10}{s.median:>12.2f}{s.min:>10.2f}{s.max:>10.2f}{s.stdev:>10.2f}")
    lines.append(f"decode {res.ms_per_token:.3f} ms/token; peak memory "
                 f"{res.peak_memory_bytes / 2**20:.1f} MiB ({res.peak_memory_source}); "
                 f"{res.runs} runs after warm-up")
    return "\n".join(lines)
