"""A batched step's grammar masks filled row by row against together on llguidance's threads
(constraint.fill_masks), along one valid document of constraint_bench's schema.

    python benchmarks/probes/mask_fill.py [--artifact DIR] [--rows 1 8 16] [--threads N] [-r 3]

--artifact: a converted model (its tokenizer and vocabulary); default constraint_bench's
SmolLM2-135M conversion (the bundled GGUF, converted once). --threads: the pool's size
(default fuselm's, constraint.POOL_THREADS, at least 2). Per row count: the median µs a
step over the document's tokens, each way, the ways alternating over -r rounds. Prints one
JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from fuselm.runtime_metal.constraint import (
    POOL_THREADS,
    TokenConstraint,
    constraint_vocab,
    fill_masks,
    json_schema_grammar,
)
from fuselm.runtime_metal.loaded_model import open_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from constraint_bench import SCHEMA, artifact  # noqa: E402

DOCUMENT = '{"name": "Alice Smith", "age": 42, "tags": ["admin", "user"]}'


def walk(vocab: object, grammar: str, doc: list[int], rows: int, threads: int) -> float:
    """Median µs a step to fill `rows` masks, every row at the same place in the document."""
    cs = [TokenConstraint(vocab, grammar) for _ in range(rows)]
    bits = np.zeros((rows, cs[0].words), np.int32)
    times = []
    for token in doc:
        t0 = time.perf_counter()
        fill_masks([(c, r) for r, c in enumerate(cs)], bits, threads=threads)
        times.append(time.perf_counter() - t0)
        for c in cs:
            c.advance(token)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--artifact", type=Path)
    ap.add_argument("--work", type=Path, default=Path("/tmp/fuselm_constraint_bench"))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--threads", type=int, default=max(2, POOL_THREADS))
    ap.add_argument("-r", type=int, default=3)
    args = ap.parse_args()
    model = open_model(artifact(args), "onnxruntime")
    vocab = constraint_vocab(model.tokenizer, model.manifest.model.vocab_size, model.eos_ids)
    grammar = json_schema_grammar(SCHEMA)
    doc = model.tokenizer.encode(DOCUMENT, add_special_tokens=False)
    out: dict[str, object] = {"probe": "mask_fill", "vocab": model.manifest.model.vocab_size,
                              "tokens": len(doc), "cpus": os.cpu_count(),
                              "threads": args.threads,
                              "load_average": os.getloadavg()[:2],
                              "machine": platform.machine(), "rows": {}}
    for rows in args.rows:
        walk(vocab, grammar, doc, rows, args.threads)  # warm-up: the pool's threads, the lexer
        by_row, together = [], []
        for _ in range(args.r):
            by_row.append(walk(vocab, grammar, doc, rows, 1))
            together.append(walk(vocab, grammar, doc, rows, args.threads))
        out["rows"][str(rows)] = {"row_by_row_us": round(statistics.median(by_row), 1),  # type: ignore[index]
                                  "together_us": round(statistics.median(together), 1)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
