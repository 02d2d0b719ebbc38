"""A GGUF file staged for the ordinary convert pipeline (converter/pipeline.py calls this).

The file's metadata becomes a small staged HF directory (config.json, generation config,
tokenizer files with the chat template) in a temporary folder; the weights are read from the
GGUF itself, dequantized one tensor at a time (export/gguf/source.py). This module prepares;
the pipeline converts, so the two do not call each other.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fuselm.converter import out_dir as out_dir_safety
from fuselm.converter.exporter_choice import exporter_for, trace_reason
from fuselm.export import heap
from fuselm.export.config import DecoderSpec
from fuselm.export.gguf.source import (
    GGUFCheckpoint,
    builder_unsupported,
    gguf_spec,
    source_record,
    stage,
)
from fuselm.export.tensor_match import check_layer_count


@dataclass(frozen=True)
class StagedGGUF:
    """What the pipeline converts: the staged HF folder, the file as its checkpoint, the
    source record, and the exporter (None: the torch trace) with its spec."""

    meta: Path
    checkpoint: GGUFCheckpoint
    source: dict[str, Any]
    exporter: Callable[..., Any] | None
    spec: DecoderSpec | None


def torch_reason(ckpt: GGUFCheckpoint) -> str | None:
    """Why this conversion goes through the torch exporter (None: the graph builder)."""
    return trace_reason(extra=builder_unsupported(ckpt))


@contextmanager
def staged_gguf(path: str | Path, out_dir: str | Path) -> Iterator[StagedGGUF]:
    """The GGUF at `path` staged for a conversion into `out_dir`; the staged folder lives as
    long as the context."""
    path = Path(path)
    out_dir_safety.check_paths(path, Path(out_dir))
    ckpt = GGUFCheckpoint(path)  # validates architecture, tensor types and size first
    check_layer_count(ckpt.tensors, path, ckpt.config["num_hidden_layers"],
                      f"metadata {ckpt.gguf.value('general.architecture')}.block_count")
    # The staged folder carries this process's id: a conversion killed now leaves it behind,
    # and the next conversion removes it (out_dir.remove_dead_scratch).
    with out_dir_safety.scratch("gguf") as meta:
        try:
            stage(ckpt, meta)
        except OSError as e:
            if e.errno in out_dir_safety.NO_SPACE:
                raise out_dir_safety.no_space(e, Path(out_dir), meta.parent) from None
            raise
        heap.release()  # the tokenizer converter's objects, before the weights are read
        source = {**source_record(ckpt), "path": str(path.resolve())}
        reason = torch_reason(ckpt)
        if reason is not None:
            source["exporter"] = f"torch ({reason})"
            yield StagedGGUF(Path(meta), ckpt, source, None, None)
            return
        spec = gguf_spec(Path(meta), ckpt)
        exporter, source["exporter"] = exporter_for(spec, gguf=True)
        yield StagedGGUF(Path(meta), ckpt, source, exporter, spec)
