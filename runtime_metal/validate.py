"""The verification ladder (docs/DESIGN.md): HF transformers -> onnxruntime -> MLX, on a few
prompts.

Each rung reports the logits error (rel = max|a - b| / max|b|) against the rung above and
greedy agreement with HF over n tokens. Users check their own conversions with it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fuselm.runtime_metal.errors import NonFiniteLogitsError
from fuselm.runtime_metal.generate import generate, prefill_chunk_for
from fuselm.runtime_metal.loaded_model import open_model
from fuselm.runtime_metal.prefix import common_prefix as agreement


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a.astype(np.float64) - b)) / max(np.max(np.abs(b)), 1e-30))


def hf_model(model_dir: str | Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the ladder's table is the output; no loading bars
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return model.eval()


def hf_logits(model: Any, ids: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def hf_greedy(model: Any, ids: list[int], n: int) -> list[int]:
    """Greedy with HF's own KV cache, ignoring EOS (we compare n tokens exactly)."""
    import torch

    prompt = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n,
                             min_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(ids):].tolist()


def engine_logits(engine: Any, ids: list[int], chunk: int | None) -> np.ndarray:
    chunk = prefill_chunk_for(engine, chunk)
    engine.reset()
    parts = [engine.forward(np.asarray(ids[i:i + chunk])[None], all_logits=True)
             for i in range(0, len(ids), chunk)]
    return np.concatenate(parts, axis=0)


@dataclass
class Rung:
    name: str
    logits_rel: list[float] = field(default_factory=list)  # vs the rung above
    logits_rel_hf: list[float] = field(default_factory=list)
    greedy_agree: list[int] = field(default_factory=list)  # leading tokens identical to HF
    perplexity: dict[str, float] | None = None  # PPL of the ladder's text (rung_perplexity)
    nonfinite: list[bool] = field(default_factory=list)  # NaN/Inf in this prompt's logits


@dataclass
class Report:
    n_tokens: int
    prompts: list[list[int]]
    rungs: list[Rung]

    def to_dict(self) -> dict[str, object]:
        return {"n_tokens": self.n_tokens, "prompts": len(self.prompts),
                "rungs": [r.__dict__ for r in self.rungs]}




def validate(model_dir: str | Path, out_dir: str | Path, prompts: list[list[int]],
             n_tokens: int = 32, prefill_chunk: int | None = None,
             engines: tuple[str, ...] = ("onnxruntime", "mlx"),
             ppl_tokens: list[int] | None = None, ppl_context: int = 256,
             on_prompt: Callable[[int], None] | None = None,
             reference: Any = None,
             on_ppl: Callable[[str, int, int, float], None] | None = None) -> Report:
    """Run the ladder; `on_prompt(i)` is called after prompt i (progress); with `ppl_tokens`,
    every rung's PPL on them too (rung_perplexity). `reference`: the HF model to compare with
    (default: model_dir's, in float32; a GGUF's or an AWQ / GPTQ folder's dequantized weights
    are given here). `on_ppl(rung, chunks done, chunks, PPL so far)`:
    the PPL phase's progress."""
    model = reference if reference is not None else hf_model(model_dir)
    rungs = [Rung("hf")]
    opened = {}
    for name in engines:
        # accuracy_level 0: float compute, so Q4 differences are the weights', not ORT's.
        opts = {"accuracy_level": 0} if name == "onnxruntime" else {}
        opened[name] = open_model(out_dir, name, **opts).engine
        rungs.append(Rung(name))
    for i, ids in enumerate(prompts):
        ref = hf_logits(model, ids)
        ref_tokens = hf_greedy(model, ids, n_tokens)
        rungs[0].greedy_agree.append(n_tokens)
        rungs[0].nonfinite.append(not bool(np.isfinite(ref).all()))
        above = ref
        for rung in rungs[1:]:
            eng = opened[rung.name]
            got = engine_logits(eng, ids, prefill_chunk)
            rung.logits_rel.append(rel(got, above))
            rung.logits_rel_hf.append(rel(got, ref))
            rung.nonfinite.append(not bool(np.isfinite(got).all()))
            try:
                res = generate(eng, ids, max_new_tokens=n_tokens, prefill_chunk=prefill_chunk)
                rung.greedy_agree.append(agreement(res.tokens, ref_tokens))
            except NonFiniteLogitsError:  # recorded as nonfinite above: a FAIL, not an error
                rung.greedy_agree.append(0)
            above = got
        if on_prompt is not None:
            on_prompt(i)
    if ppl_tokens is not None:
        rung_perplexity(rungs, model, opened, ppl_tokens, ppl_context, on_ppl)
    return Report(n_tokens, prompts, rungs)


def rung_perplexity(rungs: list[Rung], model: Any, engines: dict[str, Any],
                    tokens: list[int], context: int,
                    on_ppl: Callable[[str, int, int, float], None] | None = None) -> None:
    """PPL of every rung on the same tokens (runtime_metal/perplexity.py's chunking rule)."""
    from fuselm.runtime_metal.perplexity import engine_logits_fn, perplexity_of

    for rung in rungs:
        fn = (lambda ids: hf_logits(model, ids)) if rung.name == "hf" else engine_logits_fn(
            engines[rung.name])
        report = None if on_ppl is None else (
            lambda done, total, ppl, name=rung.name: on_ppl(name, done, total, ppl))
        r = perplexity_of(fn, tokens, context, engine=rung.name, on_chunk=report)
        rung.perplexity = {"ppl": r.ppl, "ppl_stderr": r.ppl_stderr, "context": r.context,
                           "scored_tokens": r.scored_tokens}
