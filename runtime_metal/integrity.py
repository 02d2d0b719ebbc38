"""Integrity of an artifact's files: sizes and SHA-256 recorded at convert, checked later.

fuselm.json's `integrity` section (written by `record`, read back as `Manifest.integrity`):

    {"algorithm": "sha256",
     "files":   {"model.onnx.data": {"size": 393216, "sha256": "…"}, "model.onnx": {…}, …},
     "tensor_digest": "crc32",
     "tensors": {"model.onnx.data": {"<initializer>": "<CRC-32 of its bytes, 8 hex digits>"}}}

- every load checks the data files' sizes (`check_sizes`: one stat per file, so a truncated
  copy, an empty file or a data file from another conversion is an error before any work),
  and model.onnx's hash (`check_graph`: the graph alone, weights being external data, so a
  graph edited after conversion is an error, not a different model run without a word);
- `fuselm verify` and `run --verify` hash every recorded file (`verify`). When a data file's
  hash differs, the per-tensor digests name the first damaged initializer: each digest covers
  exactly the byte range the initializer's external data points at, so the damaged byte range
  maps back to the tensor that owns it.

Hashing costs one read of the data file at convert time (a SHA-256 and a CRC-32 per byte) and
one at verify time (the SHA-256; the CRC-32s only after a mismatch).
"""

from __future__ import annotations

import hashlib
import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fuselm.runtime_metal.artifact import DATA_FILE, MANIFEST, MODEL_FILE, ArtifactError, Manifest
from fuselm.runtime_metal.artifact_paths import confined

ALGORITHM = "sha256"
CHUNK = 8 << 20
TENSOR_DIGEST = "crc32"  # per tensor: finds the damage, the file's SHA-256 proves it


def _open(path: Path):  # noqa: ANN202 - a binary file
    try:
        return path.open("rb")
    except PermissionError:
        raise ArtifactError(f"cannot read {path}: permission denied; fix its permissions") from None


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with _open(path) as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def tensor_ranges(model_file: Path) -> dict[str, list[tuple[int, int, str]]]:
    """data file name -> [(offset, length, initializer name)] sorted by offset."""
    import onnx

    model = onnx.load(str(model_file), load_external_data=False)
    out: dict[str, list[tuple[int, int, str]]] = {}
    for t in model.graph.initializer:
        if t.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = {e.key: e.value for e in t.external_data}
        if "location" in info and "length" in info:
            out.setdefault(info["location"], []).append(
                (int(info.get("offset", 0)), int(info["length"]), t.name))
    for spans in out.values():
        spans.sort()
    return out


def digests(path: Path, spans: list[tuple[int, int, str]]) -> tuple[str, dict[str, str]]:
    """One read of `path`: its SHA-256, and the CRC-32 of each span (offset, length, name).

    CRC-32 is only there to find which tensor a damaged file damaged (the SHA-256 says whether
    the file is intact): zlib's CRC-32 costs about half a SHA-256 here, so recording both at
    convert time costs ~1.5 hashes per byte instead of 2."""
    h, crcs = hashlib.sha256(), {name: 0 for _, _, name in spans}
    first, pos = 0, 0
    with _open(path) as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            view, end = memoryview(chunk), pos + len(chunk)
            while first < len(spans) and sum(spans[first][:2]) <= pos:
                first += 1  # spans that ended before this chunk
            k = first
            while k < len(spans) and spans[k][0] < end:
                offset, length, name = spans[k]
                a, b = max(offset, pos) - pos, min(offset + length, end) - pos
                if b > a:
                    crcs[name] = zlib.crc32(view[a:b], crcs[name])
                k += 1
            pos = end
    return h.hexdigest(), {name: f"{crc:08x}" for name, crc in crcs.items()}


def record(root: Path, names: list[str]) -> dict[str, Any]:
    """Sizes and hashes of the artifact files `names` in `root` (those that exist), and the
    CRC-32 of each tensor of the data files model.onnx points at."""
    ranges = tensor_ranges(root / MODEL_FILE) if (root / MODEL_FILE).is_file() else {}
    files, tensors = {}, {}
    for name in names:
        path = root / name
        if path.is_file():
            digest, crcs = digests(path, ranges.get(name, []))
            files[name] = {"size": path.stat().st_size, ALGORITHM: digest}
            if name in ranges:
                tensors[name] = crcs
    return {"algorithm": ALGORITHM, "tensor_digest": TENSOR_DIGEST, "files": files,
            "tensors": tensors}


def _data_files(manifest: Manifest) -> list[str]:
    recorded = (manifest.integrity or {}).get("files", {})
    names = [n for n in recorded if n != MODEL_FILE and n.endswith(".data")]
    data = manifest.files.get("data", DATA_FILE)
    return names or ([data] if isinstance(data, str) else [DATA_FILE])


def check_sizes(out_dir: str | Path, manifest: Manifest) -> None:
    """Cheap load-time check: each weight file is there, non-empty, and of the recorded size."""
    root = Path(out_dir)
    recorded = (manifest.integrity or {}).get("files", {})
    for name in _data_files(manifest):
        path = confined(root, name, f"{root / MANIFEST} (a weight file)")
        if not path.is_file():
            if name in recorded:
                raise ArtifactError(
                    f"{path} is missing; copy the whole output folder, or re-run `fuselm convert`")
            continue  # an older artifact: the loader reports what the model needs
        if not os.access(path, os.R_OK):  # onnxruntime would only say "SystemError : 13"
            raise ArtifactError(f"cannot read {path}: permission denied; fix its permissions")
        size = path.stat().st_size
        if size == 0:
            raise ArtifactError(
                f"{path} is empty (0 bytes): the weights were lost in a copy or an interrupted "
                "write; copy the folder again or re-run `fuselm convert`")
        want = recorded.get(name, {}).get("size")
        if want is not None and size != want:
            raise ArtifactError(
                f"{path} has {size} bytes but fuselm.json records {want}: it is truncated or "
                "from another conversion; copy the folder again or re-run `fuselm convert` "
                f"(`fuselm verify {root}` checks every file)")


def check_graph(out_dir: str | Path, manifest: Manifest) -> None:
    """Load-time check that model.onnx is the graph the conversion wrote: its SHA-256 against
    the one fuselm.json records. model.onnx holds the graph only (weights are external data),
    so this hashes well under a megabyte even for an 8B model. A graph edited after conversion
    (a node added, an attribute changed) otherwise runs without a word and computes something
    else. An artifact converted before hashes were recorded has none to compare: it loads as
    before (`fuselm verify` says it cannot be verified)."""
    root = Path(out_dir)
    want = (manifest.integrity or {}).get("files", {}).get(MODEL_FILE, {}).get(ALGORITHM)
    path = root / MODEL_FILE
    if want is None or not path.is_file():  # nothing recorded; a missing file: the loader says
        return
    if file_digest(path) != want:
        raise ArtifactError(
            f"{path} is not the graph this artifact's conversion wrote (its SHA-256 differs from "
            f"the one {root / 'fuselm.json'} records): it was edited or replaced after "
            "conversion; re-run `fuselm convert` (`fuselm verify` checks every file)")


@dataclass
class VerifyReport:
    files: dict[str, str] = field(default_factory=dict)  # name -> "ok" | what is wrong
    bytes_hashed: int = 0

    @property
    def ok(self) -> bool:
        return all(v == "ok" for v in self.files.values())

    def first_problem(self) -> str | None:
        return next((f"{n}: {v}" for n, v in self.files.items() if v != "ok"), None)


def _first_bad_tensor(root: Path, name: str, want: dict[str, str]) -> str:
    spans = [s for s in tensor_ranges(root / MODEL_FILE).get(name, []) if s[2] in want]
    _, got = digests(root / name, spans)
    for offset, length, tensor in spans:
        if got[tensor] != want[tensor]:
            return (f"tensor {tensor!r} is damaged (bytes {offset}..{offset + length} of "
                    f"{name})")
    return "the damage lies outside every tensor's bytes (alignment padding)"


def verify(out_dir: str | Path, manifest: Manifest) -> VerifyReport:
    """Hash every file fuselm.json records; name the first damaged tensor of a data file."""
    root = Path(out_dir)
    integrity = manifest.integrity or {}
    if not integrity.get("files"):
        raise ArtifactError(
            f"{root}/fuselm.json records no file hashes (converted by an older fuselm); "
            "re-run `fuselm convert` to get an artifact that can be verified")
    if integrity.get("algorithm", ALGORITHM) != ALGORITHM:
        raise ArtifactError(f"unknown hash algorithm {integrity.get('algorithm')!r} in "
                            f"{root}/fuselm.json; this fuselm checks {ALGORITHM}")
    report = VerifyReport()
    # Every name first: one outside the folder refuses the whole check before any file is read.
    paths = {name: confined(root, name, f"{root / MANIFEST}'s integrity.files")
             for name in integrity["files"]}
    for name, want in integrity["files"].items():
        path = paths[name]
        if not path.is_file():
            report.files[name] = "missing"
            continue
        size = path.stat().st_size
        if size != want.get("size"):
            report.files[name] = f"{size} bytes, fuselm.json records {want.get('size')}"
            continue
        report.bytes_hashed += size
        if file_digest(path) == want.get(ALGORITHM):
            report.files[name] = "ok"
            continue
        tensors = integrity.get("tensors", {}).get(name)
        known = integrity.get("tensor_digest") == TENSOR_DIGEST
        detail = _first_bad_tensor(root, name, tensors) if tensors and known else (
            "content differs")
        report.files[name] = f"sha256 differs: {detail}"
    return report
