"""fuselm against llama.cpp on one real model: perplexity of llama.cpp's quantization types and of
fuselm artifacts on the same token windows, bits per parameter, and CPU prefill/decode speed
side by side (separate processes, alternating). Prints one JSON object.

    PYTHONPATH=. .venv/bin/python benchmarks/llamacpp_compare.py \
        --hf-dir SMOL_HF --llama-python /path/venv/bin/python --llama-src LLAMA_CPP_SRC \
        --work WORK [--gguf NAME=FILE ...] [--fuselm NAME=OUT_DIR ...] [--context 1024] \
        [--speed GGUF_NAME=FUSELM_NAME ...] [--rounds 3] [--mlx-python /path/venv/bin/python]
        [--no-ppl] [--types Q8_0,Q4_K_M,...]

- HF_DIR is the float checkpoint every quantization starts from (for the bundled demo model:
  SmolLM2-135M-Instruct's GGUF dequantized into an HF folder by transformers).
- llama.cpp is llama-cpp-python, built from its source release in a venv outside the repository
  (`--llama-python`, with torch, transformers and sentencepiece beside it for the converter);
  LLAMA_CPP_SRC is that release's vendored llama.cpp tree, whose convert_hf_to_gguf.py (run
  by that Python, with the tree's own gguf-py first on the path) makes the F16 GGUF
  that `llama_model_quantize` turns into Q8_0 / Q4_K_M / Q4_K_S / Q4_0 (or the comma-separated
  `--types`, e.g. Q6_K).
- Perplexity follows runtime_metal/perplexity.py's rule (llama-perplexity's) on the bundled
  English prose: the same token ids (fuselm's tokenizer) go to every system; llama.cpp's logits
  come back from benchmarks/llamacpp_worker.py and are scored by the same `chunk_nll`.
- fuselm artifacts are scored by `fuselm perplexity` at its defaults (engine auto: onnxruntime on
  this CPU, accuracy level 4), as a user would run it; bits per parameter = bytes on disk × 8 /
  parameters, for both systems (GGUF file; model.onnx + model.onnx.data).
- With `--mlx-python` (a venv holding mlx-lm), mlx-lm's default 4-bit and 8-bit quantization of
  HF_DIR (`mlx_lm.convert --quantize`, its default group size) are scored the same way, their
  logits from mlx-lm's own model (benchmarks/mlxlm_worker.py); bits = their safetensors bytes.
- Speed: llama.cpp (its default threads) against `fuselm bench` (its defaults), each run in its
  own process, alternating for `--rounds`; prompt 512, 128 new tokens, medians. `--no-ppl`
  measures only the speed (no perplexity rows).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
WORKER = HERE / "llamacpp_worker.py"
MLX_WORKER = HERE / "mlxlm_worker.py"
QUANT_TYPES = ("Q8_0", "Q4_K_M", "Q4_K_S", "Q4_0")


def worker(python: str, request: dict[str, Any], script: Path = WORKER) -> dict[str, Any]:
    out = subprocess.run([python, str(script)], input=json.dumps(request), text=True,
                         capture_output=True, check=False)
    if out.returncode:
        raise SystemExit(f"{script.name} failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def fuselm_cli(*args: str) -> dict[str, Any]:
    exe = Path(sys.executable).parent / "fuselm"
    out = subprocess.run([str(exe), *args, "--json"], capture_output=True, text=True,
                         check=False)
    if out.returncode:
        raise SystemExit(f"fuselm {' '.join(args)} failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def ppl_from_nll(nll: np.ndarray) -> dict[str, float]:
    mean = float(nll.mean())
    se = float(nll.std(ddof=1) / math.sqrt(len(nll)))
    return {"ppl": math.exp(mean), "ppl_stderr": math.exp(mean) * se, "scored": int(len(nll))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf-dir", required=True)
    ap.add_argument("--llama-python", required=True)
    ap.add_argument("--llama-src", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--gguf", action="append", default=[], help="NAME=FILE: an extra GGUF")
    ap.add_argument("--fuselm", action="append", default=[], help="NAME=OUT_DIR: an artifact")
    ap.add_argument("--speed", action="append", default=[], help="GGUF_NAME=FUSELM_NAME")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--mlx-python", default=None, help="a Python with mlx-lm: its 4/8-bit rows")
    ap.add_argument("--no-ppl", action="store_true", help="speed only")
    ap.add_argument("--types", default=",".join(QUANT_TYPES),
                    help="llama.cpp quantization types, comma-separated (worker's FTYPES)")
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fuselm.runtime_metal.perplexity import SAMPLE_TEXT, chunk_nll, chunks, read_text

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(args.hf_dir)
    ids = [int(i) for i in tok.encode(read_text(SAMPLE_TEXT), add_special_tokens=False)]
    parts = chunks(ids, args.context)
    model = AutoModelForCausalLM.from_pretrained(args.hf_dir, torch_dtype=torch.float32).eval()
    params = sum(p.numel() for p in model.parameters())  # a tied table counts once
    rows: list[dict[str, Any]] = []
    if not args.no_ppl:
        with torch.no_grad():
            nll = np.concatenate([chunk_nll(model(torch.tensor([c])).logits[0].numpy(), c)
                                  for c in parts])
        rows.append({"system": "HF transformers float32", **ppl_from_nll(nll),
                     "bits_per_param": 32})
    del model

    # llama.cpp's files: F16 from the HF folder, then its quantization types.
    ggufs: dict[str, Path] = {}
    f16 = work / "f16.gguf"
    if not f16.exists():
        env = {**os.environ, "PYTHONPATH": str(Path(args.llama_src) / "gguf-py")}
        subprocess.run([args.llama_python, str(Path(args.llama_src) / "convert_hf_to_gguf.py"),
                        args.hf_dir, "--outtype", "f16", "--outfile", str(f16)], env=env,
                       check=True, capture_output=True)
    ggufs["llama.cpp F16"] = f16
    for kind in args.types.split(","):
        dst = work / f"{kind.lower()}.gguf"
        if not dst.exists():
            worker(args.llama_python, {"op": "quantize", "src": str(f16), "dst": str(dst),
                                       "type": kind})
        ggufs[f"llama.cpp {kind}"] = dst
    for spec in args.gguf:
        name, path = spec.split("=", 1)
        ggufs[name] = Path(path)
    for name, path in {} if args.no_ppl else ggufs.items():
        with tempfile.TemporaryDirectory(dir=work) as tmp:
            got = worker(args.llama_python, {"op": "logits", "gguf": str(path), "chunks": parts,
                                             "out": tmp})
            nll = np.concatenate([chunk_nll(np.load(f), c) for f, c in zip(got["files"], parts,
                                                                               strict=True)])
        rows.append({"system": name, **ppl_from_nll(nll),
                     "bits_per_param": path.stat().st_size * 8 / params, "file": str(path)})

    for bits in (4, 8) if args.mlx_python and not args.no_ppl else ():
        dst = work / f"mlxlm_{bits}bit"
        if not dst.exists():
            worker(args.mlx_python, {"op": "quantize", "hf": args.hf_dir, "dst": str(dst),
                                     "bits": bits}, MLX_WORKER)
        with tempfile.TemporaryDirectory(dir=work) as tmp:
            got = worker(args.mlx_python, {"op": "logits", "model": str(dst), "chunks": parts,
                                           "out": tmp}, MLX_WORKER)
            nll = np.concatenate([chunk_nll(np.load(f), c) for f, c in zip(got["files"], parts,
                                                                               strict=True)])
        size = sum(p.stat().st_size for p in dst.glob("*.safetensors"))
        rows.append({"system": f"mlx-lm {bits}-bit (mlx_lm.convert -q --q-bits {bits})",
                     **ppl_from_nll(nll), "bits_per_param": size * 8 / params,
                     "model": str(dst)})

    artifacts = dict(spec.split("=", 1) for spec in args.fuselm)
    text = work / "text.txt"
    text.write_text(read_text(SAMPLE_TEXT), encoding="utf-8")
    for name, out_dir in {} if args.no_ppl else artifacts.items():
        res = fuselm_cli("perplexity", out_dir, "--context", str(args.context), "--text",
                         str(text))
        size = sum(p.stat().st_size for p in Path(out_dir).glob("model.onnx*"))
        rows.append({"system": name, "ppl": res["ppl"], "ppl_stderr": res["ppl_stderr"],
                     "scored": res["scored_tokens"], "engine": res["engine"],
                     "bits_per_param": size * 8 / params, "artifact": out_dir})
    for r in rows:
        r["increase"] = r["ppl"] / rows[0]["ppl"] - 1

    speed: list[dict[str, Any]] = []
    prompt = (ids * 2)[:512]
    for spec in args.speed:
        gname, fname = spec.split("=", 1)
        runs: dict[str, list[dict[str, float]]] = {"llama.cpp": [], "fuselm": []}
        for _ in range(args.rounds):
            runs["llama.cpp"].append(worker(args.llama_python, {
                "op": "speed", "gguf": str(ggufs[gname]), "prompt": prompt, "new_tokens": 128,
                "repetitions": 3}))
            runs["fuselm"].append(fuselm_cli("bench", artifacts[fname], "-p", "512", "-n", "128",
                                             "-r", "3"))
        lpp = statistics.median(r["pp_tok_s"] for r in runs["llama.cpp"])
        ltg = statistics.median(r["tg_tok_s"] for r in runs["llama.cpp"])
        fpp = statistics.median(_bench(r, "pp") for r in runs["fuselm"])
        ftg = statistics.median(_bench(r, "tg") for r in runs["fuselm"])
        speed.append({"llama.cpp": gname, "fuselm": fname, "llama_pp512": lpp, "llama_tg128": ltg,
                      "fuselm_pp512": fpp, "fuselm_tg128": ftg, "pp_ratio": fpp / lpp,
                      "tg_ratio": ftg / ltg, "runs": runs})
    print(json.dumps({"context": args.context, "parameters": params, "rows": rows,
                      "speed": speed}, indent=1))


def _bench(res: dict[str, Any], kind: str) -> float:
    """Median tok/s of one `fuselm bench --json` result: "pp" or "tg"."""
    return float(res[kind])


if __name__ == "__main__":
    main()
