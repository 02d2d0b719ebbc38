"""Memory of a loaded artifact on the MLX engine, as JSON: the weight arrays the plan holds
(each array once, however many QWeights share it), MLX's active and peak memory, and the
process's resident set now and at its peak, after an 8-token prefill and 3 decode steps.

    python benchmarks/load_memory.py OUT_DIR [--repo PATH]

`--repo` imports fuselm from another checkout (a git worktree of an older commit) to compare
builds on one artifact.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import sys
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--repo", default=str(Path(__file__).resolve().parents[1]))
    args = ap.parse_args()
    sys.path.insert(0, args.repo)
    import mlx.core as mx
    import numpy as np

    from fuselm.runtime_metal.engine import make_engine
    from fuselm.runtime_metal.mlx_engine.qweight import held_bytes

    engine = make_engine(args.out_dir, "mlx")
    engine.forward(np.arange(1, 9)[None])
    for _ in range(3):
        mx.eval(engine.decode_step(mx.array(5)))
    gc.collect()
    pages = int(Path("/proc/self/statm").read_text().split()[1]) if Path(
        "/proc/self/statm").exists() else 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak_bytes = peak if sys.platform == "darwin" else peak * 1024
    print(json.dumps({
        "artifact": args.out_dir,
        "repo": args.repo,
        "device": str(mx.default_device()),
        "held_weights_MB": round(held_bytes(engine.plan.constants) / 1e6, 1),
        "mlx_active_MB": round(mx.get_active_memory() / 1e6, 1),
        "mlx_peak_MB": round(mx.get_peak_memory() / 1e6, 1),
        "rss_now_MB": round(pages * os.sysconf("SC_PAGE_SIZE") / 1e6, 1) if pages else None,
        "rss_peak_MB": round(peak_bytes / 1e6, 1),
    }, indent=2))


if __name__ == "__main__":
    main()
