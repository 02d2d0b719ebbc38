"""Graph nodes of one decode step, by primitive: what MLX evaluates for a token.

    python benchmarks/probes/step_nodes.py ARTIFACT [--prompt 512] [--dot FILE]

The engine prefills --prompt tokens, then the decode program is called once uncompiled and
its lazy outputs' nodes are counted by primitive name (profile.graph_nodes, over
mx.export_to_dot, MLX's own graph dump; --dot keeps the dump). On MLX-CUDA with fuselm's
kernels a "CustomKernel" node is one launch; Slice and Reshape nodes launch nothing but are
evaluated one by one. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--dot", type=Path, help="keep the DOT graph here")
    args = ap.parse_args()

    import mlx.core as mx
    import numpy as np

    from fuselm.runtime_metal.engine import make_engine
    from fuselm.runtime_metal.mlx_engine.profile import graph_nodes

    engine = make_engine(args.artifact, "mlx")
    fast = engine.fast
    if fast is None:
        raise SystemExit(f"{args.artifact}: no compiled decode program ({engine.fast_reason})")
    engine.reserve(args.prompt + 8)
    engine.forward((np.arange(1, args.prompt + 1) % 200)[None])  # the ids do not shape the graph
    kv = [a for c in fast.caches for a in c.buffers()]
    outputs = fast.program(mx.array(5, mx.uint32), mx.array(fast.caches[0].offset, mx.int32), *kv)
    if args.dot:
        mx.export_to_dot(str(args.dot), *outputs)
    counts = graph_nodes(*outputs)
    print(json.dumps({"artifact": str(args.artifact), "device": str(mx.default_device()),
                      "nodes": sum(counts.values()), "by_primitive": dict(counts.most_common())}))


if __name__ == "__main__":
    main()
