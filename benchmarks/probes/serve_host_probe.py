"""Where one streamed request's time goes in `fuselm serve`, against the engine's own decode: the
server runs in this process with timers wrapped around its parts (nothing in the product is
changed), a client in another process streams R chat requests one after another, and one JSON
says, medians over the requests:

- client: time to the first text, the decode rate between first and last text, the
  request's tokens / wall (what serve_bench calls agg_tps at one stream), chunks per request;
- server: the request's way to its first token (submit -> the decoder's add -> first step ->
  the reader's first delta), the engine thread's step wall and the gap between two steps (the
  scheduler's own host work), and the CPU each thread used per token (/proc).

    python benchmarks/probes/serve_host_probe.py ARTIFACT [-n 128] [-r 5] [--engine mlx]

Run `fuselm bench ARTIFACT --engine mlx -n 128` next to it for the engine's tg.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from serve_bench import StreamTally  # noqa: E402


def _thread_cpu() -> dict[str, float]:
    """CPU seconds of each thread of this process, by thread name."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
            comm = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        cpu = (int(fields[11]) + int(fields[12])) / tick
        name = names.get(int(tid), comm)
        out[name] = out.get(name, 0.0) + cpu
    return out


def server(argv: list[str], stats_path: Path) -> None:
    """`fuselm serve` in this process, its parts timed; the figures go to stats_path at exit."""
    from fuselm.converter.serve import app as app_mod
    from fuselm.converter.serve import decoder as dec_mod
    from fuselm.converter.serve import scheduler as sched_mod

    rec: dict[str, list[Any]] = {"steps": [], "adds": [], "jobs": [], "deltas": [], "cpu": [],
                                 "traces": []}
    last_end = [0.0]

    step0 = dec_mod.ServeDecoder.step

    def step(self: Any) -> Any:
        t, c = time.perf_counter(), time.thread_time()
        out = step0(self)
        e = time.perf_counter()
        gap = t - last_end[0] if last_end[0] else float("nan")
        last_end[0] = e
        rec["steps"].append((t, e, sum(len(v) for v in out.values()), gap,
                             time.thread_time() - c))
        return out

    add0 = dec_mod.ServeDecoder.add

    def add(self: Any, *a: Any, **k: Any) -> int:
        t = time.perf_counter()
        slot = add0(self, *a, **k)
        rec["adds"].append((t, time.perf_counter()))
        last_end[0] = 0.0  # the gap after an add is not the scheduler's per-step work
        return slot

    deliver0 = app_mod.deliver

    async def deliver(job: Any, *a: Any, **k: Any) -> Any:
        first = True
        async for event in deliver0(job, *a, **k):
            now = time.perf_counter()
            if event[0] == "delta":
                rec["deltas"].append(now)
                if first:
                    rec["jobs"].append({"submit": job.t_submit, "first_token": job.t_first,
                                        "first_delta": now})
                    first = False
            if event[0] == "done":  # each thread's CPU so far, at the end of each request
                rec["cpu"].append((now, _thread_cpu()))
            yield event

    if os.environ.get("PROBE_PROFILE"):  # the engine thread's loop under cProfile
        import cProfile
        import pstats

        loop0 = sched_mod.Scheduler._loop

        def loop(self: Any) -> None:
            prof = cProfile.Profile()
            prof.enable()
            try:
                loop0(self)
            finally:
                prof.disable()
                with open(os.environ["PROBE_PROFILE"], "w") as f:
                    pstats.Stats(prof, stream=f).sort_stats("tottime").print_stats(30)
        sched_mod.Scheduler._loop = loop  # type: ignore[method-assign]
    from fuselm.runtime_metal.mlx_engine import decode as program_mod

    run0 = program_mod.DecodeProgram.run

    def run(self: Any, *a: Any, **k: Any) -> Any:  # a compiled function calls it to trace only
        rec["traces"].append(time.perf_counter())
        return run0(self, *a, **k)

    program_mod.DecodeProgram.run = run  # type: ignore[method-assign]
    dec_mod.ServeDecoder.step = step  # type: ignore[method-assign]
    dec_mod.ServeDecoder.add = add  # type: ignore[method-assign]
    app_mod.deliver = deliver  # type: ignore[assignment]

    def dump(*_: Any) -> None:
        stats_path.write_text(json.dumps({**rec, "thread_cpu": _thread_cpu()}))

    from fuselm.converter.cli.main import cli

    loop_prof = None
    if os.environ.get("PROBE_PROFILE_LOOP"):  # the event loop's thread (the main one)
        import cProfile

        loop_prof = cProfile.Profile()
        loop_prof.enable()
    try:
        cli.main(["serve", *argv], standalone_mode=False)
    finally:
        dump()
        if loop_prof is not None:
            import pstats

            loop_prof.disable()
            with open(os.environ["PROBE_PROFILE_LOOP"], "w") as f:
                pstats.Stats(loop_prof, stream=f).sort_stats("tottime").print_stats(40)


def client(url: str, n: int, requests: int, words: int) -> list[dict[str, Any]]:
    import httpx

    out = []
    with httpx.Client(timeout=600) as http:
        for r in range(requests + 1):  # the first is a warm-up
            body = {"model": "probe", "max_tokens": n, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True},
                    "messages": [{"role": "user", "content": " ".join(
                        f"w{(r * 7 + j) % 50}" for j in range(words + r % 7))}]}
            t0 = time.perf_counter()
            tally = StreamTally()
            with http.stream("POST", url + "/v1/chat/completions", json=body) as resp:
                resp.raise_for_status()
                for line in resp.iter_lines():
                    tally.feed(line)
            end = time.perf_counter()
            first, last, tokens, chunks = tally.first, tally.last, tally.tokens, tally.pieces
            if r:
                out.append({"first_text_ms": (first - t0) * 1e3, "tokens": tokens,
                            "chunks": chunks, "wall_s": end - t0,
                            "decode_tps": (tokens - 1) / (last - first) if last > first
                            else float("nan"), "agg_tps": tokens / (end - t0)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact")
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-r", type=int, default=5, help="requests, after one warm-up")
    ap.add_argument("--words", type=int, default=24)
    ap.add_argument("--engine", default="mlx")
    ap.add_argument("--port", type=int, default=8431)
    ap.add_argument("--serve-flag", action="append", default=[])
    ap.add_argument("--_server", help=argparse.SUPPRESS)
    args, rest = ap.parse_known_args()
    if args._server:
        server(sys.argv[sys.argv.index("--") + 1:], Path(args._server))
        return
    stats = Path(f"/tmp/serve_host_probe_{os.getpid()}.json")
    cmd = [sys.executable, __file__, args.artifact, f"--_server={stats}", "--", args.artifact,
           "--engine", args.engine, "--port", str(args.port), "--model-name", "probe",
           "--max-batch", "16", "--max-context", "1024", "--log-level", "warning",
           *args.serve_flag]
    proc = subprocess.Popen(cmd)
    import httpx

    url = f"http://127.0.0.1:{args.port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        got = client(url, args.n, args.r, args.words)
    finally:
        proc.send_signal(signal.SIGINT)  # uvicorn re-raises it: the finally dumps
        proc.wait(timeout=60)
    rec = json.loads(stats.read_text())
    stats.unlink()
    med = statistics.median
    steps = rec["steps"]
    # steps of the measured requests: skip those of the warm-up (before the second add)
    t_from = rec["adds"][1][0]
    steps = [s for s in steps if s[0] >= t_from]
    jobs = rec["jobs"][1:]
    tokens = sum(s[2] for s in steps)
    gaps = [s[3] for s in steps if s[3] == s[3]]
    summary = {
        "artifact": args.artifact, "n": args.n, "requests": args.r,
        "load_average": os.getloadavg()[0],
        "client": {k: med(x[k] for x in got) for k in got[0]},
        "first_token_ms": {
            "submit_to_add": med((a[0] - j["submit"]) * 1e3 for a, j in
                                 zip(rec["adds"][1:], jobs, strict=False)),
            "add": med((a[1] - a[0]) * 1e3 for a in rec["adds"][1:]),
            "submit_to_first_token": med((j["first_token"] - j["submit"]) * 1e3 for j in jobs),
            "first_token_to_first_delta": med((j["first_delta"] - j["first_token"]) * 1e3
                                              for j in jobs)},
        "engine_thread": {"step_ms": med((s[1] - s[0]) * 1e3 for s in steps),
                          "step_cpu_ms": med(s[4] * 1e3 for s in steps),
                          "gap_ms": med(gaps) * 1e3 if gaps else None,
                          "tokens": tokens,
                          "wall_per_token_ms": sum(s[1] - s[0] + (s[3] if s[3] == s[3] else 0)
                                                   for s in steps) / max(tokens, 1) * 1e3},
        # from the warm-up's end to the last request's: CPU ms per generated token, by thread
        "thread_cpu_ms_per_token": {
            k: round((v - rec["cpu"][0][1].get(k, 0.0)) * 1e3 / (args.n * args.r), 3)
            for k, v in rec["cpu"][-1][1].items()},
        "deltas": len(rec["deltas"]),
        # the engine's compiled traces during the measured requests (after the warm-up's add)
        "traces": sum(t >= t_from for t in rec["traces"]),
    }
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
