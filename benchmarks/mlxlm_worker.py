"""mlx-lm's side of benchmarks/llamacpp_compare.py (its mlx-lm rows), run by the Python of a venv
that holds mlx-lm (outside this repository). It imports nothing of fuselm: it reads one JSON
request on stdin and prints one JSON object.

    {"op": "quantize", "hf": HF_DIR, "dst": DIR, "bits": 4|8}
        -> mlx_lm.convert --quantize with mlx-lm's default group size for those bits
    {"op": "logits", "model": DIR, "chunks": [[ids...], ...], "out": DIR}
        -> every position's logits of each chunk, from an empty cache, as DIR/chunk_I.npy
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np


def quantize(hf: str, dst: str, bits: int) -> dict:
    """mlx-lm's own quantization of `hf`. transformers 5 writes rope_theta inside
    rope_parameters, which mlx-lm 0.32 does not read (it would rotate at its default base): the
    folder is handed over with the value also at the top level, as transformers 4 wrote it."""
    import tempfile

    from mlx_lm import convert

    with tempfile.TemporaryDirectory() as tmp:
        for f in Path(hf).iterdir():
            if f.name != "config.json":
                (Path(tmp) / f.name).symlink_to(f.resolve())
        config = json.loads((Path(hf) / "config.json").read_text())
        rope = config.get("rope_parameters") or {}
        if "rope_theta" in rope and "rope_theta" not in config:
            config["rope_theta"] = rope["rope_theta"]
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        convert(tmp, mlx_path=dst, quantize=True, q_bits=bits)
    size = sum(p.stat().st_size for p in Path(dst).glob("*.safetensors"))
    return {"dst": dst, "bytes": size}


def logits(model_dir: str, chunks: list[list[int]], out: str) -> dict:
    from mlx_lm import load

    model, _ = load(model_dir)
    files = []
    for i, ids in enumerate(chunks):
        z = model(mx.array([ids])).astype(mx.float32)
        path = Path(out) / f"chunk_{i}.npy"
        np.save(path, np.array(z[0]))
        files.append(str(path))
    return {"files": files}


def main() -> None:
    req = json.load(sys.stdin)
    op = req.pop("op")
    if op == "quantize":
        res = quantize(req["hf"], req["dst"], int(req["bits"]))
    elif op == "logits":
        res = logits(req["model"], req["chunks"], req["out"])
    else:
        raise SystemExit(f"unknown op {op}")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
