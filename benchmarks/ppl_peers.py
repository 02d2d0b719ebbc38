"""Perplexity of SmolLM2-135M-Instruct (the bundled GGUF) across systems, one chunking rule.

Every system scores the SAME token ids (the text tokenized once by the model's tokenizer)
with runtime_metal/perplexity.py's rule (llama-perplexity's: chunks of --context tokens from an
empty cache, second half scored):

- HF float32: transformers' GGUF load (`from_pretrained(dir, gguf_file=...)`);
- fuselm float16, Q4 block 32 and 64: `fuselm convert MODEL.gguf` (timed, peak RSS by
  /usr/bin/time -v), run through onnxruntime at accuracy_level 0 (float compute: the weights'
  error only);
- mlx-lm 4-bit, group 32 and 64: `mlx_lm.convert -q` of the HF directory transformers saves
  from the GGUF (float32 safetensors), run with mlx-lm's own model.

Bits per weight: whole-model (weight bytes × 8 / parameters, embeddings and norms included)
and for the 4-bit formats the linear weights' own figure (codes + scales + zero points/biases).

  .venv/bin/python benchmarks/ppl_peers.py --work /tmp/ppl --context 512 > ppl.json
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
FUSELM = [sys.executable, "-m", "fuselm.converter.cli.main"]


def timed(cmd: list[str]) -> dict[str, float]:
    """Run `cmd` under /usr/bin/time -v: wall seconds and peak RSS (MB)."""
    r = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"{cmd} failed:\n{r.stderr[-3000:]}")
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", r.stderr).group(1))
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", r.stderr)
    parts = [float(p) for p in wall.group(1).split(":")]
    seconds = sum(p * 60 ** i for i, p in enumerate(reversed(parts)))
    return {"wall_s": round(seconds, 2), "peak_rss_mb": round(rss / 1024, 1)}


def dir_bytes(path: Path, pattern: str) -> int:
    return sum(p.stat().st_size for p in path.glob(pattern))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, default=Path("/tmp/ppl_peers"))
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--text", type=Path, default=None)
    ap.add_argument("--skip-mlx-lm", action="store_true")
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fuselm.converter.models.smollm2 import bundled_gguf
    from fuselm.runtime_metal.engine import make_engine
    from fuselm.runtime_metal.perplexity import (
        SAMPLE_TEXT,
        engine_logits_fn,
        perplexity_of,
        text_tokens,
    )
    from fuselm.runtime_metal.validate import hf_logits

    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    gguf = bundled_gguf()
    text = (args.text or SAMPLE_TEXT).read_text(encoding="utf-8")
    results: dict[str, Any] = {"gguf": gguf.name, "context": args.context,
                               "text": str(args.text or SAMPLE_TEXT)}

    # HF float32 from the GGUF, saved as an HF dir for mlx-lm
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                 dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tokens = text_tokens(tok, text)
    params = sum(p.numel() for p in model.parameters())
    results["tokens"] = len(tokens)
    results["parameters"] = params
    ppl = perplexity_of(lambda ids: hf_logits(model, ids), tokens, args.context, "hf")
    results["hf_float32"] = {**ppl.to_dict(), "bits_per_weight": 32.0}
    results["gguf_q4_1_file"] = {"bits_per_weight": round(gguf.stat().st_size * 8 / params, 3)}
    hf_dir = work / "hf"
    if not hf_dir.is_dir():
        # transformers refuses save_pretrained on a GGUF-loaded model; its weights are plain
        # float32 tensors, so write the HF directory directly
        from safetensors.torch import save_file

        hf_dir.mkdir(parents=True)
        tied = bool(model.config.tie_word_embeddings)
        state = {k: v.contiguous() for k, v in model.state_dict().items()
                 if not (tied and k == "lm_head.weight")}
        save_file(state, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
        cfg = model.config.to_dict()
        cfg.pop("quantization_config", None)  # the GGUF marker; the saved weights are float
        cfg["torch_dtype"] = "float32"
        (hf_dir / "config.json").write_text(json.dumps(cfg, indent=2))
        tok.save_pretrained(str(hf_dir))

    # imports alone: the floor under any conversion's peak RSS
    results["import_baseline"] = timed(
        [sys.executable, "-c", "import fuselm.converter.cli.main, fuselm.converter.pipeline, "
        "torch, "
         "onnx, onnxscript, transformers, gguf"])

    runs = {"fuselm_float16": [], "fuselm_q4_b32": ["--quant", "q4", "--block-size", "32"],
            "fuselm_q4_b64": ["--quant", "q4", "--block-size", "64"]}
    for name, extra in runs.items():
        out = work / name
        shutil.rmtree(out, ignore_errors=True)
        conv = timed([*FUSELM, "convert", str(gguf), "-o", str(out), "--quiet", *extra])
        eng = make_engine(out, "onnxruntime", accuracy_level=0)
        ppl = perplexity_of(engine_logits_fn(eng), tokens, args.context, "onnxruntime")
        manifest = json.loads((out / "fuselm.json").read_text())
        q = manifest.get("quantization") or {}
        results[name] = {**ppl.to_dict(), "convert": conv,
                         "bits_per_weight": round(dir_bytes(out, "model.onnx.data") * 8 / params,
                                                  3),
                         "linear_bits_per_weight": q.get("bits_per_weight")}
        print(name, results[name]["ppl"], conv, file=sys.stderr)

    if not args.skip_mlx_lm:
        import mlx.core as mx
        from mlx_lm import load

        for group in (32, 64):
            out = work / f"mlx_q4_g{group}"
            if not out.is_dir():
                subprocess.run([sys.executable, "-m", "mlx_lm", "convert", "--hf-path",
                                str(hf_dir), "--mlx-path", str(out), "-q", "--q-bits", "4",
                                "--q-group-size", str(group)], check=True,
                               capture_output=True)
            mlx_model, _ = load(str(out))

            def fn(ids: list[int], m: Any = mlx_model) -> np.ndarray:
                logits = m(mx.array(ids)[None])[0].astype(mx.float32)
                return np.array(logits)

            t0 = time.perf_counter()
            ppl = perplexity_of(fn, tokens, args.context, "mlx-lm")
            results[f"mlx_lm_q4_g{group}"] = {
                **ppl.to_dict(),
                "bits_per_weight": round(dir_bytes(out, "*.safetensors") * 8 / params, 3),
                "linear_bits_per_weight": 4 + 32 / group,  # float16 scale + float16 bias
                "seconds_total": round(time.perf_counter() - t0, 2)}
            print(f"mlx {group}", results[f"mlx_lm_q4_g{group}"]["ppl"], file=sys.stderr)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
