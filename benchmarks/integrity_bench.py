"""What integrity and validation cost, as JSON: hashing at convert time (the convert's own
`hash` stage against its total, and that stage re-timed now), `fuselm verify` (a whole-artifact
SHA-256), and at load time the fuselm.json schema check and the data-file size check against a
whole engine load.

    python benchmarks/integrity_bench.py WORK_DIR [--shape qwen3-0.6b|tiny] [--repeats 5]

WORK_DIR keeps the built checkpoint and the artifact, so a second run reuses them (the convert
figures then come from the first run's fuselm.json). Medians over --repeats; page cache warm.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def _median(fn, repeats: int) -> float:  # noqa: ANN001
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("work_dir", type=Path)
    ap.add_argument("--shape", choices=["qwen3-0.6b", "tiny"], default="qwen3-0.6b")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    from fuselm.converter.models.builtin import QWEN3_0_6B, build_model
    from fuselm.converter.pipeline import ConvertOptions, convert
    from fuselm.runtime_metal import artifact, integrity, manifest_schema
    from fuselm.runtime_metal.engine import make_engine

    ckpt, out = args.work_dir / "ckpt", args.work_dir / "out"
    shape = QWEN3_0_6B if args.shape == "qwen3-0.6b" else {}
    if not (ckpt / "config.json").is_file():
        build_model(ckpt, "qwen3", seed=0, dtype="bfloat16", tokenizer=False, **shape)
    if not (out / artifact.MANIFEST).is_file():
        convert(ckpt, out, ConvertOptions())  # the defaults: checkpoint dtype (bf16 → float16)
    manifest = artifact.read_manifest(out)
    conv = manifest.source["seconds"]
    total = sum(conv.values())
    data_bytes = manifest.integrity["files"][artifact.DATA_FILE]["size"]

    names = list(manifest.integrity["files"])
    record_s = _median(lambda: integrity.record(out, names), max(1, args.repeats // 2))
    verify_s = _median(lambda: integrity.verify(out, manifest), max(1, args.repeats // 2))
    raw = json.loads((out / artifact.MANIFEST).read_text())
    path = out / artifact.MANIFEST
    schema_s = _median(lambda: manifest_schema.check(raw, path), args.repeats * 20)
    sizes_s = _median(lambda: integrity.check_sizes(out, manifest), args.repeats * 20)
    read_s = _median(lambda: artifact.read_manifest(out), args.repeats * 20)
    load_s = _median(lambda: make_engine(out, "onnxruntime"), args.repeats)
    print(json.dumps({
        "shape": args.shape,
        "data_bytes": data_bytes,
        "tensors_recorded": len(manifest.integrity["tensors"].get(artifact.DATA_FILE, {})),
        "convert_seconds": conv,
        "hash_share_of_convert": round(conv["hash"] / total, 4),
        # convert's hash stage re-timed now on the same artifact (this build's code)
        "record_seconds": round(record_s, 3),
        "record_share_of_convert": round(record_s / (total - conv["hash"] + record_s), 4),
        "verify_seconds": round(verify_s, 3),
        "verify_MB_per_s": round(data_bytes / 1e6 / verify_s, 1),
        "load": {
            "schema_check_ms": round(schema_s * 1e3, 3),
            "size_check_ms": round(sizes_s * 1e3, 3),
            "read_manifest_ms": round(read_s * 1e3, 3),
            "onnxruntime_engine_load_s": round(load_s, 3),
            "added_share_of_load": round((schema_s + sizes_s) / load_s, 5),
        },
    }, indent=2))


if __name__ == "__main__":
    main()
