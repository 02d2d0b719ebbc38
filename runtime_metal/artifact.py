"""The artifact format: what `fuselm convert` writes into OUT_DIR and the runtime reads back.

OUT_DIR/
  model.onnx          the fused-op graph (weights in external data)
  model.onnx.data     weights, written once, straight from the checkpoint
  fuselm.json         this module's schema: versioned metadata + what was done
  tokenizer files, generation_config.json   copied from the source checkpoint

fuselm.json belongs to the runtime (its consumer); converter/ writes through `write_manifest`.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

FORMAT = "fuselm"
FORMAT_VERSION = 1
MANIFEST = "fuselm.json"
MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
)
GENERATION_CONFIG = "generation_config.json"


class ArtifactError(Exception):
    """A fuselm output directory that cannot be read; the message says what to do."""


@dataclass
class ModelInfo:
    architecture: str
    family: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    context_length: int
    sliding_window: int | None = None


@dataclass
class RopeInfo:
    type: str  # default | linear | dynamic | llama3 | yarn | none
    theta: float
    rotary_dim: int
    attention_scale: float = 1.0
    interleaved: bool = False
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass
class Manifest:
    model: ModelInfo
    rope: RopeInfo
    dtype: str  # float activations/weights of the graph: float32 | float16
    special_tokens: dict[str, Any]  # bos: int|None, eos: [int], pad: int|None
    source: dict[str, Any]  # path, checkpoint dtype, shards
    versions: dict[str, str]
    quantization: dict[str, Any] | None = None
    passes: dict[str, Any] = field(default_factory=dict)  # the pass manager's report
    steps: list[str] = field(default_factory=list)  # what was done, in order
    files: dict[str, Any] = field(default_factory=dict)
    integrity: dict[str, Any] | None = None  # sizes and hashes of the files (integrity.py)
    format: str = FORMAT
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=False)

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self.special_tokens.get("eos") or []
        return [int(e) for e in (eos if isinstance(eos, list) else [eos])]


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to `path` through a temp file in the same folder, then rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)  # mkstemp makes it private; the result is not
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_manifest(out_dir: str | Path, manifest: Manifest) -> Path:
    path = Path(out_dir) / MANIFEST
    atomic_write_text(path, manifest.to_json() + "\n")
    return path


def read_manifest(out_dir: str | Path) -> Manifest:
    """Read OUT_DIR/fuselm.json; raise ArtifactError naming the problem and the fix."""
    root = Path(out_dir)
    path = root / MANIFEST
    if not root.is_dir():
        aside = sorted(root.parent.glob(f".{root.name}.old-*"))  # converter/out_dir.py's swap
        hint = (f" (a conversion killed mid-swap set it aside as {aside[0]}; run the same "
                "`fuselm convert` again to restore it)" if aside else "")
        raise ArtifactError(
            f"{root} is not a directory; pass the folder `fuselm convert` wrote{hint}")
    if not path.is_file():
        raise ArtifactError(
            f"{path} not found: {root} is not a fuselm artifact; create one with "
            f"`fuselm convert MODEL_DIR -o {root}`"
        )
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{path} is not valid JSON ({e}); re-run `fuselm convert`") from e
    except PermissionError:
        raise ArtifactError(f"cannot read {path}: permission denied; fix its permissions"
                            ) from None
    from fuselm.runtime_metal.manifest_schema import check  # it imports this module

    check(raw, path)  # types, values and format_version, one field named per error
    try:
        return Manifest(
            model=ModelInfo(**raw["model"]),
            rope=RopeInfo(**raw["rope"]),
            dtype=raw["dtype"],
            special_tokens=raw.get("special_tokens", {}),
            source=raw.get("source", {}),
            versions=raw.get("versions", {}),
            quantization=raw.get("quantization"),
            passes=raw.get("passes", {}),
            steps=raw.get("steps", []),
            files=raw.get("files", {}),
            integrity=raw.get("integrity"),
        )
    except (KeyError, TypeError) as e:
        raise ArtifactError(f"{path} is missing or has malformed fields ({e}); re-convert") from e


def model_path(out_dir: str | Path) -> Path:
    path = Path(out_dir) / MODEL_FILE
    if not path.is_file():
        raise ArtifactError(f"{path} not found; re-run `fuselm convert` into {out_dir}")
    return path
