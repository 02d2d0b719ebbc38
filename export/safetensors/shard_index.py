"""`model.safetensors.index.json`: its shape checked and every shard path confined to the model
folder before any shard is opened.

A path *written* in the index may not leave MODEL_DIR (`../x`, `/etc/passwd`, a folder
symlinked elsewhere): the checkpoint is read from inside the folder the user named, as the
runtime reads external data only from inside an artifact (runtime_metal/loader.py). A shard
*file* that is itself a symlink may point anywhere: the Hugging Face cache stores every file of
a snapshot as a link into its blob store, so only the folders on the written path are resolved.
"""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath

from fuselm.export.errors import ExportError
from fuselm.export.json_file import read_json
from fuselm.input_files import check_regular

INDEX = "model.safetensors.index.json"


def _confined(root: Path, written: str, index: Path) -> Path:
    """root / written, refused unless the written path stays inside root (see module doc)."""
    pure = PurePosixPath(written.replace("\\", "/"))
    inside = (
        written.strip() != ""
        and not pure.is_absolute()
        and not Path(written).is_absolute()
        and ".." not in pure.parts
        and pure.name not in ("", ".")
    )
    candidate = root.joinpath(*pure.parts)
    if inside:  # the folders on the path, resolved, must still be inside the model folder
        inside = candidate.parent.resolve().is_relative_to(root.resolve())
    if not inside:
        raise ExportError(
            f"{index} names shard {json.dumps(written)}, which lies outside the model folder "
            f"{root}; refusing to read it (a checkpoint's shards sit inside its folder)"
        )
    return candidate


def shard_files(root: Path) -> list[Path]:
    """The distinct shard files the index in `root` names, confined and present, sorted."""
    index = root / INDEX
    data = read_json(index, "re-save the checkpoint")
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        shown = json.dumps(weight_map)[:60] if isinstance(data, dict) else "missing"
        raise ExportError(
            f"{index} is malformed: weight_map is {shown}; it must be a non-empty object of "
            "tensor name -> shard file; re-save the checkpoint"
        )
    bad = next(((k, v) for k, v in weight_map.items() if not isinstance(v, str)), None)
    if bad is not None:
        raise ExportError(
            f"{index} is malformed: weight_map[{json.dumps(bad[0])}] is "
            f"{json.dumps(bad[1])[:60]}; it must be a shard file name (string)"
        )
    files = sorted({_confined(root, shard, index) for shard in weight_map.values()})
    for f in files:  # a directory or FIFO under a shard's name: refused, not read
        check_regular(f)
    missing = [str(f.relative_to(root)) for f in files if not f.is_file()]
    if missing:
        raise ExportError(
            f"{index} names shards that are missing: {', '.join(missing)}; "
            "copy the complete checkpoint"
        )
    return files
