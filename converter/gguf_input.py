"""`fuselm convert MODEL.gguf`: a GGUF file through the ordinary convert pipeline.

The file's metadata becomes a small staged HF directory (config.json, generation config,
tokenizer files with the chat template) in a temporary folder; the weights are read from the
GGUF itself, dequantized one tensor at a time (export/gguf_source.py).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from fuselm.converter import out_dir as out_dir_safety
from fuselm.converter import pipeline
from fuselm.export import heap
from fuselm.export.gguf_source import GGUFCheckpoint, source_record, stage


def convert_gguf(path: str | Path, out_dir: str | Path,
                 options: pipeline.ConvertOptions | None = None,
                 progress: pipeline.Progress | None = None) -> pipeline.ConvertResult:
    path = Path(path)
    out_dir_safety.check_paths(path, Path(out_dir))
    ckpt = GGUFCheckpoint(path)  # validates architecture, tensor types and size first
    with tempfile.TemporaryDirectory(prefix="fuselm-gguf-") as meta:
        stage(ckpt, Path(meta))
        heap.release()  # the tokenizer converter's objects, before the trace starts
        source = {**source_record(ckpt), "path": str(path.resolve())}
        return pipeline.convert(meta, out_dir, options, progress, checkpoint=ckpt, source=source)
