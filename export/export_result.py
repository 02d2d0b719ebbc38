"""What an export step hands the convert pipeline: the spec, the graph dtype, timings.

Its own module so that the torch exporter (export/onnx_export.py) and the torch-free graph
builder (export/graph_builder.py) return the same type without one importing the other.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx

from fuselm.export.config import DecoderSpec
from fuselm.given_blocks import GivenBlocks


@dataclass
class ExportResult:
    spec: DecoderSpec
    dtype: str
    checkpoint_dtype: str
    seconds: dict[str, float] = field(default_factory=dict)
    weight_bytes: int = 0
    nonfinite: list[str] = field(default_factory=list)  # let through by allow_nonfinite
    # in_memory=True: the model (not saved, its weights data-less) and, per weight, a function
    # reading its values from the checkpoint (the passes wrap them: passes/weights.py
    # ComputedValues; export takes only the op contract from passes/)
    model: onnx.ModelProto | None = None
    sources: dict[str, Callable[[], np.ndarray]] = field(default_factory=dict)
    # the blocks the checkpoint gives for an initializer, by its name (None: floats only), in
    # the checkpoint's [N, K] layout (fuselm/given_blocks.py); None: this export offers none
    given: Callable[[str], GivenBlocks | None] | None = None


def given_lookup(ckpt: Any, sources: Mapping[str, Any]
                 ) -> Callable[[str], GivenBlocks | None] | None:
    """ExportResult.given for a checkpoint that offers given blocks (`given_blocks(hf_name)`,
    a GGUF's), over the exporter's parameter sources (export/family.py Source by initializer
    name): the blocks in the checkpoint's [N, K] layout, rows cut as the values are; None
    where it gives floats or the values are changed on the way (an offset)."""
    read = getattr(ckpt, "given_blocks", None)
    if read is None:
        return None

    def given(name: str) -> GivenBlocks | None:
        src = sources.get(name)
        if src is None or src.offset:
            return None
        blocks = read(src.hf_name)
        if blocks is not None and src.rows is not None:
            blocks = blocks.take_rows(slice(*src.rows))
        return blocks

    return given
