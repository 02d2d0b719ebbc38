"""`--quant mixed` with the largest tensor (a tied embedding table / LM head) forced into 8-bit
blocks of 128 and every other tensor chosen by q4_allocate.choose_bits under REST_BITS bits per
weight: the configuration the choice's ranking does not pick on Gemma 3 270M (it ranks the
layers first), measured end to end to check that ranking.

    PYTHONPATH=. .venv/bin/python benchmarks/probes/mixed_table_first.py HF_DIR OUT REST_BITS
    .venv/bin/fuselm perplexity OUT --context 1024 --text TEXT --json
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

import fuselm.passes.quant.quantize as quantize
from fuselm.converter.api import convert
from fuselm.passes.quant.q4_allocate import choose_bits


def table_first(rest_bits: float) -> Callable[..., dict[str, tuple[int, int]]]:
    def choose(items: Sequence[tuple[str, Callable[[], np.ndarray], str | None]],
               budget: float, block: int, *args: Any, **kwargs: Any
               ) -> dict[str, tuple[int, int]]:
        sizes = {name: get().size for name, get, _ in items}
        table = max(sizes, key=lambda n: sizes[n])
        plan = choose_bits([it for it in items if it[0] != table], rest_bits, block, *args,
                           **kwargs)
        plan[table] = (8, 128)
        return plan

    return choose


def main() -> None:
    hf_dir, out, rest = sys.argv[1], sys.argv[2], float(sys.argv[3])
    quantize.choose_bits = table_first(rest)  # the pass's own choice, replaced for this run
    convert(hf_dir, out, quant="mixed")


if __name__ == "__main__":
    main()
