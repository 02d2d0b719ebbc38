"""The artifact format: what `fuselm convert` writes into OUT_DIR and the runtime reads back.

OUT_DIR/
  model.onnx          the fused-op graph (weights in external data)
  model.onnx.data     weights, written once, straight from the checkpoint
  fuselm.json         this module's schema: versioned metadata + what was done
  tokenizer files, generation_config.json   copied from the source checkpoint

fuselm.json belongs to the runtime (its consumer); converter/ writes through `write_manifest`.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from fuselm.input_files import check_regular, load_file
from fuselm.runtime_metal.manifest_schema import check
from fuselm.runtime_metal.manifest_types import (  # noqa: F401  (re-exported: the format's API)
    FORMAT,
    FORMAT_VERSION,
    ArtifactError,
    Manifest,
    ModelInfo,
    RopeInfo,
)

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
    "tokenizer.model",  # SentencePiece: the whole tokenizer of a checkpoint without tokenizer.json
)
GENERATION_CONFIG = "generation_config.json"
INTERMEDIATE_FILES = ("raw.onnx", "raw.onnx.data")  # `convert --keep-intermediate`


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
    check_regular(path)
    if not path.is_file():
        if (root / "config.json").is_file():  # an HF checkpoint: convert it beside itself
            sibling = root.resolve().parent / f"{root.resolve().name}-fuselm"
            raise ArtifactError(
                f"{root} is a Hugging Face checkpoint, not a fuselm artifact; convert it first: "
                f"`fuselm convert {root} -o {sibling}`, then pass {sibling}"
            )
        raise ArtifactError(
            f"{path} not found: {root} is not a fuselm artifact; create one with "
            f"`fuselm convert MODEL_DIR -o {root}`"
        )
    try:
        raw = load_file(path)
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError and JSONTooDeep too
        raise ArtifactError(f"{path} is not valid JSON ({e}); re-run `fuselm convert`") from None
    except PermissionError:
        raise ArtifactError(f"cannot read {path}: permission denied; fix its permissions"
                            ) from None
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
    check_regular(path)
    if not path.is_file():
        raise ArtifactError(f"{path} not found; re-run `fuselm convert` into {out_dir}")
    return path
