"""A `fuselm serve` process's memory over many requests of random lengths, as JSON: its resident
set, MLX's active and cached memory (from /health) at idle checkpoints, the answers by status,
and the time taken. Prompts are random token ids: mostly 1..--max-prompt tokens, every 25th one
150..200 tokens (a long one the others wait behind under a small budget), max_tokens 1..4.

    python benchmarks/serve_kv_budget.py OUT_DIR [--engine mlx] [--max-kv-tokens 256]
        [-n 1000] [--threads 4] [--every 100]

The server (127.0.0.1, a free port, --max-batch 4 --max-context 256) is stopped by PID.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--engine", default="mlx")
    ap.add_argument("--max-kv-tokens", type=int, default=None)
    ap.add_argument("-n", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--every", type=int, default=100)
    ap.add_argument("--max-prompt", type=int, default=48)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "fuselm.converter.cli.main", "serve", args.out_dir,
           "--port", str(port), "--engine", args.engine, "--max-batch", "4",
           "--max-context", "256", "--max-queue", "64", "--log-level", "warning"]
    if args.max_kv_tokens:
        cmd += ["--max-kv-tokens", str(args.max_kv_tokens)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        end = time.monotonic() + 300
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > end:
                raise SystemExit("the server did not start")
            time.sleep(0.3)
        print(json.dumps(run(url, proc.pid, args)))
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def run(url: str, pid: int, args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    requests = []
    for i in range(args.n):
        p = rng.randint(150, 200) if i % 25 == 12 else rng.randint(1, args.max_prompt)
        requests.append(([rng.randrange(4, 300) for _ in range(p)], rng.randint(1, 4)))
    codes: dict[int, int] = {}
    lock, local = threading.Lock(), threading.local()
    proc = psutil.Process(pid)

    def send(i: int) -> None:
        if not hasattr(local, "http"):
            local.http = httpx.Client(base_url=url, timeout=120)
        prompt, m = requests[i]
        r = local.http.post("/v1/completions", json={"model": model, "prompt": prompt,
                                                     "max_tokens": m, "temperature": 0})
        with lock:
            codes[r.status_code] = codes.get(r.status_code, 0) + 1

    points = []
    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.threads) as pool:
        for start in range(0, args.n, args.every):
            list(pool.map(send, range(start, min(start + args.every, args.n))))
            h = httpx.get(url + "/health").json()
            mem = h.get("memory", {})
            points.append({"requests": min(start + args.every, args.n),
                           "rss_MB": round(proc.memory_info().rss / 1e6, 1),
                           "mlx_active_MB": round(mem.get("mlx_active_bytes", 0) / 1e6, 2),
                           "mlx_cache_MB": round(mem.get("mlx_cache_bytes", 0) / 1e6, 2)})
    return {"engine": args.engine, "max_kv_tokens": args.max_kv_tokens, "requests": args.n,
            "seconds": round(time.perf_counter() - t0, 1), "status": codes,
            "kv": httpx.get(url + "/health").json()["kv"], "points": points}


if __name__ == "__main__":
    main()
