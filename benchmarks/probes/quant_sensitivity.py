"""Which tensors would pay for 8 bits? Per-tensor sensitivity of the default 4-bit quantization,
measured on the calibration text, and a mixed 4/8-bit choice under a bits-per-parameter target.

    PYTHONPATH=. .venv/bin/python benchmarks/probes/quant_sensitivity.py HF_DIR \
        [--target 6.27] [--groups head,down,o,qkv,gate_up] [--layers 0,1,29] [--eval]

Starting point: every weight as `fuselm convert --quant q4` rounds it by default (block 32; the
importance-weighted search, GPTQ error feedback on the LM head; fuselm's own quantize_array /
quantize_gptq), dequantized into the transformers float32 model. Each group (a layer's fused
QKV, its o_proj, its fused gate/up, its down_proj, or the LM head with its tied table) is then
put at 8 bits alone (simulated: asymmetric min/max blocks of 32, 255 steps, float16 scales —
what `--q-bits 8` stores) and the KL divergence of the next-token distribution from the float
model's is taken on passes/calibration.txt (never the evaluation text). A group's sensitivity
is the KL it removes per extra bit it costs; the choice takes the best until the target's bits
are spent. Bits are counted as a float32 graph stores them (float32 scales: 4-bit 5.125 bits
per weight, 8-bit 9.25), over all parameters. `--eval` then takes the chosen mix's PPL by
`fuselm perplexity`'s rule on the bundled prose (--context 1024). A screening tool: final figures
come from real conversions measured with `fuselm perplexity`. Prints JSON lines.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.probes.quant_ablation import Harness
from fuselm.passes.quant.q4_math import quantize_array, quantize_gptq

BITS4 = 4 + (32 + 4) / 32  # codes + float32 scale + uint4 zero point per block of 32
BITS8 = 8 + (32 + 8) / 32


def q8(w: np.ndarray) -> np.ndarray:
    """[K, N] -> dequantized 8-bit asymmetric min/max blocks of 32 along K (float16 scales)."""
    k, n = w.shape
    b = w.reshape(k // 32, 32, n)
    lo, hi = np.minimum(b.min(1), 0), np.maximum(b.max(1), 0)
    s = ((hi - lo) / 255).astype(np.float16).astype(np.float32)
    safe = np.where(s == 0, 1, s)
    zp = np.clip(np.rint(-lo / safe), 0, 255)
    q = np.clip(np.rint(b / safe[:, None]) + zp[:, None], 0, 255)
    return ((q - zp[:, None]) * s[:, None]).reshape(k, n)


def group_members(names: list[str], n_layers: int) -> dict[str, list[str]]:
    """Group name ('head', 'L3.down', ...) -> its Linear names (fused projections together)."""
    kinds = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
             "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}
    out = {"head": ["lm_head"]}
    for layer in range(n_layers):
        for kind, parts in kinds.items():
            out[f"L{layer}.{kind}"] = [n for n in names if n.startswith(f"model.layers.{layer}.")
                                       and n.rsplit(".", 1)[-1] in parts]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("hf_dir", type=Path)
    ap.add_argument("--target", type=float, default=6.27, help="bits per parameter")
    ap.add_argument("--groups", default="head,qkv,o,gate_up,down")
    ap.add_argument("--layers", default=None, help="comma-separated layers (default: all)")
    ap.add_argument("--eval", action="store_true")
    args = ap.parse_args()
    h = Harness(args.hf_dir, context=512)
    h.collect_importance()
    names = list(h.linears)
    params = sum(p.numel() for p in h.model.parameters())
    n_layers = h.model.config.num_hidden_layers
    kinds = set(args.groups.split(","))
    layers = None if args.layers is None else {int(x) for x in args.layers.split(",")}
    groups = {g: m for g, m in group_members(names, n_layers).items()
              if g.split(".")[-1] in kinds and (g == "head" or layers is None
                                                or int(g[1:].split(".")[0]) in layers)}
    four: dict[str, torch.Tensor] = {}
    eight: dict[str, torch.Tensor] = {}
    for n in names:
        w = h.orig[n].numpy().T.astype(np.float32)  # [K, N], as fuselm quantizes it
        q = (quantize_gptq(w, h.grams[n], 32) if n == "lm_head"
             else quantize_array(w, 32, importance=h.importance[n]))
        four[n] = torch.from_numpy(np.ascontiguousarray(q.dequantize().T))
        if any(n in m for m in groups.values()):
            eight[n] = torch.from_numpy(np.ascontiguousarray(q8(w).T))
    toks = h.calib_tokens
    chunks = [toks[i:i + 512] for i in range(0, len(toks), 512) if len(toks[i:i + 512]) >= 64]

    def set_weights(at8: set[str]) -> None:
        with torch.no_grad():
            for n, m in h.linears.items():
                m.weight.copy_(eight[n] if n in at8 else four[n])

    def logp() -> list[torch.Tensor]:
        with torch.no_grad():
            return [torch.log_softmax(h.model(torch.tensor([c])).logits[0].double(), -1)
                    for c in chunks]

    with torch.no_grad():
        for n, m in h.linears.items():
            m.weight.copy_(h.orig[n])
    ref = logp()

    def kl() -> float:
        got = logp()
        total = sum(float((r.exp() * (r - g)).sum()) for r, g in zip(ref, got, strict=True))
        return total / sum(len(c) for c in chunks)

    t0 = time.perf_counter()
    set_weights(set())
    base = kl()
    print(json.dumps({"all 4-bit": {"kl": base}}), flush=True)
    rows = []
    for g, members in groups.items():
        set_weights(set(members))
        k = kl()
        size = sum(h.orig[m].numel() for m in members)
        rows.append({"group": g, "kl": k, "gain": base - k, "weights": size,
                     "gain_per_mbit": (base - k) / (size * (BITS8 - BITS4)) * 1e6})
        print(json.dumps({**rows[-1], "t": round(time.perf_counter() - t0, 1)}), flush=True)
    rows.sort(key=lambda r: -r["gain_per_mbit"])
    spare = args.target * params - BITS4 * sum(h.orig[n].numel() for n in names)
    chosen = []
    for r in rows:
        cost = r["weights"] * (BITS8 - BITS4)
        if r["gain"] > 0 and cost <= spare:
            chosen.append(r["group"])
            spare -= cost
    at8 = {m for g in chosen for m in groups[g]}
    bits = (BITS4 * sum(h.orig[n].numel() for n in names if n not in at8)
            + BITS8 * sum(h.orig[n].numel() for n in at8)) / params
    result = {"chosen": chosen, "weight_bits_per_param": round(bits, 4)}
    if args.eval:
        h.context = 1024
        set_weights(set())
        result["ppl_all_4bit"] = h.ppl()
        set_weights(at8)
        result["ppl_mixed"] = h.ppl()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
