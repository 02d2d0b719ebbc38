"""Which 4-bit KV cache layouts cost SmolLM2 the least perplexity? Fast fake-quant screening.

    PYTHONPATH=. .venv/bin/python benchmarks/probes/kv_quant_variants.py HF_DIR \
        [--exp NAME ...] [--context 1024] [--scales float32|float16]

HF_DIR: the GGUF's own dequantized weights as an HF float32 folder
(`benchmarks/gguf_float_folder.py`), so the KV cache is the only error. Every layer's keys
and values (after RoPE, before attention) are quantized and dequantized back by the variant
inside the transformers float32 model (an attention function registered with transformers),
and the PPL is taken by runtime_metal/perplexity.py's rule on the bundled English prose.
Quantization is MLX's own (`mx.quantize`, the affine scheme `--kv-bits` stores, scales and
biases in `--scales`), the rotation kv_cache.rotate's. It is a screening tool: the same
"base" variant measured through `fuselm perplexity --kv-bits 4` differs from it by about half a
point (the rounding of two float32 implementations flips codes), so only differences larger
than that mean anything; final figures come from `fuselm perplexity`.

Variants (`--exp`, default all):
  float        no quantization (must equal `fuselm perplexity` without --kv-bits)
  base         K and V per token, groups of 64, rotated (what `--kv-bits 4` stores)
  k8 / v8      keys / values 8-bit, the other 4-bit: where the loss comes from
  kg32         keys in groups of 32
  center       keys minus the mean of the row's keys (softmax is shift-invariant), rotated
  center_k32   center, keys in groups of 32
  center_cal   keys minus a fixed per-layer mean taken on passes/calibration.txt
  center_raw   center, unrotated keys
  kivi         keys per channel in groups of 64 positions (KIVI), unrotated; values as base
  kivi_rot     kivi over rotated keys
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import torch

from fuselm.runtime_metal.kv_cache import rotate, unrotate
from fuselm.runtime_metal.perplexity import SAMPLE_TEXT, perplexity_of, read_text, text_tokens

CALIB = Path(__file__).resolve().parents[2] / "passes" / "calibration.txt"

# name -> (key scheme, value scheme): bits, group, rotated, centering, per channel (KIVI)
VARIANTS: dict[str, dict[str, Any] | None] = {
    "float": None,
    "base": {},
    "k8": {"kbits": 8},
    "v8": {"vbits": 8},
    "kg32": {"kgroup": 32},
    "center": {"center": "row"},
    "center_k32": {"center": "row", "kgroup": 32},
    "center_cal": {"center": "calibration"},
    "center_raw": {"center": "row", "krot": False},
    "kivi": {"channel": True, "krot": False},
    "kivi_rot": {"channel": True},
}


class Probe:
    def __init__(self, hf_dir: str, scales: str) -> None:
        from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        self.dtype = {"float32": mx.float32, "float16": mx.float16}[scales]
        self.variant: dict[str, Any] | None = None
        self.calibrating = False
        self.means: dict[int, mx.array] = {}  # layer -> key mean on the calibration text

        def attention(module: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      *args: Any, **kwargs: Any) -> Any:
            layer = int(module.layer_idx)
            if self.calibrating:
                self.means[layer] = mx.mean(_mx(k), axis=2, keepdims=True)
            elif self.variant is not None:
                k, v = self.keys(_mx(k), layer), self.values(_mx(v))
                k, v = _torch(k), _torch(v)
            return sdpa_attention_forward(module, q, k, v, *args, **kwargs)

        AttentionInterface.register("kvq", attention)
        self.model = AutoModelForCausalLM.from_pretrained(
            hf_dir, dtype=torch.float32, attn_implementation="kvq").eval()
        self.tok = AutoTokenizer.from_pretrained(hf_dir)

    def fake(self, x: mx.array, bits: int, group: int) -> mx.array:
        q = mx.quantize(x.astype(self.dtype), group_size=group, bits=bits)
        return mx.dequantize(*q, group_size=group, bits=bits).astype(mx.float32)

    def keys(self, k: mx.array, layer: int) -> mx.array:
        var = self.variant or {}
        mu: mx.array | float = 0.0
        if var.get("center") == "row":
            mu = mx.mean(k, axis=2, keepdims=True)
        elif var.get("center") == "calibration":
            mu = self.means[layer]
        x = k - mu
        rot = var.get("krot", True)
        x = rotate(x) if rot else x
        bits, group = var.get("kbits", 4), var.get("kgroup", 64)
        if var.get("channel"):  # groups along positions; a last partial group stays float
            full = x.shape[2] // group * group
            x = mx.concatenate([self.fake(x[:, :, :full].swapaxes(2, 3), bits, group)
                                .swapaxes(2, 3), x[:, :, full:]], axis=2)
        else:
            x = self.fake(x, bits, group)
        return (unrotate(x) if rot else x) + mu

    def values(self, v: mx.array) -> mx.array:
        var = self.variant or {}
        return unrotate(self.fake(rotate(v), var.get("vbits", 4), var.get("vgroup", 64)))

    @torch.no_grad()
    def logits(self, ids: list[int]) -> np.ndarray:
        return self.model(torch.tensor([ids])).logits[0].numpy()

    def calibrate(self) -> None:
        self.calibrating = True
        ids = text_tokens(self.tok, CALIB.read_text(encoding="utf-8"))[:1024]
        self.logits(ids)
        self.calibrating = False


def _mx(t: torch.Tensor) -> mx.array:
    return mx.array(t.contiguous().numpy())


def _torch(a: mx.array) -> torch.Tensor:
    return torch.from_numpy(np.array(a))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("hf_dir")
    ap.add_argument("--exp", nargs="*", choices=list(VARIANTS), default=list(VARIANTS))
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--scales", choices=["float32", "float16"], default="float32")
    args = ap.parse_args()
    probe = Probe(args.hf_dir, args.scales)
    tokens = text_tokens(probe.tok, read_text(SAMPLE_TEXT))
    if "center_cal" in args.exp:
        probe.calibrate()
    base = None
    for name in ["float", *(e for e in args.exp if e != "float")]:  # float first: the base
        probe.variant = VARIANTS[name]
        t0 = time.perf_counter()
        r = perplexity_of(probe.logits, tokens, args.context)
        base = r.ppl if name == "float" else base
        print(json.dumps({"variant": name, "scales": args.scales, "ppl": round(r.ppl, 4),
                          "vs_float": round(r.ppl / base - 1, 5) if base else None,
                          "seconds": round(time.perf_counter() - t0, 1)}), flush=True)


if __name__ == "__main__":
    main()
