"""`fuselm serve` and `mlx_lm.server` side by side under the same load: aggregate decode tokens/s
and time to first token at 1, 4, 8 and 16 concurrent streaming clients.

Both servers run as their own processes on the same random-weight checkpoint, quantized the same
way (4-bit affine, group G, embeddings and LM head included; benchmarks/side_by_side.py builds
and converts it). One load script drives both through the OpenAI chat API (streaming, greedy,
`stream_options.include_usage`): N clients start together, each asks for the same number of new
tokens after a distinct prompt. The systems alternate per concurrency level, round after round;
each (system, concurrency) gets a warm-up burst first. Figures are medians over the rounds:

  agg_tps  = all clients' completion tokens (usage) / wall time of the burst (first request
             sent to last stream closed): what the server delivers to N users together
  ttft_ms  = median latency of N concurrent non-streaming requests for max_tokens=1 (a second
             burst): prefill + first token under the same concurrency
  first_content_ms = median time to the first non-empty streamed text (null if none came)
  decode_tps = one stream's tokens after its first / time from its first to its last text
             (median over the streams): the decode rate a user sees, prefill left out

A random-weight checkpoint's tokenizer is a small trained BPE (a few hundred ids) under the
model's whole vocabulary: the ids past it have no text, so a server that streams text (fuselm)
sends none for them and the first and last text of a stream say nothing of its pace (mlx-lm
streams a "!" for each such id instead). Before serving, `pad_vocab` gives every id of the
model's vocabulary a text of its own (a word per id, no merges: encoding is unchanged), in the
checkpoint and in both conversions, so both servers stream real text for every token.

`fuselm bench` runs on the same artifact and engine first, in its own process, so the JSON puts
one stream's decode next to the engine's own tg (`one_stream_over_bench_tg`). `--artifact DIR`
serves an existing fuselm artifact (e.g. the real SmolLM2-135M Q4) instead of building a
checkpoint (fuselm only).

    python benchmarks/serve_bench.py --shape tiny --streams 1 4 8 16 --rounds 3 -n 32
    python benchmarks/serve_bench.py --shape qwen3-0.6b --group-size 32 --rounds 3 -n 128 \
        --json-out serve_qwen3.json
    python benchmarks/serve_bench.py --artifact /tmp/smol_q4 --fuselm-engine onnxruntime \
        --streams 1 4 --rounds 3 -n 64 --json-out serve_smol_cpu.json [--fuselm-flag=--draft-lookup]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from side_by_side import ensure_checkpoint, ensure_fuselm, ensure_mlx_lm, log  # noqa: E402

WORDS = ("the quick brown fox jumps over the lazy dog while rotary embeddings rotate queries "
         "and keys and grouped attention shares values across heads").split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProc:
    def __init__(self, name: str, cmd: list[str], model: str, port: int, log_path: Path
                 ) -> None:
        self.name, self.model, self.url = name, model, f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_up(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not up after {timeout} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self._log.close()


class StreamTally:
    """A streamed chat reply's server-sent lines, fed as they arrive: when its first and last
    text came, its tokens (the usage chunk's count), its text pieces."""

    def __init__(self) -> None:
        self.first = self.last = 0.0
        self.tokens = self.pieces = 0

    def feed(self, line: str) -> None:
        if not line.startswith("data: ") or line == "data: [DONE]":
            return
        chunk = json.loads(line[6:])
        if chunk.get("usage"):
            self.tokens = chunk["usage"]["completion_tokens"]
        for c in chunk.get("choices") or []:
            if (c.get("delta") or {}).get("content"):
                self.last = time.perf_counter()
                self.first = self.first or self.last
                self.pieces += 1


async def one_stream(http: httpx.AsyncClient, srv: ServerProc, prompt: str, n: int
                     ) -> dict[str, float]:
    body = {"model": srv.model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": n, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    tally = StreamTally()
    async with http.stream("POST", srv.url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            tally.feed(line)
    first, last = tally.first, tally.last
    tokens = tally.tokens or tally.pieces
    rate = (tokens - 1) / (last - first) if tokens > 1 and last > first else float("nan")
    return {"t0": t0, "first": first, "last": last, "tokens": tokens, "decode_tps": rate,
            "end": time.perf_counter()}


async def ttft_burst(srv: ServerProc, streams: int, prompt_words: int, salt: int) -> float:
    """Median latency of `streams` concurrent one-token requests (ms)."""
    async def one(http: httpx.AsyncClient, prompt: str) -> float:
        t0 = time.perf_counter()
        r = await http.post(srv.url + "/v1/chat/completions", json={
            "model": srv.model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 1, "temperature": 0})
        r.raise_for_status()
        return (time.perf_counter() - t0) * 1e3

    prompts = [" ".join(WORDS[(i * 5 + salt + j) % len(WORDS)] for j in range(prompt_words))
               + f" t{salt}.{i}" for i in range(streams)]
    async with httpx.AsyncClient(timeout=600,
                                 limits=httpx.Limits(max_connections=streams + 4)) as http:
        got = await asyncio.gather(*(one(http, p) for p in prompts), return_exceptions=True)
    ok = [x for x in got if isinstance(x, float)]
    return statistics.median(ok) if ok else float("nan")


async def burst(srv: ServerProc, streams: int, n: int, prompt_words: int, salt: int
                ) -> dict[str, float]:
    prompts = [" ".join(WORDS[(i * 7 + salt + j) % len(WORDS)] for j in range(prompt_words))
               + f" {salt}.{i}" for i in range(streams)]
    limits = httpx.Limits(max_connections=streams + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        t0 = time.perf_counter()
        got = await asyncio.gather(*(one_stream(http, srv, p, n) for p in prompts),
                                   return_exceptions=True)
        wall = time.perf_counter() - t0
    res = [r for r in got if isinstance(r, dict)]
    errors = [repr(r) for r in got if not isinstance(r, dict)]
    if errors:
        log(f"{srv.name} x{streams}: {len(errors)} stream(s) failed: {errors[0]}")
    total = sum(r["tokens"] for r in res)
    firsts = [(r["first"] - r["t0"]) * 1e3 for r in res if r["first"]]
    rates = [r["decode_tps"] for r in res if r["decode_tps"] == r["decode_tps"]]
    return {"agg_tps": total / wall,
            "first_content_ms": statistics.median(firsts) if firsts else float("nan"),
            "decode_tps": statistics.median(rates) if rates else float("nan"),
            "tokens": total, "wall_s": wall, "failed": len(errors)}


def pad_vocab(folder: Path, vocab_size: int) -> None:
    """Every id below vocab_size a token of the folder's byte-level BPE tokenizer.json: ids it
    lacks become the word " x<id>" (byte-level: "Ġ" is the space; letters and digits stand for
    themselves), no merges, so encoding stays as it was. Nothing when the tokenizer covers the
    vocabulary already (a real model's)."""
    path = folder / "tokenizer.json"
    tok = json.loads(path.read_text())
    vocab = tok["model"]["vocab"]
    taken = set(vocab.values()) | {a["id"] for a in tok.get("added_tokens", [])}
    if tok["model"].get("type") != "BPE" or len(taken) >= vocab_size:
        return
    for i in range(vocab_size):
        if i not in taken:
            word = f"\u0120x{i}"
            while word in vocab:  # a trained token spelled the same keeps its id
                word += "x"
            vocab[word] = i
    path.write_text(json.dumps(tok, ensure_ascii=False))
    log(f"{folder}: tokenizer padded from {len(taken)} to {vocab_size} ids")


def bench_tg(artifact: Path, engine: str, n: int, prompt_tokens: int) -> dict[str, Any]:
    """`fuselm bench` on the artifact in its own process: the engine's one-sequence decode."""
    cmd = [sys.executable, "-P", "-m", "fuselm.converter.cli.main", "bench", str(artifact),
           "--engine", engine, "--json", "-n", str(n), "-p", str(prompt_tokens), "-r", "3"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    got = json.loads(out)
    log(f"fuselm bench: tg{n} {got['tg']:.1f} tok/s ({got['engine']['engine']})")
    return {"tg": got["tg"], "pp": got["pp"], "prompt_tokens": prompt_tokens, "new_tokens": n,
            "engine": got["engine"]}


def start_servers(args: argparse.Namespace, fl_dir: Path, mlx_dir: Path | None
                  ) -> list[ServerProc]:
    work = Path(args.work)
    servers = []
    max_batch = str(max(args.streams))
    if "fuselm" in args.systems:
        port = free_port()
        cmd = [sys.executable, "-P", "-m", "fuselm.converter.cli.main", "serve", str(fl_dir),
               "--port", str(port), "--engine", args.fuselm_engine, "--max-batch", max_batch,
               "--log-level", "warning", "--model-name", "bench",
               "--max-context", str(args.fuselm_max_context), *args.fuselm_flag]
        servers.append(ServerProc("fuselm", cmd, "bench", port, work / "fuselm_server.log"))
    if "mlx-lm" in args.systems and mlx_dir is not None:
        port = free_port()
        cmd = [sys.executable, "-m", "mlx_lm", "server", "--model", str(mlx_dir), "--port",
               str(port), "--log-level", "WARNING", "--decode-concurrency", max_batch]
        servers.append(ServerProc("mlx-lm", cmd, "default_model", port,
                                  work / "mlxlm_server.log"))
    for s in servers:
        s.wait_up(args.startup_timeout)
    return servers


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=("tiny", "qwen3-0.6b", "llama-3.2-1b"), default="tiny")
    ap.add_argument("--work", default="/tmp/fuselm_serve_bench")
    ap.add_argument("--group-size", type=int, choices=(32, 64, 128), default=32)
    ap.add_argument("--dtype", choices=("auto", "float16", "float32"), default="auto")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-n", type=int, default=64, help="new tokens per client")
    ap.add_argument("--prompt-words", type=int, default=24)
    ap.add_argument("--systems", nargs="+", choices=("fuselm", "mlx-lm"),
                    default=["fuselm", "mlx-lm"])
    ap.add_argument("--fuselm-engine", choices=("auto", "mlx", "onnxruntime"), default="auto")
    ap.add_argument("--fuselm-max-context", type=int, default=1024,
                    help="fuselm serve --max-context: KV rows are reserved (and attended) at "
                    "this length")
    ap.add_argument("--fuselm-flag", action="append", default=[], metavar="FLAG",
                    help="one more `fuselm serve` argument (repeat it: --fuselm-flag=--draft-"
                    "lookup --fuselm-flag=--exact-rows)")
    ap.add_argument("--startup-timeout", type=float, default=600)
    ap.add_argument("--artifact", help="serve this fuselm artifact (fuselm only; no checkpoint "
                    "is built) and compare one stream with `fuselm bench` on it")
    ap.add_argument("--json-out")
    args = ap.parse_args(argv)

    import mlx.core as mx

    gpu = mx.default_device().type == mx.gpu
    dtype = args.dtype if args.dtype != "auto" else ("float16" if gpu else "float32")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    reference = None
    if args.artifact:
        fl_dir, mlx_dir = Path(args.artifact), None
        args.systems = ["fuselm"]
    else:
        hf = ensure_checkpoint(work, args.shape, None)
        vocab = json.loads((hf / "config.json").read_text())["vocab_size"]
        pad_vocab(hf, vocab)  # before converting: the conversions copy the tokenizer
        tag = f"{args.shape}_g{args.group_size}_{dtype}"
        fl_dir = ensure_fuselm(hf, work / f"fuselm_{tag}", args.group_size, dtype)
        mlx_dir = ensure_mlx_lm(hf, work / f"mlxlm_{tag}", args.group_size, dtype) if (
            "mlx-lm" in args.systems) else None
        for folder in (fl_dir, mlx_dir):  # conversions made before the padding
            if folder is not None:
                pad_vocab(folder, vocab)
    if "fuselm" in args.systems:  # before any server starts: the machine to itself
        # about the chat prompt's length: the words, the template and the chat's system text
        reference = bench_tg(fl_dir, args.fuselm_engine, args.n, args.prompt_words + 32)
    servers = start_servers(args, fl_dir, mlx_dir)
    runs: dict[str, dict[int, list[dict[str, float]]]] = {
        s.name: {k: [] for k in args.streams} for s in servers}
    try:
        for k in args.streams:  # warm-up: every batch size each server will see
            for s in servers:
                asyncio.run(burst(s, k, min(args.n, 8), args.prompt_words, salt=999))
        for r in range(args.rounds):
            for k in args.streams:
                order = servers if r % 2 == 0 else servers[::-1]
                for s in order:
                    res = asyncio.run(burst(s, k, args.n, args.prompt_words, salt=r))
                    res["ttft_ms"] = asyncio.run(ttft_burst(s, k, args.prompt_words, salt=r))
                    runs[s.name][k].append(res)
                    log(f"round {r} {s.name:7s} x{k:<3d} agg {res['agg_tps']:8.1f} tok/s  "
                        f"decode/stream {res['decode_tps']:7.1f}  "
                        f"ttft {res['ttft_ms']:7.1f} ms  first text "
                        f"{res['first_content_ms']:7.1f} ms  failed {res['failed']}")
    finally:
        for s in servers:
            s.stop()
    summary: dict[str, Any] = {
        "shape": args.shape if not args.artifact else None, "artifact": args.artifact,
        "group_size": args.group_size if not args.artifact else None, "dtype": dtype,
        "device": str(mx.default_device()), "n": args.n, "rounds": args.rounds,
        "prompt_words": args.prompt_words, "fuselm_engine": args.fuselm_engine,
        "fuselm_max_context": args.fuselm_max_context, "fuselm_flags": args.fuselm_flag,
        "load_average": os.getloadavg()[0], "results": {}}
    for name, by_k in runs.items():
        summary["results"][name] = {
            str(k): {**{m: statistics.median(x[m] for x in v) for m in
                        ("agg_tps", "ttft_ms", "first_content_ms", "decode_tps")},
                     "failed_streams": sum(x["failed"] for x in v)} for k, v in by_k.items()}
    for by_k in summary["results"].values():
        one = by_k.get("1", {}).get("agg_tps")
        for v in by_k.values():
            v["x_single_stream"] = v["agg_tps"] / one if one else None
    one_stream = summary["results"].get("fuselm", {}).get("1")
    if reference is not None:
        summary["fuselm_bench"] = reference
        if one_stream:  # the stream's decode (its first text to its last), and its whole
            # request (prefill and HTTP included: what one user waits for 128 tokens)
            summary["one_stream_over_bench_tg"] = one_stream["decode_tps"] / reference["tg"]
            summary["one_stream_agg_over_bench_tg"] = one_stream["agg_tps"] / reference["tg"]
    if "fuselm" in runs and "mlx-lm" in runs:
        summary["fuselm_over_mlx_lm_agg"] = {
            k: summary["results"]["fuselm"][k]["agg_tps"] /
            summary["results"]["mlx-lm"][k]["agg_tps"] for k in summary["results"]["fuselm"]}
    text = json.dumps(summary, indent=2)
    if args.json_out:
        Path(args.json_out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
