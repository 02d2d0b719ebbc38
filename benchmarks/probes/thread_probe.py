"""Where a benchmark process's threads run (Linux): runs a Python script in this process while a
sampler thread reads every thread's state, CPU and CPU time from /proc/self/task/*/stat.

    python benchmarks/probes/thread_probe.py [--every MS] SCRIPT [ARGS...]

The script runs as __main__ with ARGS as its argv (e.g. `step_profile.py --wall-only ...`); its
own output comes first, then one JSON line {"probe": ...}: the process's CPU affinity and, for
the busiest threads, their name, CPU ticks used while sampled, how many samples found them
running and the CPUs they were seen on. What it answers: whether a host-bound decode step is
one thread's work, and whether a CPU placement (`taskset`) changes the step
(`benchmarks/gpu_run.sh pin`).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import runpy
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any


def read_threads() -> dict[str, tuple[str, str, int, int]]:
    """tid -> (name, state, CPU last run on, user + system ticks)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            text = Path(f"/proc/self/task/{tid}/stat").read_text()
        except OSError:  # the thread ended
            continue
        name = text[text.index("(") + 1:text.rindex(")")]
        fields = text[text.rindex(")") + 2:].split()  # fields from the state on (stat's 3rd)
        out[tid] = (name, fields[0], int(fields[36]), int(fields[11]) + int(fields[12]))
    return out


class Sampler:
    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self.cpus: dict[str, Counter[int]] = {}
        self.running: Counter[str] = Counter()
        self.first: dict[str, int] = {}
        self.me = ""
        self.stopped = threading.Event()

    def run(self) -> None:
        self.me = str(threading.get_native_id())  # the sampler leaves itself out
        self.first = {tid: t[3] for tid, t in read_threads().items()}
        while not self.stopped.is_set():
            for tid, (_, state, cpu, _) in read_threads().items():
                if tid != self.me:
                    self.cpus.setdefault(tid, Counter())[cpu] += 1
                    self.running[tid] += state == "R"
            time.sleep(self.every_s)

    def report(self, top: int = 8) -> dict[str, Any]:
        self.stopped.set()
        last = read_threads()
        threads = [{"tid": tid, "name": last[tid][0] if tid in last else None,
                    "cpu_ticks": (last[tid][3] if tid in last else 0) - self.first.get(tid, 0),
                    "running_samples": self.running[tid],
                    "cpus": {str(c): n for c, n in seen.most_common(4)}}
                   for tid, seen in self.cpus.items()]
        threads.sort(key=lambda t: -t["cpu_ticks"])
        return {"affinity": sorted(os.sched_getaffinity(0)), "main_tid": str(os.getpid()),
                "every_ms": self.every_s * 1e3, "threads": threads[:top]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--every", type=float, default=20.0, help="sampling period, ms")
    ap.add_argument("script", type=Path)
    ap.add_argument("args", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    sampler = Sampler(args.every / 1e3)
    threading.Thread(target=sampler.run, daemon=True).start()
    # at exit, so the line follows the script's own even when it calls sys.exit
    atexit.register(lambda: print(json.dumps({"probe": sampler.report()}), flush=True))
    sys.argv = [str(args.script), *args.args]
    sys.path.insert(0, str(args.script.resolve().parent))
    runpy.run_path(str(args.script), run_name="__main__")


if __name__ == "__main__":
    main()
