"""One model over several ranks (`--parallel tensor|pipeline`) against one rank: prefill and
decode tokens/s at batch 1, and each rank's memory, every system in its own processes.

    python benchmarks/parallel_bench.py --artifact OUT_DIR [--ranks 2] [--backend ring|nccl]
        [-p 128] [-n 64] [-r 3] [--modes tensor pipeline pipeline-mb1] [--streams 4 8 16]
        [--mlx-lm MLX_DIR] [--json-out F]

Each rank runs this file's `--worker` (started as `mlx.launch -n R --backend B` starts them;
one rank: a plain process): greedy generation of n tokens after a seeded random p-token
prompt, a warm-up then r runs, medians; the figures are rank 0's, the memory every rank's
(peak RSS, the weight bytes it read, MLX's peak device memory). `--mlx-lm DIR` adds mlx-lm's
own sharded generation of the same weights (`mlx_lm.utils.sharded_load`, tensor and
pipeline) and its single rank.
`--allreduce` times only one all_sum of a decode step's hidden row over the ranks (e.g. two
processes on one GPU, where a second GPU is not at hand).
`--streams N ...` measures the batch decoder instead (the server's path): N sequences of
seeded random p-token prompts decoding together, the aggregate decode tokens/s (N x n tokens
over the time of n steps; two warm-up steps after the prompts, then r runs of n steps,
median), every count in the same processes. Mode `pipeline-mb1` is pipeline parallel with
FUSELM_MICRO_BATCHES=1: the whole batch through the stages in turn, against `pipeline`'s
micro-batches (one per rank).
Ranks: the ring backend's are started directly on 127.0.0.1 (mlx.launch's hostfile and
MLX_RANK, free ports); other backends' by `mlx.launch -n R --backend B`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()


def _rss_now() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _fuselm(args: argparse.Namespace, parallel: str | None) -> dict:
    import mlx.core as mx
    import numpy as np

    from fuselm.runtime_metal.loaded_model import open_model

    model = open_model(args.artifact, "mlx", **({"parallel": parallel} if parallel else {}))
    if args.streams:
        return _streams(args, model)
    prompt = np.random.default_rng(0).integers(
        0, model.manifest.model.vocab_size, args.p).tolist()
    runs = [model.generate(prompt, max_new_tokens=args.n) for _ in range(args.r + 1)][1:]
    eng = model.engine
    return {"pp": statistics.median(r.pp for r in runs),
            "tg": statistics.median(r.tg for r in runs),
            "tokens": runs[-1].tokens[:8], "weight_bytes": eng.weight_bytes,  # type: ignore[attr-defined]
            "device_peak_bytes": mx.get_peak_memory(),
            "rank": eng.parallel.rank if eng.parallel else 0}  # type: ignore[attr-defined]


def _streams(args: argparse.Namespace, model: object) -> dict:
    """The batch decoder's aggregate decode tokens/s at each --streams count."""
    import mlx.core as mx
    import numpy as np

    from fuselm.runtime_metal.batch import BatchDecoder
    from fuselm.runtime_metal.sampling import SamplingOptions

    eng = model.engine  # type: ignore[attr-defined]
    vocab = model.manifest.model.vocab_size  # type: ignore[attr-defined]
    rng = np.random.default_rng(0)
    out: dict[str, object] = {}
    for count in args.streams:
        dec = BatchDecoder(eng, max_batch=count, max_context=args.p + 4 + args.n * args.r)
        for _ in range(count):
            dec.add(rng.integers(0, vocab, args.p).tolist(), SamplingOptions())
        first = dec.step()  # the prompts' first tokens
        for _ in range(2):  # warm-up: this row count's compiled traces
            dec.step()
        runs, last = [], first
        for _ in range(args.r):
            t0 = time.perf_counter()
            for _ in range(args.n):
                last = dec.step()
            runs.append(count * args.n / (time.perf_counter() - t0))
        mx.synchronize()
        out[str(count)] = {"tok_s": statistics.median(runs), "runs": runs,
                           "tokens": {"first": [first[s] for s in sorted(first)][:4],
                                      "last": [last[s] for s in sorted(last)][:4]},
                           "decoder": dec.describe()}
        for slot in dec.active:
            dec.remove(slot)
        mx.synchronize()  # the removals' last steps run on every rank before any exits
    return {"pp": 0.0, "tg": 0.0, "streams": out, "weight_bytes": eng.weight_bytes,
            "device_peak_bytes": mx.get_peak_memory(),
            "rank": eng.parallel.rank if eng.parallel else 0}


def _mlx_lm(args: argparse.Namespace, parallel: str | None) -> dict:
    import mlx.core as mx
    import numpy as np
    from mlx_lm import load, stream_generate
    from mlx_lm.utils import sharded_load

    if parallel:
        group = mx.distributed.init()
        model, tok = sharded_load(args.mlx_lm, group if parallel == "pipeline" else None,
                                  group if parallel == "tensor" else None)
        rank = group.rank()
    else:
        model, tok = load(args.mlx_lm)
        rank = 0
    prompt = np.random.default_rng(0).integers(0, tok.vocab_size, args.p).tolist()
    pp, tg = [], []
    for _ in range(args.r + 1):
        last = list(stream_generate(model, tok, prompt, max_tokens=args.n))[-1]
        pp.append(last.prompt_tps)
        tg.append(last.generation_tps)
    return {"pp": statistics.median(pp[1:]), "tg": statistics.median(tg[1:]),
            "device_peak_bytes": mx.get_peak_memory(), "rank": rank}


def _allreduce(args: argparse.Namespace) -> dict:
    """One all_sum of a decode step's hidden row ([1, 1, width], float32), the collective a
    tensor-parallel layer runs twice: median of 7 rounds of 200, microseconds."""
    import mlx.core as mx

    group = mx.distributed.init()
    x = mx.ones((1, 1, args.width))
    for _ in range(20):
        mx.eval(mx.distributed.all_sum(x))
    rounds = []
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(200):
            mx.eval(mx.distributed.all_sum(x))
        rounds.append((time.perf_counter() - t0) / 200 * 1e6)
    return {"allreduce_us": statistics.median(rounds), "rounds_us": rounds,
            "rank": group.rank(), "pp": 0.0, "tg": 0.0}


def worker(args: argparse.Namespace) -> None:
    parallel = None if args.worker_mode == "single" else args.worker_mode.split("-")[0]
    if args.worker_system == "allreduce":
        res = _allreduce(args)
        Path(args.worker_out, f"rank{res['rank']}.json").write_text(json.dumps(res))
        return
    t0 = time.perf_counter()
    res = (_mlx_lm if args.worker_system == "mlx-lm" else _fuselm)(args, parallel)
    res.update(seconds=time.perf_counter() - t0, rss_now_bytes=_rss_now(),
               peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    Path(args.worker_out, f"rank{res['rank']}.json").write_text(json.dumps(res))


def _ring(cmd: list[str], args: argparse.Namespace, env: dict[str, str], tmp: Path) -> None:
    """The ranks of a ring on 127.0.0.1 started directly, with the hostfile and MLX_RANK
    mlx.launch would give them: mlx.launch's own process, relaying their output, took 15 % of
    a core of the 2-core CPU machine, time the ranks then lacked."""
    import socket

    ports = []
    for _ in range(args.ranks):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
    hostfile = tmp / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ports]))
    procs = [subprocess.Popen(cmd, env={**env, "MLX_RANK": str(r),
                                        "MLX_HOSTFILE": str(hostfile)})
             for r in range(args.ranks)]
    try:
        codes = [p.wait(timeout=args.timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(codes):
        raise SystemExit(f"a rank failed: exit codes {codes}")


def _launch(args: argparse.Namespace, system: str, mode: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, str(HERE), "--worker-system", system, "--worker-mode", mode,
               "--worker-out", tmp, "--artifact", args.artifact, "-p", str(args.p),
               "-n", str(args.n), "-r", str(args.r), "--width", str(args.width)]
        if args.streams:
            cmd += ["--streams", *map(str, args.streams)]
        env = dict(os.environ)
        if mode == "pipeline-mb1":
            env["FUSELM_MICRO_BATCHES"] = "1"
        if args.mlx_lm:
            cmd += ["--mlx-lm", args.mlx_lm]
        if mode != "single" and args.backend == "ring":
            _ring(cmd, args, env, Path(tmp))
        else:
            if mode != "single":
                beside = Path(sys.executable).with_name("mlx.launch")
                launcher = str(beside) if beside.is_file() else shutil.which("mlx.launch")
                if launcher is None:
                    raise SystemExit("mlx.launch not found (beside python or on PATH)")
                cmd = [launcher, "-n", str(args.ranks), "--backend", args.backend, "--", *cmd]
            subprocess.run(cmd, check=True, timeout=args.timeout, env=env)
        ranks = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("rank*.json"))]
    first = ranks[0]
    return {"system": system, "mode": mode, "ranks": len(ranks), "pp": first["pp"],
            "tg": first["tg"], "per_rank": ranks,
            **({"streams": {k: v["tok_s"] for k, v in first["streams"].items()}}
               if "streams" in first else {})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifact", default="", help="the fuselm artifact (all but --allreduce)")
    ap.add_argument("--mlx-lm", help="an mlx-lm folder of the same weights: its peer rows")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--backend", default="ring", choices=("ring", "jaccl", "nccl"))
    ap.add_argument("--modes", nargs="+", default=["tensor", "pipeline"])
    ap.add_argument("-p", type=int, default=128)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("-r", type=int, default=3)
    ap.add_argument("--timeout", type=int, default=1800)
    ap.add_argument("--allreduce", action="store_true",
                    help="only time one all_sum of a [1, 1, --width] float32 row over the ranks")
    ap.add_argument("--width", type=int, default=1024, help="hidden size for --allreduce")
    ap.add_argument("--streams", type=int, nargs="+",
                    help="the batch decoder's aggregate decode tok/s at these stream counts")
    ap.add_argument("--json-out")
    ap.add_argument("--worker-system", help=argparse.SUPPRESS)
    ap.add_argument("--worker-mode", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker_system:
        worker(args)
        return
    if args.allreduce:
        res = _launch(args, "allreduce", "tensor")
        print(json.dumps(res, indent=2))
        return
    systems = ["fuselm"] + (["mlx-lm"] if args.mlx_lm else [])
    rows = []
    for system in systems:
        for mode in ["single", *args.modes]:
            rows.append(_launch(args, system, mode))
            r = rows[-1]
            agg = "".join(f"  {k} streams {v:7.2f} tok/s" for k, v in r.get("streams", {}).items())
            print(f"{system:7} {mode:12} ranks {r['ranks']}  pp {r['pp']:8.1f} tok/s  "
                  f"tg {r['tg']:7.2f} tok/s{agg}  peak RSS/rank "
                  + " ".join(f"{x['peak_rss_bytes'] / 2**20:.0f}" for x in r["per_rank"])
                  + " MiB", file=sys.stderr, flush=True)
    for system in systems:
        one = next(r for r in rows if r["system"] == system and r["mode"] == "single")
        for r in rows:
            if r["system"] == system and "streams" in r:
                r["streams_vs_single"] = {k: v / one["streams"][k]
                                          for k, v in r["streams"].items()}
            elif r["system"] == system:
                r["tg_vs_single"] = r["tg"] / one["tg"]
    out = {"machine": os.uname().nodename, "backend": args.backend, "p": args.p, "n": args.n,
           "r": args.r, "artifact": args.artifact, "rows": rows}
    text = json.dumps(out, indent=2)
    if args.json_out:
        Path(args.json_out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
