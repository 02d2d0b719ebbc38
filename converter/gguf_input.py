"""`fuselm convert MODEL.gguf`: a GGUF file through the ordinary convert pipeline.

The file's metadata becomes a small staged HF directory (config.json, generation config,
tokenizer files with the chat template) in a temporary folder; the weights are read from the
GGUF itself, dequantized one tensor at a time (export/gguf/source.py).
"""

from __future__ import annotations

from pathlib import Path

from fuselm.converter import out_dir as out_dir_safety
from fuselm.converter import pipeline
from fuselm.converter.exporter_choice import exporter_for, trace_reason
from fuselm.export import heap
from fuselm.export.gguf.source import (
    GGUFCheckpoint,
    builder_unsupported,
    gguf_spec,
    source_record,
    stage,
)
from fuselm.export.tensor_match import check_layer_count


def torch_reason(ckpt: GGUFCheckpoint) -> str | None:
    """Why this conversion goes through the torch exporter (None: the graph builder)."""
    return trace_reason(extra=builder_unsupported(ckpt))


def convert_gguf(path: str | Path, out_dir: str | Path,
                 options: pipeline.ConvertOptions | None = None,
                 progress: pipeline.Progress | None = None) -> pipeline.ConvertResult:
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
            return pipeline.convert(meta, out_dir, options, progress, checkpoint=ckpt,
                                    source=source)
        spec = gguf_spec(Path(meta), ckpt)
        exporter, source["exporter"] = exporter_for(spec, gguf=True)
        return pipeline.convert(meta, out_dir, options, progress, checkpoint=ckpt, source=source,
                                exporter=exporter, spec=spec)
