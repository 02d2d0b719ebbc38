"""PASS / WARN / FAIL for a validation rung: thresholds on rel = max|a-b| / max|b| of the
logits against HF float32, one pair per weight precision.

Why these numbers (measured on the test suite's models and on real checkpoints):
- float32: the artifact computes what HF computes, only in another order; fused ops and
  onnxruntime/MLX kernels leave rel around 1e-6..1e-5. 1e-4 still passes (the suite's own
  bound); beyond 1e-3 something is computed differently (a wrong op, a wrong constant).
- float16: every weight and activation is rounded to 11 bits (relative step 2^-11 ≈ 5e-4)
  and the rounding accumulates over layers: 1e-2 passes; beyond 5e-2 the model is damaged.
- bfloat16: 8 significant bits, a step 8x float16's (the weights; on a CPU the activations
  are float32). Measured on SmolLM2-135M-Instruct against its GGUF's own weights: rel 5.8e-3
  (float16: 1.5e-3), PPL -0.05 %. 2e-2 passes; beyond 5e-2, as for float16, it is damaged.
- Q4 (4-bit blocks): the weights themselves change by up to half a quantization step (1/30
  of a block's range), so logits move by several percent: 0.2 passes, beyond 0.5 the logits
  are no longer the model's (a wrong scale, a wrong block layout).
- Q4 with the PPL measured (validate's default): the PPL increase over the reference judges
  it instead, since a rounded weight moves some logits far (rel 0.6 on SmolLM2-135M) while
  the model is as good as its bits allow. Measured on SmolLM2-135M-Instruct against its
  GGUF's own weights (BENCHMARKS.md, "Validation verdicts"): a float16 import +0.001 %,
  fuselm's default Q4 re-quantization +14.6 %, the data-free quantizer +27 %, mlx-lm's default
  4-bit +38.6 %, plain min/max +34.8 %. So +25 % passes, beyond +50 % fails.
Greedy agreement with HF is reported but not judged: two near-equal logits may swap under
any rounding and the texts then diverge, although the model is right.
NaN or Inf in any logits is a FAIL, whatever the precision.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# precision -> (pass at or below, fail above); in between: WARN
THRESHOLDS: dict[str, tuple[float, float]] = {
    "float32": (1e-4, 1e-3),
    "float16": (1e-2, 5e-2),
    "bfloat16": (2e-2, 5e-2),
    "q4": (0.2, 0.5),
}
# Q4 with the PPL measured: (pass at or below, fail above) on PPL / reference PPL - 1.
PPL_INCREASE = (0.25, 0.5)


def precision(dtype: str, quantization: dict | None) -> str:
    """The threshold key of an artifact: q4 when its weights are quantized, else its dtype.
    Blocks all kept from a quantized source (a GGUF's, an AWQ / GPTQ folder's; none rounded
    again) are the reference's own weights, so the dtype's bound judges them: Q4's would pass a
    wrong import."""
    given = (quantization or {}).get("given") or {}
    if quantization and not (given.get("kept") and given.get("quantized") == 0):
        return "q4"
    return dtype if dtype in THRESHOLDS else "float16"  # another 16-bit float: float16's bound


@dataclass
class Verdict:
    status: str  # PASS | WARN | FAIL
    reason: str


def judge(rel_hf: list[float], nonfinite: list[bool], key: str,
          ppl_increase: float | None = None) -> Verdict:
    """The verdict on the logits' rel against the reference; for Q4 with `ppl_increase`
    (PPL / reference PPL - 1, the same tokens) on that instead."""
    ok, bad = THRESHOLDS[key]
    if any(nonfinite) or any(math.isnan(r) for r in rel_hf):
        return Verdict("FAIL", "NaN/Inf in the logits")
    if key == "q4" and ppl_increase is not None:
        ok, bad = PPL_INCREASE
        what = f"PPL {ppl_increase:+.1%} vs the reference (q4; rel {max(rel_hf):.2e})"
        if math.isnan(ppl_increase) or ppl_increase > bad:
            return Verdict("FAIL", f"{what} > +{bad:.0%}")
        return Verdict("PASS", f"{what} <= +{ok:.0%}") if ppl_increase <= ok else Verdict(
            "WARN", f"{what} > +{ok:.0%} but <= +{bad:.0%}")
    worst = max(rel_hf)
    if worst <= ok:
        return Verdict("PASS", f"rel {worst:.2e} <= {ok:g} ({key})")
    if worst <= bad:
        return Verdict("WARN", f"rel {worst:.2e} > {ok:g} but <= {bad:g} ({key})")
    return Verdict("FAIL", f"rel {worst:.2e} > {bad:g} ({key})")
