"""Where a conversion's memory goes: resident memory of the whole process tree over time, by
phase, as JSON.

    python benchmarks/convert_memory.py MODEL -o OUT [--quant q4] [--interval 0.05]

The convert runs in this process (the CLI's own code path); a thread samples the resident set
(RSS) of this process and of all its children every `--interval` seconds, and the convert's
progress callback marks the phase (stage, trace, weights, passes, ...). Printed: the peak of
the sum over the tree, the phase where it happened, the peak of each phase, the import floor
(RSS after importing the converter, before converting) and the kernel's own peak (ru_maxrss,
this process only) for comparison with `/usr/bin/time -v`.
"""

from __future__ import annotations

import argparse
import json
import resource
import threading
import time
from pathlib import Path


def tree_rss(proc) -> int:  # noqa: ANN001 - a psutil.Process
    import psutil

    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("-o", "--out", required=True)
    ap.add_argument("--quant", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--interval", type=float, default=0.05)
    args = ap.parse_args()

    import psutil

    proc = psutil.Process()
    phase = ["import"]
    peaks: dict[str, int] = {}
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            rss = tree_rss(proc)
            peaks[phase[0]] = max(peaks.get(phase[0], 0), rss)
            time.sleep(args.interval)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    from fuselm.converter import pipeline

    floor = tree_rss(proc)
    phase[0] = "stage"
    t0 = time.perf_counter()

    def progress(stage: str, i: int, n: int) -> None:
        phase[0] = stage

    opts = pipeline.ConvertOptions.from_flags(quant=args.quant, dtype=args.dtype)
    pipeline.convert(Path(args.model), Path(args.out), opts, progress)
    phase[0] = "done"
    seconds = time.perf_counter() - t0
    time.sleep(2 * args.interval)
    stop.set()
    sampler.join()
    top = max(peaks, key=peaks.__getitem__)
    mb = 1 << 20
    print(json.dumps({
        "model": args.model, "quant": args.quant, "seconds": round(seconds, 1),
        "import_floor_mb": round(floor / mb, 1),
        "peak_tree_mb": round(peaks[top] / mb, 1), "peak_phase": top,
        "phase_peaks_mb": {k: round(v / mb, 1) for k, v in peaks.items()},
        "ru_maxrss_self_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "ru_maxrss_children_mb": round(
            resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1),
    }, indent=1))


if __name__ == "__main__":
    main()
