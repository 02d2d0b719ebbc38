"""A default conversion of every test family (float and --quant q4) gives what the pinned tree
gave: the same op counts, a byte-identical model.onnx.data and logits within 1e-6 (rel). The
pins were written by tests/pins/make_pins.py; restructuring the exporters or passes must not
move them. A deliberate change of output re-runs make_pins and says why in its commit.

The same conversions show where the fusing happens: the exporter writes the plain decoder
graph and the pass report (fuselm.json) records QKV and Gate/Up pairing on every layer."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.pins.pin_support import CASES, convert_case

HERE = Path(__file__).parent
PINS = json.loads((HERE / "conversions.json").read_text())
LOGITS = np.load(HERE / "conversions.npz")


@pytest.mark.parametrize("quant", [None, "q4"], ids=["float", "q4"])
@pytest.mark.parametrize("case", list(CASES))
def test_conversion_matches_pin(tmp_path_factory: pytest.TempPathFactory, case: str,
                                quant: str | None) -> None:
    key = f"{case}-{quant or 'float'}"
    tmp = tmp_path_factory.mktemp(key)
    ops, sha, logits = convert_case(tmp, case, quant)
    assert ops == PINS[key]["ops"]
    assert sha == PINS[key]["weights_sha256"]
    want = LOGITS[key]
    rel = float(np.abs(logits - want).max() / np.abs(want).max())
    assert rel <= 1e-6, rel
    manifest = json.loads((tmp / f"out-{key}" / "fuselm.json").read_text())
    layers = manifest["model"]["num_layers"]
    matches = {e["name"]: e["matches"] for e in manifest["passes"]["passes"]}
    assert matches["qkv"] == matches["gate_up"] == layers, matches
    # both exporters write each layer's q/k/v projections adjacent already (torch traces them
    # so): reorder_qkv runs and reports the peak of live tensors, with nothing to move
    assert "reorder_qkv" in matches
