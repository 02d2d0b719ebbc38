"""One rank of the parallel tests' job (tests/runtime/test_parallel.py starts two, as
mlx.launch does): every case of the spec opened with `parallel=MODE` (and its engine
`options`), its prompt's logits and
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


def batch_tokens(engine: object, prompts: list[list[int]], steps: int
                 ) -> tuple[dict[str, list[int]], dict[str, object]]:
    """The batch decoder (the server's) over five prompts, each one's tokens, and the
    decoder's describe(): three rows start (the second sampling with a seed), the fourth joins
    after two steps, the sampled one leaves after four, the fifth joins after six (into the
    freed slot; every row greedy now: a pipeline's steps overlap), and after nine all but the
    first leave (one row: a pipeline's whole batch through the ranks in turn)."""
    dec = BatchDecoder(engine, max_batch=4, max_context=128)  # type: ignore[arg-type]
    sampled = SamplingOptions(temperature=0.8, seed=5)
    slots = {dec.add(p, sampled if k == 1 else SamplingOptions()): k
             for k, p in enumerate(prompts[:3])}
    out: dict[int, list[int]] = {k: [] for k in slots.values()}
    joins = {1: 3, 5: 4}
    for i in range(steps):
        for slot, token in dec.step().items():
            out[slots[slot]].append(token)
        if i in joins:
            slots[dec.add(prompts[joins[i]], SamplingOptions())] = joins[i]
            out[joins[i]] = []
        for leaving in [s for s, k in slots.items() if (i, k) == (3, 1) or (i == 8 and k)]:
            dec.remove(leaving)
            del slots[leaving]
    mx.synchronize()  # the step queued last runs on every rank before any exits
    return {str(k): v for k, v in out.items()}, dec.describe()


def main() -> None:
    spec, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    results = {}
    rank = 0
    for case in spec["cases"]:
        model = open_model(case["artifact"], "mlx", parallel=case["mode"],
                           **case.get("options", {}))
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
            tokens, described = batch_tokens(model.engine, spec["batch_prompts"],
                                              spec["batch_steps"])
            results[case["name"]].update(batch=tokens, batch_decoder=described)
    (out / f"rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
