"""One rank of the parallel tests' job (tests/runtime/test_parallel.py starts two, as
mlx.launch does): every case of the spec opened with `parallel=MODE`, its prompt's logits and
greedy tokens written to OUT/rank{R}.json (logits as OUT/{case}.npy from rank 0)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from fuselm.runtime_metal.loaded_model import open_model


def main() -> None:
    spec, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    results = {}
    rank = 0
    for case in spec["cases"]:
        model = open_model(case["artifact"], "mlx", parallel=case["mode"])
        rank = model.engine.parallel.rank  # type: ignore[attr-defined]
        logits = model.engine.forward(np.array(spec["prompt"]), all_logits=True)
        model.engine.reset()
        tokens = model.generate(spec["prompt"], max_new_tokens=spec["new_tokens"]).tokens
        if rank == 0:
            np.save(out / f"{case['name']}.npy", logits)
        results[case["name"]] = {"tokens": tokens,
                                 "weight_bytes": model.engine.weight_bytes}  # type: ignore[attr-defined]
    (out / f"rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
