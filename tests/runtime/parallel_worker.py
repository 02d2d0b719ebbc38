"""One rank of the parallel tests' job (tests/runtime/test_parallel.py starts two, as
mlx.launch does): every case of the spec opened with `parallel=MODE`, its prompt's logits and
greedy tokens written to OUT/rank{R}.json (logits as OUT/{case}.npy from rank 0)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

from fuselm.runtime_metal.batch import BatchDecoder
from fuselm.runtime_metal.generate import generate
from fuselm.runtime_metal.loaded_model import open_model
from fuselm.runtime_metal.sampling import SamplingOptions


def batch_tokens(engine: object, prompts: list[list[int]], steps: int) -> dict[str, list[int]]:
    """The batch decoder (the server's) over `prompts`, the last joining after two steps."""
    dec = BatchDecoder(engine, max_batch=4, max_context=128)  # type: ignore[arg-type]
    out: dict[int, list[int]] = {dec.add(p, SamplingOptions()): [] for p in prompts[:-1]}
    for i in range(steps):
        for slot, token in dec.step().items():
            out[slot].append(token)
        if i == 1:
            out[dec.add(prompts[-1], SamplingOptions())] = []
    mx.synchronize()  # the step queued last runs on every rank before any exits
    return {str(k): v for k, v in out.items()}


def main() -> None:
    spec, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    results = {}
    rank = 0
    for case in spec["cases"]:
        model = open_model(case["artifact"], "mlx", parallel=case["mode"])
        rank = model.engine.parallel.rank  # type: ignore[attr-defined]
        logits = model.engine.forward(np.array(spec["prompt"]), all_logits=True)
        model.engine.reset()
        # the engine's own loop: no tokenizer to load (no text, no EOS: every token counts)
        tokens = generate(model.engine, spec["prompt"], max_new_tokens=spec["new_tokens"]).tokens
        if rank == 0:
            np.save(out / f"{case['name']}.npy", logits)
        results[case["name"]] = {"tokens": tokens,
                                 "weight_bytes": model.engine.weight_bytes}  # type: ignore[attr-defined]
        if case.get("batch"):
            results[case["name"]]["batch"] = batch_tokens(model.engine, spec["batch_prompts"],
                                                          spec["new_tokens"])
    (out / f"rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
