"""`fuselm convert MODEL.gguf`: a GGUF file through the ordinary convert pipeline.

The file's metadata becomes a small staged HF directory (config.json, generation config,
tokenizer files with the chat template) in a temporary folder; the weights are read from the
GGUF itself, dequantized one tensor at a time (export/gguf_source.py).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from fuselm.converter import out_dir as out_dir_safety
from fuselm.converter import pipeline
from fuselm.export import heap
from fuselm.export.gguf_source import GGUFCheckpoint, source_record, stage

# FUSELM_GGUF_EXPORT=torch: trace with torch as for an HF checkpoint (the ladder's cross-check)
EXPORT_ENV = "FUSELM_GGUF_EXPORT"


def torch_reason(ckpt: GGUFCheckpoint, options: pipeline.ConvertOptions | None) -> str | None:
    """Why this conversion goes through the torch exporter (None: the torch-free builder)."""
    from fuselm.export.gguf_graph import unsupported

    opts = options or pipeline.ConvertOptions()
    if os.environ.get(EXPORT_ENV, "") == "torch":
        return f"{EXPORT_ENV}=torch"
    if not opts.optimize or opts.passes is not None:
        return "an unfused or partly fused graph was asked for"
    return unsupported(ckpt)


def convert_gguf(path: str | Path, out_dir: str | Path,
                 options: pipeline.ConvertOptions | None = None,
                 progress: pipeline.Progress | None = None) -> pipeline.ConvertResult:
    path = Path(path)
    out_dir_safety.check_paths(path, Path(out_dir))
    ckpt = GGUFCheckpoint(path)  # validates architecture, tensor types and size first
    with tempfile.TemporaryDirectory(prefix="fuselm-gguf-") as meta:
        stage(ckpt, Path(meta))
        heap.release()  # the tokenizer converter's objects, before the weights are read
        source = {**source_record(ckpt), "path": str(path.resolve())}
        reason = torch_reason(ckpt, options)
        if reason is not None:
            source["exporter"] = f"torch ({reason})"
            return pipeline.convert(meta, out_dir, options, progress, checkpoint=ckpt,
                                    source=source)
        from fuselm.export.gguf_graph import build_model, gguf_spec

        source["exporter"] = "gguf graph builder"
        return pipeline.convert(meta, out_dir, options, progress, checkpoint=ckpt, source=source,
                                exporter=build_model, spec=gguf_spec(Path(meta), ckpt))
