"""Where does Q4's loss come from? Fast fake-quant ablation on a real HF checkpoint.

    PYTHONPATH=. .venv/bin/python benchmarks/probes/quant_ablation.py HF_DIR [--exp NAME ...]

Each weight is quantized with fuselm's own quantizer (passes/q4_math.quantize_array: the same
codes, scales and zero points `fuselm convert --quant q4` stores), dequantized back into the
transformers model, and the PPL is taken by runtime_metal/perplexity.py's rule on the bundled
English prose (the evaluation text). It is a screening tool: the torch float32 forward stands in
for onnxruntime at float compute (same weights, same rule); the final figures come from real
conversions (benchmarks/quant_quality.py). Calibration activations come from
passes/calibration.txt (a different, original text), never from the evaluation text.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fuselm.passes.quant.q4_math import quantize_array
from fuselm.runtime_metal.perplexity import SAMPLE_TEXT, perplexity_of, read_text, text_tokens

CALIB = Path(__file__).resolve().parents[2] / "passes" / "calibration.txt"


class Harness:
    def __init__(self, hf_dir: Path, context: int = 512) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.manual_seed(0)
        self.model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        self.tok = AutoTokenizer.from_pretrained(hf_dir)
        self.context = context
        self.eval_tokens = text_tokens(self.tok, read_text(SAMPLE_TEXT))
        self.calib_tokens = text_tokens(self.tok, read_text(CALIB))
        # name -> Linear module (the tied head shares the embedding's weight)
        self.linears = {
            n: m for n, m in self.model.named_modules() if isinstance(m, torch.nn.Linear)
        }
        self.orig = {n: m.weight.detach().clone() for n, m in self.linears.items()}
        self.cache: dict[tuple, torch.Tensor] = {}
        self.importance: dict[str, np.ndarray] = {}

    def logits(self, ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            return self.model(torch.tensor([ids])).logits[0].numpy()

    def ppl(self) -> float:
        return perplexity_of(self.logits, self.eval_tokens, self.context).ppl

    def collect_importance(self) -> None:
        """Mean squared input activation per input channel of every Linear (calibration text)."""
        sums: dict[str, torch.Tensor] = {}
        grams: dict[str, torch.Tensor] = {}
        counts: dict[str, int] = {}
        hooks = []
        for n, m in self.linears.items():

            def hook(_m: Any, args: tuple, n: str = n) -> None:
                x = args[0].reshape(-1, args[0].shape[-1]).double()
                sums[n] = sums.get(n, 0) + (x * x).sum(0)
                grams[n] = grams.get(n, 0) + x.T @ x
                counts[n] = counts.get(n, 0) + x.shape[0]

            hooks.append(m.register_forward_pre_hook(hook))
        toks = self.calib_tokens
        with torch.no_grad():
            for i in range(0, len(toks), self.context):
                ids = toks[i:i + self.context]
                if len(ids) >= 16:
                    self.model(torch.tensor([ids]))
        for h in hooks:
            h.remove()
        self.importance = {n: (sums[n] / counts[n]).float().numpy() for n in sums}
        self.grams = {n: (grams[n] / counts[n]).numpy() for n in grams}

    def norm_proxy(self, name: str) -> np.ndarray | None:
        """Data-free importance: the squared RMSNorm weight feeding this Linear, if any."""
        if name == "lm_head":
            return (self.model.model.norm.weight.detach().float().numpy() ** 2)
        parts = name.split(".")
        if not name.startswith("model.layers."):
            return None
        layer = self.model.model.layers[int(parts[2])]
        if parts[-1] in ("q_proj", "k_proj", "v_proj"):
            return layer.input_layernorm.weight.detach().float().numpy() ** 2
        if parts[-1] in ("gate_proj", "up_proj"):
            return layer.post_attention_layernorm.weight.detach().float().numpy() ** 2
        return None

    def quantized(self, name: str, block: int, imp: bool | str,
                  method: str = "search") -> torch.Tensor:
        key = (name, block, imp, method)
        disk = Path("/tmp/qa_cache") / f"{name}-{block}-{imp}-{method}.npy"
        if key not in self.cache and disk.is_file():
            self.cache[key] = torch.from_numpy(np.load(disk))
        if key not in self.cache:
            self.cache[key] = self._quantize(name, block, imp, method)
            disk.parent.mkdir(exist_ok=True)
            np.save(disk, self.cache[key].numpy())
        return self.cache[key]

    def _quantize(self, name: str, block: int, imp: bool | str, method: str) -> torch.Tensor:
        if True:
            w = self.orig[name].numpy()  # [out, in]; fuselm quantizes W.T [K=in, N=out]
            if method == "gptq":
                from fuselm.passes.ops import dequantize_reference
                from fuselm.passes.quant.q4_gptq import gptq_params

                c, s, z = gptq_params(w.T, self.grams[name], block)
                deq = dequantize_reference(c, s.astype(np.float32), z.astype(np.uint8), block)
                return torch.from_numpy(np.ascontiguousarray(deq.T))
            importance = (self.norm_proxy(name) if imp == "proxy"
                          else self.importance[name] if imp else None)
            q = quantize_array(w.T, block, method=method, importance=importance)
            return torch.from_numpy(q.dequantize().T.copy())

    def apply(self, plan: dict[str, tuple[int, bool] | None]) -> None:
        for n, m in self.linears.items():
            p = plan.get(n)
            w = self.orig[n] if p is None else self.quantized(n, *p)
            with torch.no_grad():
                m.weight.copy_(w)


def groups(names: list[str], n_layers: int) -> dict[str, list[str]]:
    def layer(n: str) -> int:
        return int(n.split(".")[2]) if n.startswith("model.layers.") else -1

    return {
        "head": [n for n in names if n == "lm_head"],
        "attn": [n for n in names if "self_attn" in n],
        "mlp": [n for n in names if ".mlp." in n],
        "qkv": [n for n in names if n.endswith(("q_proj", "k_proj", "v_proj"))],
        "o": [n for n in names if n.endswith("o_proj")],
        "gate_up": [n for n in names if n.endswith(("gate_proj", "up_proj"))],
        "down": [n for n in names if n.endswith("down_proj")],
        "first2": [n for n in names if layer(n) in (0, 1)],
        "last2": [n for n in names if layer(n) in (n_layers - 2, n_layers - 1)],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("hf_dir", type=Path)
    ap.add_argument("--exp", nargs="*", default=["ablation"])
    args = ap.parse_args()
    h = Harness(args.hf_dir)
    names = list(h.linears)
    n_layers = h.model.config.num_hidden_layers
    g = groups(names, n_layers)
    t0 = time.perf_counter()
    h.apply({})
    base = h.ppl()
    out: dict[str, Any] = {"float32": base}
    print(json.dumps(out), flush=True)
    h.collect_importance()

    def run(label: str, plan: dict[str, tuple[int, bool] | None]) -> None:
        h.apply(plan)
        p = h.ppl()
        out[label] = {"ppl": round(p, 3), "pct": round(100 * (p / base - 1), 2),
                      "t": round(time.perf_counter() - t0, 1)}
        print(json.dumps({label: out[label]}), flush=True)

    for exp in args.exp:
        if exp == "ablation":
            run("all b32", {n: (32, False) for n in names})
            for gname, members in g.items():
                run(f"only {gname} b32", {n: (32, False) for n in members})
                run(f"all but {gname} b32",
                    {n: (32, False) for n in names if n not in members})
        elif exp == "proxy":
            for b in (32, 64):
                run(f"all b{b} norm-proxy", {n: (b, "proxy") for n in names})
        elif exp == "b64imat":
            run("all b64 imatrix", {n: (64, True) for n in names})
        elif exp == "abl":
            for gname in ("head", "attn", "mlp"):
                run(f"only {gname} b32", {n: (32, False) for n in g[gname]})
        elif exp.startswith("alloc"):
            from fuselm.passes.quant.q4_allocate import allocate_blocks

            mode = exp.split(":")[1]  # imatrix | proxy | none
            budget = float(exp.split(":")[2])
            items = [(n, lambda n=n: h.orig[n].numpy().T, n) for n in names]
            imp = ({n: h.importance[n] for n in names} if mode == "imatrix" else
                   {n: p for n in names if (p := h.norm_proxy(n)) is not None}
                   if mode == "proxy" else None)
            blocks = allocate_blocks(items, 32, budget, importance=imp)
            flag = True if mode == "imatrix" else ("proxy" if mode == "proxy" else False)
            n32 = sum(h.orig[n].numel() for n in names if blocks[n] == 32)
            tot = sum(h.orig[n].numel() for n in names)
            print(json.dumps({"alloc": exp, "frac32": round(n32 / tot, 3),
                              "head": blocks["lm_head"],
                              "b32": sorted({n.split(".")[-1] for n in names
                                             if blocks[n] == 32})}), flush=True)
            run(f"{exp}", {n: (blocks[n], flag) for n in names})
        elif exp == "gptq":
            for b in (32, 64):
                run(f"all b{b} gptq", {n: (b, False, "gptq") for n in names})
        elif exp == "imatrix":
            for b in (32, 64):
                run(f"all b{b}", {n: (b, False) for n in names})
                run(f"all b{b} imatrix", {n: (b, True) for n in names})
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
