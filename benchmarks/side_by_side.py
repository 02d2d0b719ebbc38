"""fuselm's runtime and mlx-lm side by side, in one process, on the same random-weight checkpoint
quantized the same way (4-bit affine, group G, embeddings and LM head included: mlx-lm's
default set), llama-bench figures: warm-up, then the median of r runs of pp (p-token prompt)
and tg (n new tokens), the ratios fuselm / mlx-lm, decode ms/token against the bandwidth floor
(weight bytes / measured device copy bandwidth), and ONNX step counts. Runs unchanged on CPU
(small sizes), Metal and CUDA.

    python benchmarks/side_by_side.py --shape tiny -p 64 -n 32 -r 3
    python benchmarks/side_by_side.py --shape qwen3-0.6b -p 512 -n 128 -r 5 --group-size 32 \
        --json-out sbs_qwen3_g32.json
    python benchmarks/side_by_side.py --checkpoint /path/to/hf_dir ...

Both systems time the same thing the same way: pp = p / (time to the first new token), tg =
(n - 1) / (time from the first to the n-th new token), one greedy generation per run. mlx-lm
runs its own `generate_step` (what `mlx_lm.generate` / `stream_generate` drive; its prompt
pre-fill, sampler and `mx.async_eval` pipelining); fuselm runs its generation loop
(runtime_metal/generate.py: chunked prefill, then the compiled decode step, pipelined). The runs
alternate between the systems so drift hits both alike. Activations: `--dtype auto` is float16
on a GPU and float32 on CPU (MLX's CPU backend is slow in half precision), the same for both.

Separate processes (`--separate R`, what `benchmarks/gpu_run.sh sbs` runs): one process per
system and round, the systems alternating (fuselm, mlx-lm, then mlx-lm, fuselm, ...), R rounds;
each process loads its system alone, warms up, then times -r generations (and, with
`--pp-extra 2048 8192`, -r prefills of each longer prompt); medians and min-max are over all
rounds' runs. One process that holds both systems can favour one of them (allocator and
compile caches, the order of warm-ups): a cross-process check once read 335 vs 251 tok/s
where the one-process table read 393 vs 209.

    python benchmarks/side_by_side.py --shape qwen3-0.6b --group-size 32 -p 512 -n 128 -r 3 \
        --separate 3 --pp-extra 2048 8192 --json-out sbs.json

Kernel launches per decode step (NVIDIA, Nsight Compute). `--count-launches SYSTEM --steps K`
loads one system, prefills, decodes W warm-up steps (compiling), then K counted steps between
NVTX range "count_decode" pushes (libnvToolsExt through ctypes, when it is found). Run each
system at two step counts and difference them, which needs no NVTX at all
(`benchmarks/gpu_run.sh ncu SHAPE GROUP` does exactly this):

    W=/tmp/sbs; S="--shape qwen3-0.6b --group-size 32 --work $W -p 8"
    python benchmarks/side_by_side.py $S -r 1 -n 8        # builds + converts once
    for sys in fuselm mlx-lm; do for k in 1 2; do
      ncu --csv --clock-control none --metrics gpu__time_duration.sum \
        --log-file $W/ncu_${sys}_$k.csv \
        python benchmarks/side_by_side.py $S --count-launches $sys --steps $k
    done; done
    python benchmarks/side_by_side.py --launches-from-ncu $W/ncu_fuselm_1.csv \
        $W/ncu_fuselm_2.csv $W/ncu_mlx-lm_1.csv $W/ncu_mlx-lm_2.csv --steps 1 2

ncu profiles every kernel (~15-25 ms each), so a run costs roughly 20 ms x kernels: on the H200
(2026-12-01) the four runs for the Qwen3-0.6B shape took 166 s together (2,599 / 2,950
kernels for fuselm, 2,759 / 3,300 for mlx-lm). The NVTX range was absent there (no
libnvToolsExt on that image).

launches/step = (kernels(K=b) - kernels(K=a)) / (b - a), where kernels = distinct ncu "ID"s (every
kernel, also those inside CUDA graphs, which ncu profiles node by node). With NVTX found, the
counted range alone is also selectable: `ncu --nvtx --nvtx-include "count_decode/" ...`.
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import ctypes.util
import importlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SHAPES = ("tiny", "qwen3-0.6b", "llama-3.2-1b")


# ---- checkpoints and conversions ---------------------------------------------------------------

def shape_config(shape: str) -> tuple[str, dict[str, Any]]:
    from fuselm.converter.models.builtin import LLAMA_3_2_1B, QWEN3_0_6B, TINY

    return {"tiny": ("qwen3", dict(TINY)), "qwen3-0.6b": ("qwen3", dict(QWEN3_0_6B)),
            "llama-3.2-1b": ("llama", dict(LLAMA_3_2_1B))}[shape]


def ensure_checkpoint(work: Path, shape: str, checkpoint: str | None) -> Path:
    if checkpoint:
        return Path(checkpoint)
    hf = work / shape / "hf"
    if not (hf / "config.json").is_file():
        from fuselm.converter.models.builtin import build_model

        family, cfg = shape_config(shape)
        t = time.perf_counter()
        # bf16, like real checkpoints (fuselm keeps half precision as float16)
        build_model(hf, family, seed=0, dtype="bfloat16", **cfg)
        log(f"built random {shape} checkpoint in {time.perf_counter() - t:.0f} s: {hf}")
    return hf


def ensure_fuselm(hf: Path, out: Path, group: int, dtype: str, method: str = "search"
                  ) -> Path:
    if not (out / "fuselm.json").is_file():
        from fuselm.converter.pipeline import ConvertOptions, convert

        t = time.perf_counter()
        # no calibration: speed does not depend on the scales, and it costs device-machine time
        convert(hf, out, ConvertOptions.from_flags(dtype=dtype, quant="q4", block_size=group,
                                                   quant_lm_head=True, quant_embeddings=True,
                                                   quant_method=method, default_calibration=False))
        log(f"fuselm convert (q4, block {group}, {dtype}) in {time.perf_counter() - t:.0f} s")
    return out


def ensure_mlx_lm(hf: Path, out: Path, group: int, dtype: str) -> Path:
    if not (out / "config.json").is_file():
        convert = importlib.import_module("mlx_lm.convert").convert
        t = time.perf_counter()
        convert(str(hf), str(out), quantize=True, q_group_size=group, q_bits=4, dtype=dtype)
        log(f"mlx_lm.convert (q4, group {group}, {dtype}) in {time.perf_counter() - t:.0f} s")
    return out


def shape_label(args: argparse.Namespace) -> str:
    """--shape, or the checkpoint's folder (its parent when the folder is named hf)."""
    if not args.checkpoint:
        return args.shape
    ck = Path(args.checkpoint).resolve()
    return ck.parent.name if ck.name == "hf" else ck.name


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- the two systems, behind one small interface ------------------------------------------------

class Fuselm:
    name = "fuselm"

    def __init__(self, out_dir: Path, engine: str = "mlx", chunk: int = 2048) -> None:
        from fuselm.runtime_metal.engine import make_engine

        self.engine = make_engine(out_dir, engine)
        self.chunk = chunk  # prefill chunk (mlx-lm's generate_step: prefill_step_size 2048)

    def generate(self, prompt: list[int], n: int) -> tuple[float, float]:
        from fuselm.runtime_metal.bench import timed_generation

        self.engine.reset()
        return timed_generation(self.engine, prompt, n, self.chunk)

    def prefill(self, prompt: list[int]) -> int:
        import numpy as np

        self.engine.reset()
        return int(np.argmax(self.engine.forward(np.asarray([prompt]))))

    def decode(self, token: Any, steps: int, split: dict[str, float] | None = None) -> Any:
        """split: adds the host seconds spent building the steps' graphs ("build") and in
        mx.async_eval ("dispatch": MLX encoding and launching them)."""
        import mlx.core as mx

        y = mx.array(token, mx.uint32)  # the argmax dtype: one compiled trace
        for _ in range(steps):
            t0 = time.perf_counter()
            y = mx.argmax(self.engine.decode_step(y))
            t1 = time.perf_counter()
            mx.async_eval(y)
            if split is not None:
                split["build"] += t1 - t0
                split["dispatch"] += time.perf_counter() - t1
        return y

    def weight_bytes(self) -> int:
        from fuselm.runtime_metal.mlx_engine.qweight import held_bytes

        return held_bytes(self.engine.plan.constants)

    def describe(self) -> dict[str, Any]:
        d = dict(self.engine.describe())
        plan = getattr(self.engine, "plan", None)
        if plan is not None and getattr(self.engine, "fast", None) is not None:
            d["decode_program_ops"] = len(self.engine.fast.program.ops)
        return d


class MlxLm:
    name = "mlx-lm"

    def __init__(self, mlx_dir: Path) -> None:
        from mlx_lm import load

        self.model, _ = load(str(mlx_dir))
        self.gen = importlib.import_module("mlx_lm.generate")

    def generate(self, prompt: list[int], n: int) -> tuple[float, float]:
        import mlx.core as mx

        t0 = time.perf_counter()
        steps = self.gen.generate_step(mx.array(prompt), self.model, max_tokens=n)
        next(steps)
        t1 = time.perf_counter()
        count = 1 + sum(1 for _ in steps)
        t2 = time.perf_counter()
        return len(prompt) / (t1 - t0), (count - 1) / (t2 - t1)

    def prefill(self, prompt: list[int]) -> int:
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        self.cache = make_prompt_cache(self.model)
        logits = self.model(mx.array(prompt)[None], cache=self.cache)
        return int(mx.argmax(logits[0, -1]).item())

    def decode(self, token: Any, steps: int, split: dict[str, float] | None = None) -> Any:
        # generate_step's per-token work: model call, logsumexp (logprobs), greedy sampler
        import mlx.core as mx

        y = mx.array([token])
        for _ in range(steps):
            t0 = time.perf_counter()
            logits = self.model(y[None], cache=self.cache)[:, -1, :]
            logprobs = logits - mx.logsumexp(logits, keepdims=True)
            y = mx.argmax(logprobs, axis=-1)
            t1 = time.perf_counter()
            mx.async_eval(y, logprobs)
            if split is not None:
                split["build"] += t1 - t0
                split["dispatch"] += time.perf_counter() - t1
        return y

    def weight_bytes(self) -> int:
        from mlx.utils import tree_flatten

        return sum(v.nbytes for _, v in tree_flatten(self.model.parameters()))

    def describe(self) -> dict[str, Any]:
        import mlx.core as mx

        return {"engine": "mlx-lm", "device": str(mx.default_device())}


# ---- measurements -------------------------------------------------------------------------------

def copy_bandwidth(nbytes: int) -> float:
    """Bytes/s moved by a large elementwise copy on the default device (read + write)."""
    import mlx.core as mx

    a = mx.random.uniform(shape=(nbytes // 4,))
    mx.eval(a)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        b = a + 1.0
        mx.eval(b)
        best = min(best, time.perf_counter() - t)
        del b
    return 2 * a.nbytes / best


def versions() -> dict[str, str]:
    from importlib import metadata

    out = {}
    for pkg in ("mlx", "mlx-lm", "onnx", "onnxruntime", "torch", "transformers"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    out["python"] = sys.version.split()[0]
    return out


def side_by_side(args: argparse.Namespace, hf: Path, fl_dir: Path, mlx_dir: Path
                 ) -> dict[str, Any]:
    import mlx.core as mx
    import numpy as np

    from fuselm.runtime_metal.bench import Stat, device_info

    systems = [Fuselm(fl_dir, args.fuselm_engine, args.prefill_chunk), MlxLm(mlx_dir)]
    vocab = json.loads((hf / "config.json").read_text())["vocab_size"]
    prompt = [int(i) for i in np.random.default_rng(0).integers(0, vocab, size=args.p)]
    results: dict[str, dict[str, list[float]]] = {s.name: {"pp": [], "tg": []} for s in systems}
    for s in systems:  # warm-up: compile, allocate, trace
        for _ in range(args.warmup):
            s.generate(prompt, args.n)
    for _ in range(args.r):
        for s in systems:
            pp, tg = s.generate(prompt, args.n)
            results[s.name]["pp"].append(pp)
            results[s.name]["tg"].append(tg)
    big = 256 << 20 if mx.default_device().type == mx.gpu else 64 << 20
    bw = copy_bandwidth(big)
    out: dict[str, Any] = {
        "shape": shape_label(args), "checkpoint": str(hf), "p": args.p, "n": args.n, "r": args.r,
        "group_size": args.group_size, "dtype": args.dtype_resolved, "bits": 4,
        "device": device_info(), "versions": versions(), "copy_bandwidth_GBps": bw / 1e9,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "systems": {},
    }
    for s in systems:
        pp, tg = Stat.of(results[s.name]["pp"]), Stat.of(results[s.name]["tg"])
        wb = s.weight_bytes()
        floor_ms = wb / bw * 1e3
        ms = 1e3 / tg.median if tg.median else float("nan")
        out["systems"][s.name] = {
            "pp": pp.median, "tg": tg.median, "pp_stats": pp.__dict__, "tg_stats": tg.__dict__,
            "ms_per_token": ms, "weight_bytes": wb, "floor_ms_per_token": floor_ms,
            "floor_fraction": floor_ms / ms if ms == ms else None, "engine": s.describe()}
    f, m = out["systems"]["fuselm"], out["systems"]["mlx-lm"]
    out["ratio"] = {"pp": f["pp"] / m["pp"], "tg": f["tg"] / m["tg"]}
    out["pp"], out["tg"] = f["pp"], f["tg"]
    return out


def _prompt(hf: Path, n: int, seed: int = 0) -> list[int]:
    import numpy as np

    vocab = json.loads((hf / "config.json").read_text())["vocab_size"]
    return [int(i) for i in np.random.default_rng(seed).integers(0, vocab, size=n)]


def worker(args: argparse.Namespace, hf: Path, fl_dir: Path, mlx_dir: Path) -> dict[str, Any]:
    """One system in this process (--only): warm-up, -r timed generations, -r prefills of each
    --pp-extra length."""
    from fuselm.runtime_metal.bench import device_info

    system = (Fuselm(fl_dir, args.fuselm_engine, args.prefill_chunk) if args.only == "fuselm"
              else MlxLm(mlx_dir))
    prompt = _prompt(hf, args.p)
    longer = {n: _prompt(hf, n, seed=n) for n in args.pp_extra}
    for _ in range(args.warmup):
        system.generate(prompt, args.n)
    for p in longer.values():
        system.generate(p, 2)  # traces/allocates the longer prompt's chunk shapes
    pp, tg = [], []
    for _ in range(args.r):
        a, b = system.generate(prompt, args.n)
        pp.append(a)
        tg.append(b)
    extra = {str(n): [system.generate(p, 2)[0] for _ in range(args.r)]
             for n, p in longer.items()}
    return {"system": system.name, "pp": pp, "tg": tg, "pp_extra": extra,
            "weight_bytes": system.weight_bytes(), "engine": system.describe(),
            "device": device_info()}


def separate(args: argparse.Namespace, hf: Path) -> dict[str, Any]:
    """Each system in its own process per round, alternating; see the module doc."""
    import subprocess
    import tempfile

    import mlx.core as mx

    from fuselm.runtime_metal.bench import Stat, device_info

    names = ["fuselm", "mlx-lm"]
    runs: dict[str, dict[str, Any]] = {}
    order_log = []
    base = [sys.executable, str(Path(__file__).resolve()), "--shape", args.shape, "--work",
            args.work, "-p", str(args.p), "-n", str(args.n), "-r", str(args.r), "--warmup",
            str(args.warmup), "--group-size", str(args.group_size), "--dtype",
            args.dtype_resolved, "--fuselm-engine", args.fuselm_engine,
            "--prefill-chunk", str(args.prefill_chunk)]
    if args.checkpoint:
        base += ["--checkpoint", args.checkpoint]
    if args.pp_extra:
        base += ["--pp-extra", *map(str, args.pp_extra)]
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.separate):
            for name in names if r % 2 == 0 else names[::-1]:
                out = Path(tmp) / f"{name}_{r}.json"
                t = time.perf_counter()
                subprocess.run([*base, "--only", name, "--json-out", str(out)], check=True)
                got = json.loads(out.read_text())
                log(f"round {r} {name}: pp {statistics.median(got['pp']):.1f} tg "
                    f"{statistics.median(got['tg']):.1f} ({time.perf_counter() - t:.0f} s)")
                order_log.append(name)
                acc = runs.setdefault(name, {"pp": [], "tg": [], "pp_extra": {}, "last": got})
                acc["pp"] += got["pp"]
                acc["tg"] += got["tg"]
                for n, v in got["pp_extra"].items():
                    acc["pp_extra"].setdefault(n, []).extend(v)
                acc["last"] = got
    big = 256 << 20 if mx.default_device().type == mx.gpu else 64 << 20
    bw = copy_bandwidth(big)
    out: dict[str, Any] = {
        "shape": shape_label(args), "checkpoint": str(hf), "p": args.p, "n": args.n, "r": args.r,
        "rounds": args.separate, "mode": "separate processes, alternating",
        "order": order_log, "group_size": args.group_size, "dtype": args.dtype_resolved,
        "bits": 4, "device": device_info(), "versions": versions(),
        "copy_bandwidth_GBps": bw / 1e9, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "systems": {}}
    for name, acc in runs.items():
        pp, tg = Stat.of(acc["pp"]), Stat.of(acc["tg"])
        wb = acc["last"]["weight_bytes"]
        floor_ms = wb / bw * 1e3
        ms = 1e3 / tg.median if tg.median else float("nan")
        out["systems"][name] = {
            "pp": pp.median, "tg": tg.median, "pp_stats": pp.__dict__, "tg_stats": tg.__dict__,
            "pp_extra": {n: Stat.of(v).__dict__ for n, v in acc["pp_extra"].items()},
            "ms_per_token": ms, "weight_bytes": wb, "floor_ms_per_token": floor_ms,
            "floor_fraction": floor_ms / ms if ms == ms else None,
            "engine": acc["last"]["engine"]}
    f, m = out["systems"]["fuselm"], out["systems"]["mlx-lm"]
    out["ratio"] = {"pp": f["pp"] / m["pp"], "tg": f["tg"] / m["tg"],
                    **{f"pp{n}": f["pp_extra"][n]["median"] / m["pp_extra"][n]["median"]
                       for n in f["pp_extra"]}}
    out["pp"], out["tg"] = f["pp"], f["tg"]
    return out


def table(res: dict[str, Any]) -> str:
    d = res["device"]
    lines = [f"{res['shape']} q4 g{res['group_size']} {res['dtype']} on "
             f"{d.get('gpu') or d.get('device_name') or d.get('mlx_device')} "
             f"(copy bandwidth {res['copy_bandwidth_GBps']:.1f} GB/s), p={res['p']} "
             f"n={res['n']} r={res['r']}",
             f"{'system':<8}{'pp t/s':>11}{'tg t/s':>10}{'ms/tok':>9}{'floor ms':>10}"
             f"{'% floor':>9}{'weights MB':>12}{'steps':>7}"]
    for name, s in res["systems"].items():
        steps = s["engine"].get("decode_program_ops", s["engine"].get("steps", "-"))
        lines.append(f"{name:<8}{s['pp']:>11.1f}{s['tg']:>10.1f}{s['ms_per_token']:>9.3f}"
                     f"{s['floor_ms_per_token']:>10.3f}{100 * (s['floor_fraction'] or 0):>8.1f}%"
                     f"{s['weight_bytes'] / 1e6:>12.1f}{steps!s:>7}")
    for name, s in res["systems"].items():
        for n, st in s.get("pp_extra", {}).items():
            lines.append(f"{name:<8} pp{n}: {st['median']:.1f} [{st['min']:.1f}-{st['max']:.1f}]")
    lines.append("fuselm / mlx-lm: " + ", ".join(f"{k} {v:.3f}x"
                                                  for k, v in res["ratio"].items()))
    return "\n".join(lines)


# ---- kernel launch counting ---------------------------------------------------------------------

def _nvtx() -> Any:
    names = [ctypes.util.find_library("nvToolsExt"), "libnvToolsExt.so.1", "libnvToolsExt.so"]
    try:  # the wheel torch depends on ships it
        import nvidia.nvtx  # type: ignore[import-not-found]

        base = Path(next(iter(nvidia.nvtx.__path__))) / "lib"
        names = [str(p) for p in base.glob("libnvToolsExt.so*")] + names
    except ImportError:
        pass
    for n in names:
        if not n:
            continue
        try:
            return ctypes.CDLL(n)
        except OSError:
            continue
    return None


def count_launches(args: argparse.Namespace, hf: Path, fl_dir: Path, mlx_dir: Path) -> None:
    import mlx.core as mx
    import numpy as np

    system = Fuselm(fl_dir, "mlx") if args.count_launches == "fuselm" else MlxLm(mlx_dir)
    vocab = json.loads((hf / "config.json").read_text())["vocab_size"]
    prompt = [int(i) for i in np.random.default_rng(0).integers(0, vocab, size=args.p)]
    token = system.prefill(prompt)
    y = system.decode(token, args.warmup_steps)  # traces/compiles, fills allocator caches
    token = int(y.item())
    mx.synchronize()
    nvtx = _nvtx()
    if nvtx is not None:
        nvtx.nvtxRangePushA(b"count_decode")
    y = system.decode(token, args.steps)
    y.item()
    mx.synchronize()
    if nvtx is not None:
        nvtx.nvtxRangePop()
    log(f"{system.name}: prefill {args.p} + {args.warmup_steps} warm-up + {args.steps} counted "
        f"decode steps on {mx.default_device()} (NVTX {'on' if nvtx is not None else 'off'})")


def kernels_in_ncu_csv(path: str) -> int:
    """Distinct kernel IDs in an `ncu --csv` log (one row per kernel and metric)."""
    text = Path(path).read_text(errors="replace").splitlines()
    start = next((i for i, line in enumerate(text) if line.startswith('"ID"')), None)
    if start is None:
        raise SystemExit(f"{path}: no ncu CSV header (\"ID\", ...) found")
    ids = {row["ID"] for row in csv.DictReader(text[start:]) if row.get("ID")}
    return len(ids)


def launches_from_ncu(files: list[str], steps: list[int]) -> dict[str, Any]:
    if len(files) != 4 or len(steps) != 2:
        raise SystemExit("--launches-from-ncu FUSELM_A FUSELM_B MLXLM_A MLXLM_B --steps A B")
    k = [kernels_in_ncu_csv(f) for f in files]
    per = {"fuselm": (k[1] - k[0]) / (steps[1] - steps[0]),
           "mlx-lm": (k[3] - k[2]) / (steps[1] - steps[0])}
    return {"kernels": dict(zip(files, k, strict=True)), "launches_per_decode_step": per,
            "ratio": per["fuselm"] / per["mlx-lm"] if per["mlx-lm"] else None}


# ---- main ---------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=SHAPES, default="tiny")
    ap.add_argument("--checkpoint", help="an HF checkpoint dir to use instead of --shape's")
    ap.add_argument("--work", default="/tmp/fuselm_side_by_side")
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-r", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--group-size", type=int, choices=(32, 64, 128), default=32)
    ap.add_argument("--dtype", choices=("auto", "float16", "float32"), default="auto")
    ap.add_argument("--fuselm-engine", choices=("mlx", "onnxruntime"), default="mlx")
    ap.add_argument("--quant-method", choices=("search", "minmax"), default="search",
                    help="fuselm's Q4 scale choice (minmax: the quick one, for big shapes)")
    ap.add_argument("--prefill-chunk", type=int, default=2048,
                    help="fuselm's prefill chunk (mlx-lm prefills 2,048 tokens per step)")
    ap.add_argument("--json-out", help="write the JSON here (default: stdout, after the table)")
    ap.add_argument("--count-launches", choices=("fuselm", "mlx-lm"))
    ap.add_argument("--steps", type=int, nargs="+", default=[8])
    ap.add_argument("--warmup-steps", type=int, default=3)
    ap.add_argument("--launches-from-ncu", nargs="+", metavar="CSV")
    ap.add_argument("--separate", type=int, default=0, metavar="ROUNDS",
                    help="each system in its own process per round, alternating")
    ap.add_argument("--only", choices=("fuselm", "mlx-lm"), help=argparse.SUPPRESS)
    ap.add_argument("--pp-extra", type=int, nargs="*", default=[],
                    help="also time prefill of these prompt lengths")
    args = ap.parse_args(argv)

    if args.launches_from_ncu:
        print(json.dumps(launches_from_ncu(args.launches_from_ncu, args.steps), indent=2))
        return
    import mlx.core as mx

    gpu = mx.default_device().type == mx.gpu
    args.dtype_resolved = args.dtype if args.dtype != "auto" else (
        "float16" if gpu else "float32")
    work = Path(args.work)
    hf = ensure_checkpoint(work, args.shape, args.checkpoint)
    tag = f"{args.shape if not args.checkpoint else Path(args.checkpoint).name}" \
          f"_g{args.group_size}_{args.dtype_resolved}"
    fl_dir = ensure_fuselm(hf, work / f"fuselm_{tag}", args.group_size, args.dtype_resolved,
                           args.quant_method)
    mlx_dir = ensure_mlx_lm(hf, work / f"mlxlm_{tag}", args.group_size, args.dtype_resolved)
    if args.count_launches:
        args.steps = args.steps[0]
        count_launches(args, hf, fl_dir, mlx_dir)
        return
    if args.only:
        text = json.dumps(worker(args, hf, fl_dir, mlx_dir))
        if args.json_out:
            Path(args.json_out).write_text(text)
        else:
            print(text)
        return
    res = separate(args, hf) if args.separate else side_by_side(args, hf, fl_dir, mlx_dir)
    print(table(res), file=sys.stderr if not args.json_out else sys.stdout)
    text = json.dumps(res, indent=2)
    if args.json_out:
        Path(args.json_out).write_text(text)
        log(f"JSON written to {args.json_out}")
    else:
        print(text)


if __name__ == "__main__":
    main()
