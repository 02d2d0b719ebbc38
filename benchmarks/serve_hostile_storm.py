"""`fuselm serve` before and after a storm of hostile requests: latency of a small greedy request
and the server's RSS, so a refusal path that leaks or slows the server shows.

One server (onnxruntime, default access rules: loopback Host names, no cross-origin caller, no
key) on 127.0.0.1. Before: a warm-up, then the median latency of --samples sequential greedy
completions (max_tokens --tokens) and the RSS. Then --storm hostile requests from --clients
threads, cycling through the kinds below (each must be refused with its 4xx), then the same
latency and RSS again; the greedy text must be the same before and after.

    python benchmarks/serve_hostile_storm.py                      # SmolLM2-135M Q4_1 (bundled)
    python benchmarks/serve_hostile_storm.py --model tiny --json-out storm_tiny.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
MODEL = "storm-model"
JSON = {"content-type": "application/json"}


def hostile_kinds(model: str, max_body: int) -> dict[str, tuple[dict, bytes, str, int]]:
    """name -> (headers, body, method, the status it must get)."""
    ok = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 4}).encode()
    return {
        "foreign Host (DNS rebinding)": ({**JSON, "host": "evil.example.com"}, ok, "POST", 421),
        "text/plain from a foreign Origin": ({"content-type": "text/plain",
                                              "origin": "http://evil.example.com"}, ok, "POST",
                                             403),
        "preflight from a foreign Origin": ({"origin": "http://evil.example.com",
                                             "access-control-request-method": "POST"}, b"",
                                            "OPTIONS", 403),
        "text/plain, no Origin": ({"content-type": "text/plain"}, ok, "POST", 415),
        "lone surrogate": (JSON, b'{"model": "%s", "prompt": "\\ud800"}' % model.encode(), "POST",
                           400),
        "100000 deep": (JSON, b"[" * 100_000 + b"]" * 100_000, "POST", 400),
        "1.9 MB of brackets": (JSON, b"[" * 1_900_000, "POST", 400),
        "over --max-body": (JSON, b'{"prompt": "' + b"a" * (max_body + 1) + b'"}', "POST", 413),
        "invalid JSON": (JSON, b'{"model": ', "POST", 400),
        "5000-digit integer": (JSON, b'{"model": "m", "prompt": [' + b"9" * 5000 + b"]}", "POST",
                               400),
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def artifact(kind: str, work: Path) -> Path:
    out = work / kind / MODEL
    if (out / "fuselm.json").is_file():
        return out
    if kind == "tiny":
        from fuselm.converter.models.builtin import build_model
        from fuselm.converter.pipeline import ConvertOptions, convert

        convert(build_model(work / kind / "hf", "qwen3", seed=5), out,
                ConvertOptions(dtype="float32"))
    else:
        from fuselm.converter.models.smollm2 import bundled_gguf

        subprocess.run([sys.executable, "-m", "fuselm.converter.cli.main", "convert",
                        str(bundled_gguf()), "-o", str(out)], check=True)
    return out


def latency(http: httpx.Client, samples: int, tokens: int) -> tuple[float, str]:
    times, texts = [], set()
    for _ in range(samples):
        t0 = time.perf_counter()
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "The capital of France",
                                               "max_tokens": tokens, "temperature": 0})
        times.append(time.perf_counter() - t0)
        r.raise_for_status()
        texts.add(r.json()["choices"][0]["text"])
    assert len(texts) == 1, texts  # greedy: the same text every time
    return statistics.median(times) * 1e3, texts.pop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "fuselm-storm")
    ap.add_argument("--storm", type=int, default=500)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--json-out", type=Path, default=None)
    args = ap.parse_args()

    out = artifact(args.model, args.work)
    port, max_body = free_port(), 2 * 1024 * 1024
    log_path = args.work / f"{args.model}-serve.log"
    with open(log_path, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "fuselm.converter.cli.main", "serve",
                                 str(out), "--port", str(port), "--engine", "onnxruntime",
                                 "--max-body", str(max_body), "--log-level", "warning"],
                                stdout=f, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server did not start:\n{log_path.read_text()}")
            time.sleep(0.3)
        server = psutil.Process(proc.pid)
        with httpx.Client(base_url=url, timeout=120) as http:
            latency(http, 10, args.tokens)  # warm-up: arenas, tokenizer caches
            lat_before, text_before = latency(http, args.samples, args.tokens)
            rss_before = server.memory_info().rss

            kinds = list(hostile_kinds(MODEL, max_body).items())
            wrong: list[str] = []

            def one(i: int) -> int:
                name, (headers, body, method, want) = kinds[i % len(kinds)]
                r = http.request(method, "/v1/completions", headers=headers, content=body)
                if r.status_code != want or "Traceback" in r.text:
                    wrong.append(f"{name}: {r.status_code} {r.text[:120]}")
                return r.status_code

            t0 = time.perf_counter()
            with ThreadPoolExecutor(args.clients) as pool:
                codes = Counter(pool.map(one, range(args.storm)))
            storm_s = time.perf_counter() - t0
            rss_storm = server.memory_info().rss
            lat_after, text_after = latency(http, args.samples, args.tokens)
            rss_after = server.memory_info().rss
            health = http.get("/health").json()
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    server_log = log_path.read_text()
    result = {
        "model": args.model, "engine": "onnxruntime", "cpu_count": os.cpu_count(),
        "greedy_request": {"max_tokens": args.tokens, "samples": args.samples},
        "latency_ms_before": round(lat_before, 1), "latency_ms_after": round(lat_after, 1),
        "rss_mib_before": round(rss_before / 2**20, 1),
        "rss_mib_after_storm": round(rss_storm / 2**20, 1),
        "rss_mib_after": round(rss_after / 2**20, 1),
        "storm": {"requests": args.storm, "clients": args.clients, "seconds": round(storm_s, 2),
                  "statuses": {str(k): v for k, v in sorted(codes.items())},
                  "kinds": [name for name, _ in kinds], "wrong": wrong},
        "same_greedy_text": text_before == text_after,
        "admitted_by_engine": health["admitted"],
        "tracebacks_in_server_log": server_log.count("Traceback"),
    }
    print(json.dumps(result, indent=1))
    if args.json_out:
        path = args.json_out if args.json_out.is_absolute() else \
            ROOT / "benchmarks" / "results" / args.json_out
        path.write_text(json.dumps(result, indent=1) + "\n")
    if wrong or not result["same_greedy_text"] or result["tracebacks_in_server_log"]:
        raise SystemExit("the storm changed the server's behaviour (see above)")


if __name__ == "__main__":
    main()
