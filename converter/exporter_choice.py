"""Which exporter writes a conversion's graph: the graph builder (export/graph_builder.py, no
torch) by default, or the torch trace (export/onnx_export.py), its oracle. Both write the same
plain decoder graph for every family; the passes do the fusing either way.

`FUSELM_EXPORT=torch` (RuntimeConfig.export, fuselm/config.py) forces the trace for any input
(the ladder's cross-check of the builder).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from fuselm.config import EXPORT_ENV, resolve
from fuselm.export.config import DecoderSpec

BUILDER = "graph builder"  # fuselm.json's source.exporter when the builder wrote the graph


def trace_reason(extra: str | None = None) -> str | None:
    """Why this conversion goes through the torch trace (None: the graph builder, for any
    options: its graph is the trace's, fused or not). `extra`: a reason the caller found in
    the input itself."""
    if resolve().export == "torch":
        return f"{EXPORT_ENV}=torch"
    return extra


def exporter_for(spec: DecoderSpec, gguf: bool = False,
                 extra: str | None = None) -> tuple[Callable[..., Any], str]:
    """The exporter (export_model's signature, `spec` bound) and fuselm.json's label for it."""
    reason = trace_reason(extra)
    if reason is not None:
        from fuselm.export.onnx_export import export_model

        return export_model, f"torch ({reason})"
    from fuselm.export.graph_builder import build_model

    if gguf:
        return partial(_through_file, partial(build_model, spec=spec)), BUILDER
    return partial(build_model, spec=spec), BUILDER


def _through_file(exporter: Callable[..., Any], *args: Any, in_memory: bool = False,
                  **kwargs: Any) -> Any:
    """`exporter` writing raw.onnx.data, whatever the pipeline asks: a GGUF tensor is
    dequantized to float32 on every read, so weights read from the file in the graph's dtype
    cost less memory than recipes reading the GGUF (SmolLM2's default Q4 convert: 387.6 MB
    peak through the file, 450.6 MB in memory; its bound is 403.4 MB: BENCHMARKS.md 'Convert time
    and memory')."""
    return exporter(*args, in_memory=False, **kwargs)
