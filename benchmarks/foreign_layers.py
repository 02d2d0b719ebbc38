"""Nodes per decoder layer after the passes, foreign exports vs ours, for every family.

    .venv/bin/python benchmarks/foreign_layers.py [--opset 23] [--family gemma2 ...] [--json OUT]

Each family's tiny test model (converter.builtin TINY shapes: GQA 4:2, head_dim 24 != 64 / 4;
the families added after the move with their tests/families.py config) is exported twice:
by our exporter, and by `torch.onnx.export(hf_model, dynamo=True)` of the transformers model
itself (tests/passes/passes_foreign.py, with KV-cache I/O). Both go through the full pass
pipeline. Per layer: the nodes on the layer's residual path (passes.layers.residual_layer_sizes:
masks, positions and cache trimming are not layer nodes). Also per family: the fused ops, the
refusals, the foreign graph's numerics (after vs before the passes, onnxruntime) and its
prefill logits vs HF float32 (12 tokens: past Gemma's window and Phi-3's LongRoPE switch).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.families: the per-family test configs
sys.path.insert(0, str(ROOT / "tests" / "passes"))  # passes_foreign, passes_support

FUSED = ("FusedQKV", "FusedRoPE", "Attention", "FusedGateUp")


def measure(family: str, work: Path, opset: int) -> dict[str, object]:
    import numpy as np
    import onnx
    from passes_foreign import export_foreign
    from passes_support import decoder_feeds, hf_logits_and_greedy, max_rel, run

    from fuselm.converter.models.builtin import build_model
    from fuselm.export.onnx_export import export_model
    from fuselm.passes.layers import residual_layer_sizes
    from fuselm.passes.manager import run_pipeline
    from fuselm.runtime_metal.validate import rel
    from tests.families import TEST_CONFIGS

    hf = build_model(work / family / "hf", family, tokenizer=False,
                     **TEST_CONFIGS.get(family, {}))
    export_model(hf, work / family / "ours.onnx")
    ours, _ = run_pipeline(onnx.load(str(work / family / "ours.onnx")))
    raw_path = export_foreign(hf, work / family / "foreign.onnx", dynamo=True, opset=opset,
                              with_cache=True)
    raw = onnx.load(str(raw_path))
    out, report = run_pipeline(raw)
    feeds = decoder_feeds(raw)
    prompt = np.array([[(37 * i + 5) % 384 for i in range(12)]], np.int64)
    ref, _ = hf_logits_and_greedy(hf, prompt, 0)
    got = run(out, {"input_ids": prompt, "attention_mask": np.ones_like(prompt),
                    "position_ids": np.arange(12, dtype=np.int64)[None],
                    **{k: v[:1, :, :0] for k, v in feeds.items() if k.startswith("past")}})
    counts = Counter(n.op_type for n in out.graph.node)
    return {
        "family": family,
        "ours_per_layer": residual_layer_sizes(list(ours.graph.node)),
        "foreign_per_layer": residual_layer_sizes(list(out.graph.node)),
        "foreign_nodes": {"raw": len(raw.graph.node), "fused": len(out.graph.node)},
        "fused_ops": {op: counts[op] for op in FUSED},
        "refused": [r for e in report.entries for r in e.refused],
        "rel_after_vs_before": max_rel(run(out, feeds), run(raw, feeds)),
        "rel_vs_hf": rel(got[0], ref),
    }


def main() -> None:
    from fuselm.converter.models.builtin import FAMILIES

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--opset", type=int, default=23)
    ap.add_argument("--family", nargs="*", default=list(FAMILIES))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.family:
            row = measure(family, Path(tmp), args.opset)
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.json:
        args.json.write_text(json.dumps({"opset": args.opset, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
