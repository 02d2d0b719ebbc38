"""Writes tests/pins/conversions.json and conversions.npz: for each test family, the default
conversion's (float and --quant q4) fused op counts, model.onnx.data's SHA-256, and the logits
of a fixed prompt through onnxruntime (its optimizer off). Run once against a tree whose output
is to be kept; tests/pins/test_conversion_pins.py converts again and compares.

    .venv/bin/python -m tests.pins.make_pins
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np

from tests.pins.pin_support import CASES, convert_case

HERE = Path(__file__).parent


def main() -> None:
    record: dict[str, dict] = {}
    arrays: dict[str, np.ndarray] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for case in CASES:
            for quant in (None, "q4"):
                key = f"{case}-{quant or 'float'}"
                ops, sha, logits = convert_case(Path(tmp), case, quant)
                record[key] = {"ops": ops, "weights_sha256": sha}
                arrays[key] = logits
                print(key, sha[:12], ops, file=sys.stderr)
    (HERE / "conversions.json").write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    np.savez_compressed(HERE / "conversions.npz", **arrays)


if __name__ == "__main__":
    main()
